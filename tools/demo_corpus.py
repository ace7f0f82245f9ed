"""Real text and a tokenizer for the README's context-extension demo, offline: this repository's
Markdown (README.md, docs/*.md, tools/README.md), one document per paragraph, written as
OUT/corpus.jsonl, and a byte-level BPE of `--vocab` tokens trained on it, OUT/tokenizer.json
(with <s> and </s>). Any text encodes (bytes are tokens), digits and the needle's words
included.

    python tools/demo_corpus.py demo [--vocab 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("README.md", "docs/*.md", "tools/README.md")
MIN_CHARS = 40
"""Paragraphs shorter than this (headings, rules) are left out."""


def paragraphs() -> list[str]:
    """The repository's Markdown, paragraph by paragraph, in a fixed order."""
    out = []
    for pattern in SOURCES:
        for path in sorted(REPO.glob(pattern)):
            for block in path.read_text(encoding="utf-8").split("\n\n"):
                text = " ".join(block.split())
                if len(text) >= MIN_CHARS:
                    out.append(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=int, default=512)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    texts = paragraphs()
    with open(args.out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(args.out / "tokenizer.json"))
    chars = sum(map(len, texts))
    print(f"{args.out / 'corpus.jsonl'}: {len(texts):,} paragraphs, {chars:,} characters; "
          f"{args.out / 'tokenizer.json'}: {tok.get_vocab_size():,} tokens")


if __name__ == "__main__":
    main()
