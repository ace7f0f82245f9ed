"""The pre-tokenized dataset format: token shards, a document index, and meta.json.

A dataset is one directory:

    meta.json          format, dtype, vocabulary, BOS/EOS ids, counts, shard list, how it was made
    tokens-00000.bin   the tokens of whole documents, back to back, raw little-endian uint16|uint32
    docs-00000.npy     int64 [documents + 1]: document borders as offsets into tokens-00000.bin
    ...

A document never crosses a shard, so any piece of a document is one slice of one memory map.
`ShardWriter` builds the directory under a temporary name and renames it into place only when
meta.json (written last) is complete: a dataset that is visible is whole, and an existing one is
replaced only by a complete new one (never a directory that is not a dataset). Every byte it writes is a function of the documents and the
metadata alone (no times, no host names), so the same input gives byte-identical files.
`TokenStore` opens a dataset read-only and checks every shard's size against meta.json. It
records each token shard's identity when it opens the dataset (device, inode, size, mtime_ns)
and compares it with an `os.stat` before every read touches the memory map: a shard truncated,
rewritten or replaced under a running job raises DatasetChangedError instead of feeding other
tokens to training (or, truncated, killing the process with SIGBUS when the map is read). The
stat costs about 2 us per document piece read; a tiny-recipe step reads about 20 pieces per rank
(~0.05 ms of a ~0.7 s step). A change between the stat and the copy of the slice is not caught.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from lctrain.data.ingest import DataError

FORMAT = "lctrain-tokens"
VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> str:
    """The shard dtype for a vocabulary: uint16 if every id fits, else uint32."""
    fits16 = vocab_size <= 2**16
    if requested == "auto":
        return "uint16" if fits16 else "uint32"
    if requested == "uint16" and not fits16:
        raise ValueError(f"preprocess.dtype=uint16 holds token ids below 65536, but the tokenizer "
                         f"has {vocab_size} tokens; set preprocess.dtype=uint32 (or auto)")
    if requested not in DTYPES:
        raise ValueError(f"preprocess.dtype={requested!r} is not one of auto, uint16, uint32")
    return requested


class ShardWriter:
    """Appends documents to shards of about `shard_tokens` tokens; `commit` publishes them."""

    def __init__(self, output: str | os.PathLike, dtype: str, shard_tokens: int):
        self.output = Path(output)
        self.old = self.output.with_name(f".{self.output.name}.old")
        if self.old.is_dir() and not self.output.exists():  # a commit died between its renames
            self.old.rename(self.output)
        self.tmp = self.output.with_name(f".{self.output.name}.partial-{os.getpid()}")
        if self.tmp.exists():  # left by an interrupted run of this pid: never a dataset
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.dtype, self.np_dtype, self.shard_tokens = dtype, DTYPES[dtype], shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._borders: list[int] = [0]
        self.documents = self.tokens = 0

    def _open_shard(self) -> None:
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = open(self.tmp / name, "wb")  # noqa: SIM115 (closed in _close_shard)
        self._borders = [0]
        self.shards.append({"tokens": name, "docs": f"docs-{len(self.shards):05d}.npy"})

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        borders = np.asarray(self._borders, dtype=np.int64)
        np.save(self.tmp / self.shards[-1]["docs"], borders)
        self.shards[-1].update(num_tokens=int(borders[-1]), num_documents=len(borders) - 1)

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `tokens` holds them back to back, `lengths` their sizes (all > 0)."""
        assert int(lengths.sum()) == len(tokens), "lengths must add up to the tokens given"
        assert len(lengths) == 0 or int(lengths.min()) > 0, "documents must not be empty"
        if len(tokens) and int(tokens.max()) > np.iinfo(self.np_dtype).max:
            raise ValueError(f"token id {int(tokens.max())} does not fit the shard dtype "
                             f"{self.dtype}; use preprocess.dtype=uint32")
        data = tokens.astype(self.np_dtype, copy=False)
        start = 0
        for n in lengths.tolist():
            if self._file is None or self._borders[-1] >= self.shard_tokens:
                self._close_shard()
                self._open_shard()
            self._file.write(data[start:start + n].tobytes())
            self._borders.append(self._borders[-1] + n)
            start += n
        self.documents += len(lengths)
        self.tokens += len(tokens)

    def commit(self, meta: dict, overwrite: bool = False) -> Path:
        """Write meta.json last, then move the dataset into place (replacing only if allowed)."""
        self._close_shard()
        if self.output.exists() and not overwrite:
            raise FileExistsError(f"{self.output} exists; set preprocess.overwrite=true to replace "
                                  "it or choose another preprocess.output")
        if self.output.exists() and not (self.output / "meta.json").is_file():
            raise FileExistsError(f"{self.output} exists and is not a token dataset; only a "
                                  "dataset is ever replaced: remove it or choose another output")
        full = {"format": FORMAT, "version": VERSION, "dtype": self.dtype,
                "num_documents": self.documents, "num_tokens": self.tokens,
                "shards": self.shards}
        assert not full.keys() & meta.keys(), f"meta may not set {full.keys() & meta.keys()}"
        (self.tmp / "meta.json").write_text(json.dumps({**full, **meta}, indent=2,
                                                       sort_keys=True) + "\n")
        if self.output.exists():
            if self.old.exists():
                shutil.rmtree(self.old)
            self.output.rename(self.old)  # a crash here is undone by the next ShardWriter
        self.tmp.rename(self.output)
        if self.old.exists():
            shutil.rmtree(self.old)
        return self.output

    def abort(self) -> None:
        """Drop everything written so far (the previous dataset, if any, is untouched)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_meta(path: str | os.PathLike) -> dict:
    """meta.json of a dataset directory, or a ValueError saying why `path` is not one."""
    meta_path = Path(path) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a preprocessed token dataset (no meta.json); make one "
                         f"with: lctrain preprocess data.path=CORPUS data.tokenizer=TOKENIZER "
                         f"preprocess.output={path}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path} is not valid JSON ({e}); preprocess the corpus again") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version "
                         f"{meta.get('version')!r}; this lctrain reads {FORMAT} version {VERSION}")
    return meta


class DatasetChangedError(DataError):
    """A token shard changed on disk while a job was reading it."""


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What must not change while a shard is read: (device, inode, size, mtime_ns)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _what_changed(was: tuple[int, int, int, int], now: tuple[int, int, int, int]) -> str:
    if was[2] != now[2]:
        how = "truncated" if now[2] < was[2] else "grown"
        return f"{how}: it held {was[2]} bytes when the job opened it, {now[2]} bytes now"
    if was[:2] != now[:2]:
        return (f"replaced by another file of the same size ({was[2]} bytes; inode {was[1]} "
                f"when the job opened it, {now[1]} now)")
    return (f"rewritten in place: the same size ({was[2]} bytes), but its modification time "
            f"moved by {(now[3] - was[3]) / 1e9:+.3f} s since the job opened it")


class TokenStore:
    """A preprocessed dataset, read-only: document lengths and token slices from memory maps."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.meta = read_meta(path)
        self.dtype = DTYPES[self.meta["dtype"]]
        self.vocab_size = int(self.meta["vocab_size"])
        self._maps: list[np.memmap | None] = [None] * len(self.meta["shards"])
        self._files = [str(self.path / shard["tokens"]) for shard in self.meta["shards"]]
        self._opened: list[tuple[int, int, int, int]] = []
        """Each token shard's identity when the dataset was opened (checked before reads)."""
        lengths, shard_of, offset = [], [], []
        for i, shard in enumerate(self.meta["shards"]):
            self._opened.append(_identity(os.stat(self._files[i])))
            size = self._opened[-1][2]
            if size != shard["num_tokens"] * self.dtype.itemsize:
                raise ValueError(f"{self.path / shard['tokens']} holds {size} bytes, meta.json "
                                 f"says {shard['num_tokens']} {self.meta['dtype']} tokens; the "
                                 "dataset is damaged: preprocess the corpus again")
            borders = np.load(self.path / shard["docs"], allow_pickle=False)
            if len(borders) != shard["num_documents"] + 1 or borders[-1] != shard["num_tokens"]:
                raise ValueError(f"{self.path / shard['docs']} does not match meta.json; the "
                                 "dataset is damaged: preprocess the corpus again")
            lengths.append(np.diff(borders))
            offset.append(borders[:-1])
            shard_of.append(np.full(len(borders) - 1, i, dtype=np.int32))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))  # noqa: E731
        self.doc_lengths = cat(lengths, np.int64)
        """Tokens of every document [documents]."""
        self._doc_offset, self._doc_shard = cat(offset, np.int64), cat(shard_of, np.int32)

    @property
    def num_documents(self) -> int:
        return len(self.doc_lengths)

    @property
    def num_tokens(self) -> int:
        return int(self.doc_lengths.sum())

    def _map(self, shard: int) -> np.memmap:
        if self._maps[shard] is None:
            try:
                self._maps[shard] = np.memmap(self._files[shard], dtype=self.dtype, mode="r")
            except (ValueError, OSError):
                self.check(shard)  # changed since the check before this read: say so
                raise
        return self._maps[shard]

    def check(self, shard: int) -> None:
        """Raise DatasetChangedError if token shard `shard` is no longer the file opened (one
        os.stat; call it before touching the shard's memory map)."""
        file = self._files[shard]
        try:
            now = _identity(os.stat(file))
        except OSError as e:
            change = f"gone: {e.strerror}"
        else:
            if now == self._opened[shard]:
                return
            change = _what_changed(self._opened[shard], now)
        raise DatasetChangedError(
            f"token shard {file} changed while this job was reading it ({change}); its tokens "
            "were not used. A dataset must not change under a running job: write new data with "
            "`lctrain preprocess` into a new directory (preprocess.output=NEW_DIR) and train on "
            "that (data.path=NEW_DIR); to resume this run with checkpoint.resume=auto, restore "
            f"{self.path} as it was")

    def read(self, doc: int, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of document `doc` (a view of the memory map), after
        checking that its shard is unchanged (a truncated map would SIGBUS when read)."""
        assert 0 <= start and start + length <= self.doc_lengths[doc], "outside the document"
        base, shard = int(self._doc_offset[doc]), int(self._doc_shard[doc])
        self.check(shard)
        return self._map(shard)[base + start: base + start + length]
