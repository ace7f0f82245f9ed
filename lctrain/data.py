"""Built-in synthetic data and the deterministic data-parallel sampler.

`SyntheticLM` generates sample i from (seed, i) alone, so any rank can produce any sample and a
resume needs only a counter. Documents are walks of a hidden sparse bigram chain (each token has
`branching` successors with Zipf weights), and the second half of every document repeats its
first half: the chain is learnable from the current token, the repeat only through attention.
Documents are packed back to back, separated by EOS (token 0).

Global sample order: optimizer step s consumes samples [s*G, (s+1)*G), G = global_batch. DP rank r
takes the contiguous slice [r*G/dp, (r+1)*G/dp) of it, cut into `grad_accum` micro-batches, so the
union over ranks and micro-steps is the same set for every (dp, micro_batch) split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lctrain.config import DataConfig

EOS = 0
IGNORE_INDEX = -100


class SyntheticLM:
    """Deterministic packed sequences of `seq_len + 1` tokens (inputs and shifted labels)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, seed: int):
        self.cfg, self.vocab_size, self.seq_len, self.seed = cfg, vocab_size, seq_len, seed
        rng = np.random.default_rng([seed, 0xC4A1])
        b = cfg.branching
        self.successors = rng.integers(1, vocab_size, size=(vocab_size, b))
        weights = 1.0 / np.arange(1, b + 1)
        self.cum_weights = np.cumsum(weights / weights.sum())

    def _document(self, rng: np.random.Generator, length: int) -> np.ndarray:
        half = max(1, length // 2)
        picks = np.searchsorted(self.cum_weights, rng.random(half), side="right")
        picks = np.minimum(picks, self.cfg.branching - 1)
        walk = np.empty(half, dtype=np.int64)
        tok = int(rng.integers(1, self.vocab_size))
        for i in range(half):
            walk[i] = tok
            tok = int(self.successors[tok, picks[i]])
        return np.concatenate([walk, walk])[:length]

    def sample(self, index: int) -> Tensor:
        """Sample `index` as int64 tokens [seq_len + 1]."""
        rng = np.random.default_rng([self.seed, 0x5EED, index])
        parts, n = [], 0
        while n < self.seq_len + 1:
            doc = self._document(rng, int(rng.integers(self.cfg.doc_len_min,
                                                       self.cfg.doc_len_max + 1)))
            parts += [doc, np.array([EOS])]
            n += len(doc) + 1
        return torch.from_numpy(np.concatenate(parts)[: self.seq_len + 1])


@dataclass
class MicroBatch:
    inputs: Tensor
    """Token ids [B, S]."""
    labels: Tensor
    """Next-token targets [B, S], IGNORE_INDEX where no target."""


class DataParallelSampler:
    """Yields, per optimizer step, this dp rank's `grad_accum` micro-batches. Resumable."""

    def __init__(self, dataset: SyntheticLM, dp_rank: int, dp: int, micro_batch: int,
                 grad_accum: int):
        assert 0 <= dp_rank < dp, f"dp_rank {dp_rank} outside [0, {dp})"
        self.dataset, self.dp_rank, self.dp = dataset, dp_rank, dp
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.step = 0

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def indices(self, step: int) -> list[list[int]]:
        """Global sample indices of this rank's micro-batches at optimizer step `step`."""
        per_rank = self.micro_batch * self.grad_accum
        start = step * self.global_batch + self.dp_rank * per_rank
        return [list(range(start + m * self.micro_batch, start + (m + 1) * self.micro_batch))
                for m in range(self.grad_accum)]

    def next_step(self) -> list[MicroBatch]:
        out = []
        for idx in self.indices(self.step):
            seqs = torch.stack([self.dataset.sample(i) for i in idx])
            out.append(MicroBatch(inputs=seqs[:, :-1], labels=seqs[:, 1:].clone()))
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
