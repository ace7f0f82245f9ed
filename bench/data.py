"""Data pipeline benchmarks on the CPU. Prints tables.

    python bench/data.py                          # every section
    python bench/data.py --section preprocess     # lctrain preprocess tokens/s, 1 vs 2 workers
    python bench/data.py --section loader         # loader vs tiny-model training step at 256K

preprocess: a generated corpus of --docs JSON lines (Zipf-distributed words, 50 to 2000 words
each), a BPE tokenizer of 512 tokens trained here, then `preprocess` with 1 and with 2 workers
on the same input, side by side (their outputs must be byte-identical, which is checked).
loader: the dataset packed into sequences of --seq-len tokens (262,144 by default); the time of
one loader step (micro-batch of 1) for cp=1 and for one rank of cp=8, with and without
document masking, against one training step (forward, backward, AdamW) of the tiny model on the
same micro-batch in one process, with document masking so attention stays within documents
and full activation checkpointing so 256K tokens of activations fit in memory.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from lctrain.config import LctrainConfig  # noqa: E402
from lctrain.data.preprocess import preprocess  # noqa: E402

WORDS = [f"w{i}" for i in range(3000)]


def make_corpus(folder: Path, docs: int) -> tuple[Path, Path]:
    """A JSON lines corpus and a 512-token BPE tokenizer trained on its first documents."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, len(WORDS) + 1)
    weights /= weights.sum()
    corpus = folder / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(docs):
            n = int(rng.integers(50, 2000))
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=n, p=weights))}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  show_progress=False)
    with open(corpus) as f:
        tok.train_from_iterator((json.loads(line)["text"] for _, line in zip(range(300), f)),
                                trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return corpus, path


def run_preprocess(corpus: Path, tokenizer: Path, output: Path, workers: int):
    cfg = LctrainConfig()
    cfg.data.path, cfg.data.tokenizer = str(corpus), str(tokenizer)
    cfg.preprocess.output, cfg.preprocess.workers = str(output), workers
    return preprocess(cfg, progress=False)


def section_preprocess(folder: Path, docs: int) -> Path:
    corpus, tokenizer = make_corpus(folder, docs)
    print(f"\npreprocess: {docs:,} documents, {corpus.stat().st_size / 2**20:.1f} MiB of JSON "
          "lines, BPE 512")
    print(f"{'workers':>8} {'tokens':>12} {'seconds':>9} {'tokens/s':>12}")
    outputs = []
    for workers in (1, 2):
        out = folder / f"tokens-w{workers}"
        s = run_preprocess(corpus, tokenizer, out, workers)
        outputs.append(out)
        print(f"{workers:>8} {s.tokens:>12,} {s.seconds:>9.2f} {s.tokens_per_sec:>12,.0f}")
    same = all(filecmp.cmp(outputs[0] / f.name, outputs[1] / f.name, shallow=False)
               for f in sorted(outputs[0].iterdir()))
    print(f"outputs byte-identical: {same}")
    return outputs[-1]


def _loader_step_seconds(cfg, source, cp_rank: int, cp: int, masking: bool, reps: int) -> float:
    from lctrain.data.loader import DataLoader

    loader = DataLoader(source, cfg.train.seq_len, dp_rank=0, dp=1, cp_rank=cp_rank, cp=cp,
                        load_balance="zigzag", micro_batch=1, grad_accum=1,
                        document_masking=masking, seed=0)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loader.next_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _train_step_seconds(cfg, source) -> float:
    import torch

    from lctrain.data.loader import DataLoader
    from lctrain.parallel.parallelize import build_model
    from lctrain.parallel.runtime import setup_distributed
    from lctrain.training.optim import build_optimizer, build_scheduler
    from lctrain.training.step import train_step

    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim, cfg.train.steps)
    loader = DataLoader(source, cfg.train.seq_len, dp_rank=0, dp=1, cp_rank=0, cp=1,
                        load_balance="zigzag", micro_batch=1, grad_accum=1,
                        document_masking=True, seed=0)
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    train_step(model, opt, sched, loader.next_step(), cfg, rt)
    return time.perf_counter() - t0


def section_loader(dataset: Path, seq_len: int) -> None:
    from lctrain.data.packing import PackedTokens
    from lctrain.data.shards import TokenStore

    cfg = LctrainConfig()
    cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = seq_len, 1, 1
    cfg.data.document_masking = True
    cfg.train.activation_checkpointing = "full"  # 256K tokens of activations fit any machine
    cfg.logging.progress = False
    source = PackedTokens(TokenStore(dataset), seq_len, seed=0)
    print(f"\nloader: {source.tokens:,} tokens, {source.samples_per_epoch} sequences of "
          f"{seq_len:,}; tiny model {cfg.model.n_layers} layers x {cfg.model.dim}")
    step = _train_step_seconds(cfg, source)
    print(f"{'layout':>18} {'masking':>8} {'loader s':>10} {'tokens/s':>12} {'step/loader':>12}")
    for cp_rank, cp in ((0, 1), (3, 8)):
        for masking in (False, True):
            t = _loader_step_seconds(cfg, source, cp_rank, cp, masking, reps=5)
            name = "cp=1" if cp == 1 else f"cp=8, rank {cp_rank}"
            print(f"{name:>18} {str(masking):>8} {t:>10.4f} {seq_len / cp / t:>12,.0f} "
                  f"{step / cp / t:>12,.0f}")
    print(f"tiny-model training step at {seq_len:,} tokens (1 process, document masking): "
          f"{step:.1f} s; step/loader divides the step by cp (each rank's share of the work)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", choices=("preprocess", "loader"), default=None)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--seq-len", type=int, default=262144)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.section == "loader":  # a corpus is still needed; fewer documents suffice
            dataset = section_preprocess(folder, min(args.docs, 4000))
        else:
            dataset = section_preprocess(folder, args.docs)
        if args.section in (None, "loader"):
            section_loader(dataset, args.seq_len)


if __name__ == "__main__":
    main()
