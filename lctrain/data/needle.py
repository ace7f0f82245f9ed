"""Needle in a haystack with real text (eval.tasks=[needle]), in the spirit of RULER's NIAH: the
haystack is held-out text (the validation documents of data.val_fraction or eval.val_data),
tokenized by the model's own tokenizer, so a pretrained model reads language it knows.

An example of context length L and depth d: haystack text with the needle sentence "The special
magic number for <key> is: <7 digits>." inserted at the share d of it, then the question "What
is the special magic number for <key> mentioned in the provided text? The special magic number
for <key> is:" at the end, followed by the answer, the digits, which are scored. Variants
(RULER's multi-key and multi-value): eval.needle_keys needles with different keys, of which one
is asked (the others are distractors at random depths); eval.needle_values values for the asked
key, all asked for in the order they appear ("The special magic numbers for <key> are: <v1>,
<v2>"), one of them at depth d.

The needle's value and the answer are the same token ids (each piece is tokenized on its own:
" <digits>", "," and the sentences), so the answer can be copied. The evaluator scores it by
teacher forcing, which for exact match is greedy decoding: greedy generation produces the
answer exactly when the argmax at each answer position, given the answer's own prefix, is the
next answer token, which is what one forward checks. Everything is placed at token boundaries
of the haystack; an example is one document (document masking sees the whole context).
"""

from __future__ import annotations

import numpy as np

from lctrain.config import LctrainConfig
from lctrain.data.sources import build_val_source
from lctrain.data.tokenizer import load_tokenizer

KEYS = ("amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
        "juniper", "kestrel", "lantern", "meadow", "nickel", "orchid", "pebble")
"""The needles' keys: distinct words, one per needle of an example."""
DIGITS = 7
"""Digits of a needle's value (its first digit never 0)."""
NEEDLE = " The special magic number for {key} is:"
NEEDLE_END = "."
QUESTION = (" What is the special magic number for {key} mentioned in the provided text? The "
            "special magic number for {key} is:")
QUESTION_MANY = (" What are all the special magic numbers for {key} mentioned in the provided "
                 "text? The special magic numbers for {key} are:")
SEPARATOR = ","
"""Between the values of a multi-value answer."""


def needle_problems(cfg: LctrainConfig) -> list[str]:
    """eval.lengths the needle task cannot fill with its needles, question and answer (in the
    model's tokens), and a tokenizer that cannot be read."""
    try:
        need = NeedleTask(cfg).min_length()
    except (ValueError, OSError) as e:
        return [f"eval.tasks has needle: {e}"]
    where = ("eval.lengths contains {n}" if cfg.eval.lengths else
             "train.seq_len={n} (scored as eval.lengths is empty)")
    return [f"{where.format(n=n)}; the needle task needs contexts of at least {need} tokens "
            f"(eval.needle_keys={cfg.eval.needle_keys}, eval.needle_values="
            f"{cfg.eval.needle_values}, in the model's tokens)"
            for n in cfg.eval.lengths or [cfg.train.seq_len] if n < need]


class NeedleTask:
    """Examples of the needle task for `lctrain.data.tasks.eval_examples` (name, tag, seq_len,
    document)."""

    name, tag = "needle", 3

    def __init__(self, cfg: LctrainConfig):
        from tokenizers import Tokenizer  # lazy: only runs that score the needle need it

        self.cfg, self.seq_len = cfg, cfg.train.seq_len
        self.keys, self.values = cfg.eval.needle_keys, cfg.eval.needle_values
        self.tokenizer = Tokenizer.from_str(load_tokenizer(cfg.data).json)
        self.haystack = build_val_source(cfg)

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids,
                        dtype=np.int64)

    def _value(self, rng: np.random.Generator) -> np.ndarray:
        return self.encode(f" {rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS)}")

    def pieces(self, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray,
                                                        np.ndarray]:
        """(needles, question, answer): the asked key's needles first (one per value), then
        one needle per distractor key; the answer is the asked values in needle order."""
        keys = rng.choice(KEYS, size=self.keys, replace=False)
        values = [self._value(rng) for _ in range(self.values)]
        needles = [np.concatenate([self.encode(NEEDLE.format(key=keys[0])), v,
                                   self.encode(NEEDLE_END)]) for v in values]
        needles += [np.concatenate([self.encode(NEEDLE.format(key=k)), self._value(rng),
                                    self.encode(NEEDLE_END)]) for k in keys[1:]]
        question = self.encode((QUESTION if self.values == 1 else QUESTION_MANY).format(
            key=keys[0]))
        separator = self.encode(SEPARATOR)
        answer = np.concatenate([piece for i, v in enumerate(values)
                                 for piece in ([separator] if i else []) + [v]])
        return needles, question, answer

    def min_length(self) -> int:
        """Tokens of the longest needles, question and answer an example can have, haystack
        left out: a value is at most one token per byte of " <digits>"."""
        value = DIGITS + 1
        needle = max(len(self.encode(NEEDLE.format(key=k))) for k in KEYS) + value + len(
            self.encode(NEEDLE_END))
        question = max(len(self.encode((QUESTION if self.values == 1 else QUESTION_MANY)
                                       .format(key=k))) for k in KEYS)
        answer = self.values * value + (self.values - 1) * len(self.encode(SEPARATOR))
        return (self.keys + self.values - 1) * needle + question + answer

    def document(self, rng: np.random.Generator, length: int,
                 depth: float) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [length], offsets of the answer tokens in it)."""
        needles, question, answer = self.pieces(rng)
        room = length - sum(map(len, needles)) - len(question) - len(answer)
        if room < 0:
            raise ValueError(f"eval.lengths contains {length}, too short for the needle task's "
                             f"{length - room} tokens of needles and question; use lengths of at "
                             f"least {self.min_length()}")
        sample = int(rng.integers(self.haystack.samples_per_epoch))
        text = self.haystack.window(sample).read(0, self.seq_len + 1)[:room]
        asked = self.values
        cuts = [round(depth * room)] + list(rng.integers(0, room + 1, len(needles) - 1))
        order = sorted(range(len(needles)), key=lambda j: (cuts[j], j))
        placed = iter(range(asked))  # the asked values in text order: the answer's order
        pieces, prev = [], 0
        for j in order:
            needle = needles[next(placed)] if j < asked else needles[j]
            pieces += [text[prev:cuts[j]], needle]
            prev = cuts[j]
        pieces += [text[prev:], question, answer]
        tokens = np.concatenate(pieces).astype(np.int64)
        return tokens, np.arange(length - len(answer), length)
