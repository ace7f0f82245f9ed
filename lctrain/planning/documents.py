"""Packed documents in the plan: what the corpus's document lengths (plan.documents) do to the
context-parallel attention under each load balance (docs/parallelism.md §24).

From the length histogram the plan draws `ROWS` packed rows (documents log-uniform inside each
bucket, as many per bucket as the corpus has, concatenated and cut every S tokens) and splits
each as the run would (`lctrain.layout.packed.split_cost`). Three numbers come out:

- `attention_fraction`: the attention work of documents attending only to themselves, over that
  of one causal sequence (sum L^2 / S^2, about): the attention FLOPs the kernels run;
- `balance`: the slowest balance unit's work over the mean (1 for Ulysses, whose every rank
  holds every token); the step waits for the slowest, so the attention time is multiplied by it;
- `share`: the travelling share of the K/V (the most travelling tokens of a unit over its S/R,
  the largest of a micro-batch's rows): ring, USP's ring and all-gather KV send that much.

Without a histogram, or without document masking, all three are 1: one document per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.config.load_balances import auto_load_balance
from lctrain.layout.packed import LengthSampler, sample_rows, split_cost

ROWS = 8
"""Packed rows drawn per prediction (each split costs milliseconds: the layout search asks for
every cp layout)."""


@dataclass(frozen=True)
class PackedDocuments:
    attention_fraction: float = 1.0
    balance: float = 1.0
    share: float = 1.0
    known: bool = False
    """Whether a histogram was given (else the one-document defaults)."""


ONE_DOCUMENT = PackedDocuments()


def histogram_sampler(histogram: tuple[tuple[int | None, int, int], ...],
                      seq_len: int) -> LengthSampler:
    """Document lengths drawn from a [max_len, documents, tokens] histogram: a bucket as often
    as the corpus has its documents, log-uniform inside it (the open last bucket up to twice
    its lower bound, or S)."""
    uppers = [row[0] for row in histogram]
    lows = [0] + [u for u in uppers[:-1]]
    bounds = np.array([(max(lo, 0) + 1, hi if hi is not None else max(2 * (lo or 1), seq_len))
                       for lo, hi in zip(lows, uppers)], dtype=np.float64)
    counts = np.array([row[1] for row in histogram], dtype=np.float64)

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        lo, hi = bounds[rng.choice(len(bounds), size=n, p=counts / counts.sum())].T
        lengths = np.exp(rng.uniform(np.log(lo), np.log(hi + 1))).astype(np.int64)
        return np.clip(lengths, lo.astype(np.int64), hi.astype(np.int64))

    return draw


def histogram_rows(histogram: tuple[tuple[int | None, int, int], ...], seq_len: int,
                   rows: int, seed: int = 0) -> list[np.ndarray]:
    """`rows` packed rows of documents drawn from a [max_len, documents, tokens] histogram."""
    return sample_rows(histogram_sampler(histogram, seq_len), seq_len, rows, seed)


@cache
def _predict(histogram: tuple, seq_len: int, cp: int, load_balance: str, ulysses: int,
             micro_batch: int) -> PackedDocuments:
    rows = histogram_rows(histogram, seq_len, ROWS * micro_batch)
    costs = [split_cost(r, cp, load_balance, ulysses) for r in rows]
    whole = seq_len * (seq_len + 1) / 2
    shares = [max(c.share for c in costs[i:i + micro_batch])
              for i in range(0, len(costs), micro_batch)]
    return PackedDocuments(
        attention_fraction=float(np.mean([c.work.sum() / whole for c in costs])),
        balance=float(np.mean([c.max_over_mean for c in costs])),
        share=float(np.mean(shares)) if ulysses < cp else 1.0, known=True)


def packed_documents(cfg: LctrainConfig, load_balance: str | None = None) -> PackedDocuments:
    """The corpus's effect on this layout's attention (`load_balance`: another split than the
    config's, for comparison)."""
    if not cfg.data.document_masking or not cfg.plan.documents:
        return ONE_DOCUMENT
    p = cfg.parallel
    histogram = tuple(tuple(row) for row in cfg.plan.documents)
    balance = load_balance or load_balance_of(cfg)
    if p.cp == 1:
        balance = "none"
    return _predict(histogram, cfg.train.seq_len, p.cp, balance, ulysses_degree(p),
                    cfg.train.micro_batch)


def travelling_share(cfg: LctrainConfig) -> float:
    """The share of the K/V that ring and all-gather KV send (1: every token)."""
    return packed_documents(cfg).share


def load_balance_table(cfg: LctrainConfig) -> dict[str, dict[str, float]]:
    """{load balance: its predicted attention_fraction, balance and share} for the two splits
    `auto` chooses between, zigzag and documents (`lctrain plan`'s comparison); {} without a
    histogram or at cp = 1."""
    if cfg.parallel.cp == 1 or not packed_documents(cfg).known:
        return {}
    out = {}
    for name in (auto_load_balance(False), auto_load_balance(True)):
        docs = packed_documents(cfg, name)
        out[name] = {"attention_fraction": docs.attention_fraction, "balance": docs.balance,
                     "share": docs.share}
    return out
