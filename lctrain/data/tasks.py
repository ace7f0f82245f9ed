"""Built-in long-context tasks, generated on the fly for any vocabulary: passkey retrieval (a needle
in a haystack) and multi-key associative recall. Training sources and eval examples share one
document generator per task, so the evals score exactly what training teaches.

Token ids for a vocabulary of V (q = V // 4): 0 EOS, 1 KEY, 2 QUERY; filler text [3, 2q) from a
hidden bigram chain (lctrain.data.synthetic.BigramChain); recall keys [2q, 3q); passkeys and
recall values [3q, V). The answer can only be copied from the needle, wherever it is, so it takes
attention across the whole context (with context parallelism, across ranks).

- passkey (length L, depth d): filler[:n1] KEY a_1..a_k filler[n1:] QUERY a_1..a_k, where n1 is
  the share d of the filler before the needle and k = data.answer_len.
- recall: data.recall_pairs needles "KEY key v_1..v_k" spread through the filler, then every
  pair queried in random order, "QUERY key v_1..v_k". The scored pair sits at depth d and is
  queried last.

A document shorter than its needle and query is plain filler. Sample i of a training source is a
function of (seed, i): documents of data.doc_len_min..doc_len_max tokens, depth uniform, packed
with EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lctrain.config import DataConfig
from lctrain.data.batch import Window, array_window
from lctrain.data.synthetic import EOS, BigramChain, pack

KEY, QUERY = 1, 2
FILLER_LOW = 3
MIN_VOCAB = 32


class _Task:
    """Shared by the tasks: the vocabulary split, the filler, training windows."""

    name, tag = "", 0
    """Task name, and its id in the random streams."""
    dropped = 0
    """Documents skipped (none: generated documents fit by construction)."""

    def __init__(self, cfg: DataConfig, vocab_size: int, seq_len: int, seed: int):
        assert vocab_size >= MIN_VOCAB, f"tasks need a vocabulary of at least {MIN_VOCAB}"
        self.cfg, self.vocab_size, self.seq_len, self.seed = cfg, vocab_size, seq_len, seed
        q = vocab_size // 4
        self.keys, self.answers = (2 * q, 3 * q), (3 * q, vocab_size)
        self.chain = BigramChain(FILLER_LOW, 2 * q, cfg.branching, seed)

    def _answer(self, rng: np.random.Generator) -> np.ndarray:
        return rng.integers(*self.answers, size=self.cfg.answer_len)

    def document(self, rng: np.random.Generator, length: int,
                 depth: float) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [length], offsets of the scored answer tokens in it)."""
        raise NotImplementedError

    def window(self, index: int) -> Window:
        rng = np.random.default_rng([self.seed, 0x7A5C, self.tag, index])
        return pack(rng, lambda r, n: self.document(r, n, float(r.random()))[0], self.cfg,
                    self.seq_len + 1)

    def fingerprint(self) -> dict:
        c = self.cfg
        return {"source": self.name, "doc_len": [c.doc_len_min, c.doc_len_max],
                "branching": c.branching, "answer_len": c.answer_len,
                "recall_pairs": c.recall_pairs, "vocab": self.vocab_size}


class Passkey(_Task):
    name, tag = "passkey", 1

    @staticmethod
    def context_needed(cfg: DataConfig) -> int:
        """Tokens of the needle and the query: shorter documents are plain filler."""
        return 2 * (cfg.answer_len + 1)

    def min_length(self) -> int:
        return self.context_needed(self.cfg)

    def document(self, rng, length, depth):
        k = self.cfg.answer_len
        if length < self.min_length():
            return self.chain.walk(rng, length), np.zeros(0, dtype=np.int64)
        filler = self.chain.walk(rng, length - self.min_length())
        answer = self._answer(rng)
        n1 = round(depth * len(filler))
        tokens = np.concatenate([filler[:n1], [KEY], answer, filler[n1:], [QUERY], answer])
        return tokens, np.arange(length - k, length)


class Recall(_Task):
    name, tag = "recall", 2

    @staticmethod
    def context_needed(cfg: DataConfig) -> int:
        """Tokens of every needle and query: shorter documents are plain filler."""
        return 2 * cfg.recall_pairs * (cfg.answer_len + 2)

    def min_length(self) -> int:
        return self.context_needed(self.cfg)

    def document(self, rng, length, depth):
        n, k = self.cfg.recall_pairs, self.cfg.answer_len
        if length < self.min_length():
            return self.chain.walk(rng, length), np.zeros(0, dtype=np.int64)
        filler = self.chain.walk(rng, length - self.min_length())
        keys = rng.choice(np.arange(*self.keys), size=n, replace=False)
        values = [self._answer(rng) for _ in range(n)]
        # the scored pair 0 at `depth`, the others anywhere; every pair queried, pair 0 last
        cuts = np.concatenate([[round(depth * len(filler))],
                               rng.integers(0, len(filler) + 1, size=n - 1)])
        order = np.argsort(cuts, kind="stable")
        pieces, prev = [], 0
        for j in order:
            pieces += [filler[prev:cuts[j]], [KEY, keys[j]], values[j]]
            prev = cuts[j]
        pieces.append(filler[prev:])
        for j in [*rng.permutation(np.arange(1, n)), 0]:
            pieces += [[QUERY, keys[j]], values[j]]
        return np.concatenate(pieces).astype(np.int64), np.arange(length - k, length)


TASKS = {"passkey": Passkey, "recall": Recall}


@dataclass
class EvalExample:
    task: str
    length: int
    """Context length: the document's tokens, placed at the start of the window."""
    depth: float
    window: Window
    targets: np.ndarray
    """int64 [answer tokens, 2]: (input position that predicts it, expected token id)."""


def eval_examples(task: _Task, lengths: list[int], depths: list[float], samples: int,
                  seed: int) -> list[EvalExample]:
    """`samples` examples per (length, depth), deterministic in `seed`, independent of training
    samples (another random stream)."""
    out = []
    for length in lengths:
        for depth in depths:
            for i in range(samples):
                rng = np.random.default_rng([seed, 0xE7A1, task.tag, length,
                                             round(depth * 1000), i])
                tokens, offsets = task.document(rng, length, depth)
                window = array_window(np.concatenate([tokens, [EOS]]), np.array([length + 1]),
                                      task.seq_len + 1)
                targets = np.stack([offsets - 1, tokens[offsets]], axis=1)
                out.append(EvalExample(task.name, length, depth, window, targets))
    return out
