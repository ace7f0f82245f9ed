"""`lctrain preprocess`: tokenize a corpus once into the token-shard format of lctrain.data.shards.

    lctrain preprocess data.path=corpus/ data.tokenizer=tok.json \\
        preprocess.output=data/corpus-tok preprocess.workers=2

Training then reads it with `data.source=tokens data.path=data/corpus-tok`.

The main process reads rows (lctrain.data.ingest) in batches of preprocess.batch_rows; a fork
ProcessPoolExecutor of preprocess.workers processes, each with its own tokenizer built once, checks
and tokenizes them. The results are taken back in input order and only the main process writes,
so the dataset is byte-identical whatever the worker count. At most 2 batches per worker are in
flight, so the corpus is never read ahead. Bad rows are skipped and counted by reason (or, with
data.strict=true, the first one stops the run); nothing is published unless the run completes.
A worker that dies (the OOM killer's SIGKILL) stops the run at once with a WorkerDied naming the
signal and the rows it held: the executor watches every worker, where `Pool.imap` waits forever.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lctrain.config import DataConfig, LctrainConfig, PreprocessConfig
from lctrain.config.validation import field_problems
from lctrain.data.encoding import EncodedBatch, WorkerDied, encoded_batches
from lctrain.data.ingest import (
    SKIP_REASONS,
    DataError,
    TokenizerInfo,
    TokenizerMismatch,
    iter_rows,
    load_tokenizer,
    resolve_inputs,
)
from lctrain.data.lengths import bucket_of
from lctrain.data.shards import ShardWriter, dtype_for_vocab

__all__ = ["DataError", "PreprocessSummary", "WorkerDied", "preprocess",
           "validate_preprocess"]

EXAMPLES = 3
"""Locations kept per skip reason."""


def _output_problems(pre: PreprocessConfig) -> list[str]:
    if not pre.output:
        return ["preprocess.output is not set; name the directory to write, e.g. "
                "preprocess.output=data/corpus-tok"]
    out = Path(pre.output).expanduser()
    if not out.name:
        return [f"preprocess.output={pre.output!r} must name a directory, e.g. "
                "preprocess.output=data/corpus-tok"]
    if not out.exists():
        return []
    if not pre.overwrite:
        return [f"preprocess.output={pre.output} exists; set preprocess.overwrite=true to replace "
                "it (once the new dataset is complete) or choose another preprocess.output"]
    if out.is_dir() and ((out / "meta.json").is_file() or not any(out.iterdir())):
        return []
    return [f"preprocess.output={pre.output} exists and is not a preprocessed dataset (no "
            "meta.json); preprocess.overwrite=true only replaces datasets: choose another "
            "preprocess.output or remove it yourself"]


def validate_preprocess(cfg: LctrainConfig) -> list[str]:
    """Every problem of a preprocess configuration at once (cheap: no tokenizer, no corpus read)."""
    d, p = cfg.data, cfg.preprocess
    problems = _output_problems(p)
    if not d.path:
        problems.append("data.path is not set; point it at the corpus: a file, a folder, a glob "
                        "such as 'corpus/*.jsonl' or a hub dataset name")
    if not d.tokenizer:
        problems.append("data.tokenizer is not set; give a tokenizer.json file, a folder holding "
                        "one, or a hub name")
    if not d.text_field:
        problems.append("data.text_field is empty; name the field holding the text, e.g. "
                        "data.text_field=text")
    return problems + field_problems(d, "data.") + field_problems(p, "preprocess.")


def _cpu_count() -> int:
    """Cores this process may run on (a SLURM or taskset allotment, not the whole host)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class _Tally:
    strict: bool
    buckets: list[int | None] = field(default_factory=list)
    """Upper bounds of the length buckets counted: data.length_mix's, else powers of two."""
    by_length: dict[int | None, list[int]] = field(default_factory=dict)
    """bucket upper bound -> [documents, tokens] (None: the open last bucket)."""
    rows: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in SKIP_REASONS})

    def add(self, batch: EncodedBatch) -> None:
        """Count a batch; with data.strict=true its first bad row is a DataError."""
        if self.strict and batch.skips:
            reason, loc, detail = batch.skips[0]
            raise DataError(f"{loc}: {reason} ({detail}); fix or remove the row, or set "
                            "data.strict=false to skip and count bad rows")
        self.rows += batch.rows
        self.documents += len(batch.lengths)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        if self.buckets:
            uppers = [self.buckets[i] for i in bucket_of(lengths, self.buckets)]
        else:  # the power of two at or above each length
            uppers = (1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)).tolist()
        for upper, n in zip(uppers, lengths.tolist()):
            counts = self.by_length.setdefault(upper, [0, 0])
            counts[0] += 1
            counts[1] += n
        self.tokens += len(batch.tokens)
        for reason, loc, _ in batch.skips:
            self.skipped[reason] += 1
            if len(self.examples[reason]) < EXAMPLES:
                self.examples[reason].append(loc)

    def skip_text(self) -> str:
        parts = [f"{r} {n} (e.g. {', '.join(self.examples[r])})"
                 for r, n in self.skipped.items() if n]
        return "; ".join(parts) or "none"


@dataclass
class PreprocessSummary:
    """What a preprocess run did, for the console and for benchmarks."""

    output: str
    rows: int
    """Rows read, skipped ones included."""
    documents: int
    tokens: int
    skipped: dict[str, int]
    examples: dict[str, list[str]]
    """First locations of each skip reason."""
    dtype: str
    vocab_size: int
    shards: int
    seconds: float
    by_length: dict[int | None, list[int]] = field(default_factory=dict)
    """Documents and tokens per length bucket (data.length_mix's, else powers of two)."""

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def render(self) -> str:
        lines = [f"lctrain: preprocessed {self.documents:,} documents, {self.tokens:,} tokens "
                 f"({self.dtype}, {self.shards} shard{'s' * (self.shards != 1)}) -> {self.output}",
                 f"  rows read {self.rows:,}, skipped {sum(self.skipped.values()):,}"]
        for reason, n in self.skipped.items():
            if n:
                lines.append(f"    {reason}: {n:,}  e.g. {', '.join(self.examples[reason])}")
        if self.by_length:
            lines.append("  documents by length: " + ", ".join(
                f"<= {upper:,}: {docs:,} ({tokens / max(1, self.tokens):.1%} of tokens)"
                if upper is not None else f"longer: {docs:,} ({tokens / max(1, self.tokens):.1%}"
                " of tokens)" for upper, (docs, tokens) in sorted(
                    self.by_length.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))))
        lines.append(f"  {self.seconds:.1f} s, {self.tokens_per_sec:,.0f} tokens/s")
        return "\n".join(lines)


def _meta(data: DataConfig, info: TokenizerInfo, tally: _Tally, kinds: list[str]) -> dict:
    """meta.json beyond what ShardWriter writes: a function of the config and the data only."""
    return {
        "vocab_size": info.vocab_size, "bos_id": info.bos_id, "eos_id": info.eos_id,
        "add_bos": data.add_bos, "add_eos": data.add_eos,
        "tokenizer": {"spec": data.tokenizer, "sha256": info.sha256,
                      "vocab_sha256": info.vocab_sha256, "bos_token": info.bos_token,
                      "eos_token": info.eos_token},
        "source": {"path": data.path, "format": data.format, "text_field": data.text_field,
                   "text_unit": data.text_unit, "split": data.split,
                   "inputs": {k: kinds.count(k) for k in sorted(set(kinds))}},
        "summary": {"rows": tally.rows, "documents": tally.documents, "tokens": tally.tokens,
                    "by_length": [[upper, docs, tokens] for upper, (docs, tokens) in sorted(
                        tally.by_length.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))],
                    "skipped": dict(tally.skipped),
                    "examples": {r: list(locs) for r, locs in tally.examples.items()}},
    }


@contextlib.contextmanager
def _live(enabled: bool) -> Iterator[Callable[[_Tally], None]]:
    """A live progress line on stdout when it is a terminal; otherwise nothing."""
    if not (enabled and sys.stdout.isatty()):
        yield lambda tally: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  transient=True) as bar:
        task = bar.add_task("reading")

        def show(t: _Tally) -> None:
            rate = t.tokens / max(time.perf_counter() - start, 1e-9)
            bar.update(task, description=f"rows {t.rows:,}  docs {t.documents:,}  tokens "
                       f"{t.tokens:,}  skipped {sum(t.skipped.values()):,}  {rate:,.0f} tok/s")
        yield show


def preprocess(cfg: LctrainConfig, progress: bool = True) -> PreprocessSummary:
    """Tokenize data.path into preprocess.output; publish it only if the whole run succeeds."""
    problems = validate_preprocess(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    data, pre = cfg.data, cfg.preprocess
    start = time.perf_counter()
    inputs = resolve_inputs(data)
    info = load_tokenizer(data)  # never encodes here: the workers fork after this
    try:
        dtype = dtype_for_vocab(info.vocab_size, pre.dtype)
    except ValueError as e:
        raise TokenizerMismatch(str(e)) from e
    workers = pre.workers or _cpu_count()
    writer = ShardWriter(Path(pre.output).expanduser(), dtype, pre.shard_tokens)
    tally = _Tally(strict=data.strict, buckets=[b.max_len for b in data.length_mix])
    try:
        batches = encoded_batches(iter_rows(inputs, data), info, data.text_field,
                                  pre.batch_rows, workers)
        with contextlib.closing(batches), _live(progress) as show:
            for batch in batches:
                tally.add(batch)
                writer.add(batch.tokens, batch.lengths)
                show(tally)
        if tally.documents == 0:
            raise DataError(f"data.path={data.path!r}: no valid document in {tally.rows} rows "
                            f"(skipped: {tally.skip_text()}); check data.text_field="
                            f"{data.text_field!r}, data.format and data.text_unit")
        writer.commit(_meta(data, info, tally, [i.kind for i in inputs]), overwrite=pre.overwrite)
    except BaseException:
        writer.abort()
        raise
    return PreprocessSummary(output=str(pre.output), rows=tally.rows, documents=tally.documents,
                             tokens=tally.tokens, skipped=dict(tally.skipped),
                             examples={r: list(v) for r, v in tally.examples.items()}, dtype=dtype,
                             vocab_size=info.vocab_size, shards=len(writer.shards),
                             seconds=time.perf_counter() - start, by_length=tally.by_length)
