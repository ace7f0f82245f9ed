"""Packing a pre-tokenized dataset into training sequences, and weighted mixtures of sources.

`PackedTokens` (one dataset): epoch e shuffles the documents with a permutation drawn from
(seed, e), concatenates them into one stream of T tokens, and cuts the stream into
ceil((T - 1) / S) windows of S + 1 tokens that overlap by one token (sample i covers stream
[i S, i S + S + 1)). Every token of the epoch is an input exactly once (but the last) and a target
exactly once (but the first); only the last window is padded. A document crossing a window
border continues in the next sample: each piece is its own document for masking, and positions
restart in each piece. Documents longer than S are split that way too, or skipped with
data.long_docs=drop (counted in `dropped`). The shuffle costs 16 bytes per document per cached
epoch.

`Mixture`: global sample g goes to the source whose realised share lags its weight most (ties to
the first source), so after any g samples every source holds its share to within one sample;
source k's n-th sample is its own sample n. The schedule depends on the weights alone.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from lctrain.data.batch import PAD, Window
from lctrain.data.lengths import (
    BucketStats,
    best_fit_bins,
    best_fit_cut_fraction,
    mix_documents,
    stream_cut_fraction,
)
from lctrain.data.shards import TokenStore


class PackedTokens:
    """Windows of S + 1 tokens over a TokenStore, reshuffled every epoch; optionally the
    documents chosen by length (`length_mix`: [(max_len or None, weight)]) and packed best-fit
    (`packing="best_fit"`): lctrain.data.lengths."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, long_docs: str = "split",
                 documents: np.ndarray | None = None, part: str = "all",
                 length_mix: list[tuple[int | None, float]] | None = None,
                 packing: str = "stream"):
        self.store, self.seq_len, self.seed, self.long_docs = store, seq_len, seed, long_docs
        self.name, self.part, self.packing = str(store.path), part, packing
        lengths = store.doc_lengths
        chosen = np.arange(len(lengths)) if documents is None else np.asarray(documents)
        self.docs = chosen if long_docs == "split" else chosen[lengths[chosen] <= seq_len]
        self.dropped = len(chosen) - len(self.docs)
        """Documents skipped by data.long_docs=drop."""
        self.buckets: list[BucketStats] = []
        """data.length_mix's buckets: what the corpus has and what an epoch takes."""
        if length_mix:
            self.docs, self.buckets = mix_documents(self.docs, lengths,
                                                    [b for b, _ in length_mix],
                                                    [w for _, w in length_mix], seed)
        self.tokens = int(lengths[self.docs].sum())
        """Tokens of one epoch."""
        if self.tokens < seq_len + 1:
            raise ValueError(f"{store.path}{'' if part == 'all' else f' ({part} part)'} holds "
                             f"{self.tokens} tokens"
                             f"{' after dropping long documents' if self.dropped else ''}, fewer "
                             f"than one sequence of train.seq_len + 1 = {seq_len + 1}; use a "
                             f"larger corpus or train.seq_len <= {max(1, self.tokens - 1)}")
        self.samples_per_epoch = math.ceil((self.tokens - 1) / seq_len)
        self.bins: list[list[tuple[int, int, int]]] = []
        if packing == "best_fit":  # (index into self.docs, start, length) per piece
            self.bins = best_fit_bins(lengths[self.docs], seq_len + 1)
            self.samples_per_epoch = len(self.bins)

    @property
    def cut_fraction(self) -> float:
        """Share of an epoch's tokens whose document is cut across sequences (the first
        epoch's order under stream packing)."""
        own = self.store.doc_lengths[self.docs]
        if self.packing == "best_fit":
            return best_fit_cut_fraction(own, self.seq_len)
        return stream_cut_fraction(self.store.doc_lengths[self._epoch(0)[0]], self.seq_len)

    @lru_cache(maxsize=2)  # noqa: B019 (few instances; the current and the next epoch)
    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, stream offset where each ends) of one epoch."""
        order = self.docs[np.random.default_rng([self.seed, 0xD0C5, epoch]).permutation(
            len(self.docs))]
        return order, np.cumsum(self.store.doc_lengths[order])

    def report(self) -> list[str]:
        """What the training data is made of: the packing and the tokens it cuts, and each
        length bucket's documents and tokens, in the corpus and per epoch."""
        lines = [f"data: {self.packing} packing into {self.samples_per_epoch:,} sequences per "
                 f"epoch; {self.cut_fraction:.1%} of the tokens are in documents cut across "
                 "sequences"]
        for b in self.buckets:
            span = f"{b.low + 1:,}-{b.high:,}" if b.high is not None else f"> {b.low:,}"
            lines.append(f"data.length_mix {span} tokens: weight {b.weight:.3f}; corpus "
                         f"{b.documents:,} documents, {b.tokens:,} tokens; per epoch "
                         f"{b.taken_documents:,} documents, {b.taken_tokens / self.tokens:.1%} "
                         "of the tokens")
        return lines

    def pieces(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document, start inside it, length) of each piece of sample `index`'s window."""
        epoch, i = divmod(index, self.samples_per_epoch)
        if self.bins:  # best fit: the epoch's shuffle of the sequences
            order = np.random.default_rng([self.seed, 0xB1F7, epoch]).permutation(len(self.bins))
            pieces = np.array(self.bins[order[i]], dtype=np.int64).reshape(-1, 3)
            return self.docs[pieces[:, 0]], pieces[:, 1], pieces[:, 2]
        order, ends = self._epoch(epoch)
        lo, hi = i * self.seq_len, min(i * self.seq_len + self.seq_len + 1, self.tokens)
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(ends, hi - 1, side="right"))
        docs = order[first:last + 1]
        begins = ends[first:last + 1] - self.store.doc_lengths[docs]
        starts = np.maximum(lo - begins, 0)
        stops = np.minimum(hi - begins, self.store.doc_lengths[docs])
        return docs, starts, stops - starts

    def window(self, index: int) -> Window:
        docs, starts, lengths = self.pieces(index)
        borders = np.concatenate([[0], np.cumsum(lengths)])

        def read(lo: int, hi: int) -> np.ndarray:
            out = np.full(hi - lo, PAD, dtype=np.int64)
            a = int(np.searchsorted(borders, lo, side="right")) - 1
            for j in range(max(a, 0), len(docs)):
                if borders[j] >= hi:
                    break
                x, y = max(lo, borders[j]), min(hi, borders[j + 1])
                out[x - lo:y - lo] = self.store.read(int(docs[j]), int(starts[j] + x - borders[j]),
                                                     int(y - x))
            return out

        return Window(lengths, read)

    def fingerprint(self) -> dict:
        out = {"source": self.name, "documents": self.store.num_documents,
               "tokens": self.store.num_tokens, "long_docs": self.long_docs}
        if self.packing != "stream":
            out["packing"] = self.packing
        if self.buckets:
            out["length_mix"] = [b.as_dict() for b in self.buckets]
        if self.part != "all":  # a held-out split: which documents it keeps
            out.update(part=self.part, part_documents=len(self.docs), part_tokens=self.tokens)
        return out


class Mixture:
    """Weighted mixture of sources (each with window(i) and fingerprint())."""

    def __init__(self, sources: list, weights: list[float]):
        assert len(sources) == len(weights) and min(weights) > 0, "positive weight per source"
        self.sources = sources
        self.weights = np.asarray(weights, dtype=np.float64) / sum(weights)
        self._choice = np.zeros(0, dtype=np.int32)
        self._local = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(len(sources), dtype=np.int64)

    def _extend(self, size: int) -> None:
        n = len(self._choice)
        choice, local = np.empty(size - n, np.int32), np.empty(size - n, np.int64)
        counts = self._counts
        for g in range(n, size):
            k = int(np.argmax(self.weights * (g + 1) - counts))
            choice[g - n], local[g - n] = k, counts[k]
            counts[k] += 1
        self._choice = np.concatenate([self._choice, choice])
        self._local = np.concatenate([self._local, local])

    @property
    def dropped(self) -> int:
        """Documents skipped by data.long_docs=drop, over every source."""
        return sum(s.dropped for s in self.sources)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, that source's sample index) of global sample `index`."""
        if index >= len(self._choice):
            self._extend(max(index + 1, 2 * len(self._choice), 1024))
        return int(self._choice[index]), int(self._local[index])

    def window(self, index: int) -> Window:
        k, j = self.locate(index)
        return self.sources[k].window(j)

    def fingerprint(self) -> dict:
        return {"mixture": [s.fingerprint() for s in self.sources],
                "weights": [round(float(w), 12) for w in self.weights]}
