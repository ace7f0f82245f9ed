"""Built-in synthetic data: deterministic, learnable, any vocabulary.

`BigramChain` is a hidden sparse bigram chain: each token has `branching` successors with Zipf
weights, so a walk is predictable from the current token alone down to about ln(branching) nats.
`SyntheticLM` documents are walks whose second half repeats the first half: the chain is
learnable from the current token, the repeat only through attention. Sample i is a function of
(seed, i) alone, so any rank produces any sample and a resume needs only a counter. Documents are
packed back to back, each ending with EOS (token 0), and the window knows their lengths.
"""

from __future__ import annotations

import numpy as np

from lctrain.config import DataConfig
from lctrain.data.batch import Window, array_window

EOS = 0


class BigramChain:
    """Walks of a hidden sparse bigram chain over the token ids [low, high)."""

    def __init__(self, low: int, high: int, branching: int, seed: int):
        assert 0 <= low < high, f"empty token range [{low}, {high})"
        self.low, self.high, self.branching = low, high, branching
        rng = np.random.default_rng([seed, 0xC4A1])
        self.successors = rng.integers(low, high, size=(high, branching))
        weights = 1.0 / np.arange(1, branching + 1)
        self.cum_weights = np.cumsum(weights / weights.sum())

    def walk(self, rng: np.random.Generator, length: int) -> np.ndarray:
        picks = np.searchsorted(self.cum_weights, rng.random(length), side="right")
        picks = np.minimum(picks, self.branching - 1)
        out = np.empty(length, dtype=np.int64)
        tok = int(rng.integers(self.low, self.high))
        for i in range(length):
            out[i] = tok
            tok = int(self.successors[tok, picks[i]])
        return out


def document_length(rng: np.random.Generator, cfg: DataConfig) -> int:
    """A document length in [doc_len_min, doc_len_max]: uniform, or log-uniform (as many
    documents of 8 to 16 tokens as of 128 to 256)."""
    lo, hi = cfg.doc_len_min, cfg.doc_len_max
    if cfg.doc_len_dist == "uniform":
        return int(rng.integers(lo, hi + 1))
    return min(hi, int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))))


def pack(rng: np.random.Generator, make_doc, cfg: DataConfig, size: int) -> Window:
    """Documents from make_doc(rng, length) (each followed by EOS) until `size` tokens."""
    parts, lengths, n = [], [], 0
    while n < size:
        doc = make_doc(rng, document_length(rng, cfg))
        doc = np.concatenate([doc, [EOS]])[: size - n]
        parts.append(doc)
        lengths.append(len(doc))
        n += len(doc)
    return array_window(np.concatenate(parts), np.array(lengths), size)


class SyntheticLM:
    """Packed documents: a chain walk, then the same walk again."""

    name = "synthetic"
    dropped = 0
    """Documents skipped (none: generated documents fit by construction)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, seed: int):
        self.cfg, self.seq_len, self.seed = cfg, seq_len, seed
        self.chain = BigramChain(1, vocab_size, cfg.branching, seed)

    def _document(self, rng: np.random.Generator, length: int) -> np.ndarray:
        walk = self.chain.walk(rng, max(1, length // 2))
        return np.concatenate([walk, walk])[:length]

    def window(self, index: int) -> Window:
        """Sample `index`: seq_len + 1 tokens of packed documents."""
        rng = np.random.default_rng([self.seed, 0x5EED, index])
        return pack(rng, self._document, self.cfg, self.seq_len + 1)

    def fingerprint(self) -> dict:
        c = self.cfg
        return {"source": self.name, "doc_len": [c.doc_len_min, c.doc_len_max],
                "branching": c.branching, "vocab": self.chain.high}
