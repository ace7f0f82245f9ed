"""Tokenizing batches of rows in fork worker processes, for `lctrain preprocess`: each worker
builds one tokenizer once (`BatchEncoder`), batches come back in input order with at most 2 per
worker in flight (`encoded_batches`), and a worker that dies (the OOM killer's SIGKILL) stops the
run at once with a `WorkerDied` naming the signal and the rows it held: the executor watches
every worker's sentinel, where `multiprocessing.Pool.imap` would wait forever.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import islice
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import numpy as np

from lctrain.data.ingest import DataError, Row, TokenizerInfo, check_row


@dataclass
class EncodedBatch:
    """One batch of rows, checked and tokenized: documents back to back and the skipped rows."""

    rows: int
    tokens: np.ndarray
    """uint32 [sum(lengths)]."""
    lengths: np.ndarray
    """int64 [documents]."""
    skips: list[tuple[str, str, str]]
    """(reason, location, detail) in row order."""


class BatchEncoder:
    """Checks and tokenizes batches of rows; built once per worker process."""

    def __init__(self, info: TokenizerInfo, text_field: str):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(info.json)
        self.text_field = text_field
        self.head = [] if info.bos_id is None else [info.bos_id]
        self.tail = [] if info.eos_id is None else [info.eos_id]
        self._encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def __call__(self, rows: list[Row]) -> EncodedBatch:
        texts, where, skips = [], [], []
        for i, (kind, prefix, n, payload) in enumerate(rows):
            text, reason, detail = check_row(kind, payload, self.text_field)
            if text is None:
                skips.append((i, reason, f"{prefix}{n}", detail))
            else:
                texts.append(text)
                where.append((i, prefix, n))
        ids, lengths = [], []
        for (i, prefix, n), enc in zip(where, self._encode(texts, add_special_tokens=False)):
            doc = self.head + enc.ids + self.tail
            if not doc:
                skips.append((i, "no_tokens", f"{prefix}{n}", "the text has no tokens and "
                              "neither BOS nor EOS is added"))
                continue
            ids += doc
            lengths.append(len(doc))
        return EncodedBatch(rows=len(rows), tokens=np.asarray(ids, dtype=np.uint32),
                            lengths=np.asarray(lengths, dtype=np.int64),
                            skips=[s[1:] for s in sorted(skips)])


class WorkerDied(DataError):
    """A tokenizer worker ended without handing back its batch (e.g. killed by the OOM killer)."""


_worker_encoder: BatchEncoder | None = None
"""The encoder of this worker process (set by `_init_worker`, the pool initializer)."""
_worker_taken_by = None
"""Shared with the main process: slot `i % len` holds the pid of the worker that took batch i."""


def _init_worker(info: TokenizerInfo, text_field: str, taken_by) -> None:
    global _worker_encoder, _worker_taken_by
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; no fork warnings
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the main process stops the pool
    _worker_encoder, _worker_taken_by = BatchEncoder(info, text_field), taken_by


def _encode_in_worker(index: int, rows: list[Row]) -> EncodedBatch:
    assert _worker_encoder is not None, "worker used without _init_worker"
    _worker_taken_by[index % len(_worker_taken_by)] = os.getpid()
    return _worker_encoder(rows)


def _span(rows: list[Row]) -> str:
    """Where a batch comes from: `corpus/b.jsonl lines 17-32`, `NAME[train] rows 0-999`."""
    (_, first, a, _), (_, last, b, _) = rows[0], rows[-1]
    if first != last:  # the batch spans inputs
        return f"{first}{a} to {last}{b}"
    unit = "row" if first.endswith(":row ") else "line"
    name = first.removesuffix(":row ").removesuffix(":")
    return f"{name} {unit} {a}" if a == b else f"{name} {unit}s {a}-{b}"


def _worker_processes(executor: ProcessPoolExecutor) -> dict[int, BaseProcess]:
    """The executor's worker processes by pid. ProcessPoolExecutor keeps them private (`_processes`,
    None once it is shut down); this is the one place lctrain reads them, to say which worker died
    and how, and to stop them at once when a run fails."""
    return dict(getattr(executor, "_processes", None) or {})


def _death(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else -exitcode
    return f"was killed by {name}" + " (the OOM killer?)" * (-exitcode == signal.SIGKILL)


class _WorkerPool:
    """Fork workers tokenizing batches, taken back in order with at most `limit` in flight. A dead
    worker is a WorkerDied within moments (the executor waits on every worker's sentinel)."""

    def __init__(self, workers: int, info: TokenizerInfo, text_field: str):
        ctx = multiprocessing.get_context("fork")
        self.limit = 2 * workers
        self.taken_by = ctx.RawArray("i", self.limit)
        """Slot i % limit: pid of the worker that took batch i; 0 until one does."""
        self.executor = ProcessPoolExecutor(workers, ctx, initializer=_init_worker,
                                            initargs=(info, text_field, self.taken_by))
        self.processes: dict[int, BaseProcess] = {}
        self.in_flight: deque[tuple[int, Future, str]] = deque()
        """(batch index, future, where its rows come from), oldest first."""
        self.submitted = 0
        self.first_ended: set[int] = set()
        """Sentinels of the workers that had ended when the first one did (set by `_watch`)."""
        self.watch: threading.Thread | None = None

    def full(self) -> bool:
        return len(self.in_flight) >= self.limit

    def submit(self, rows: list[Row]) -> None:
        i, self.submitted = self.submitted, self.submitted + 1
        self.taken_by[i % self.limit] = 0  # batch i - limit was taken back: its worker is done
        try:
            future = self.executor.submit(_encode_in_worker, i, rows)
        except BrokenProcessPool:
            raise self._died() from None
        self.in_flight.append((i, future, _span(rows)))
        self.processes.update(_worker_processes(self.executor))  # fork: started on first submit
        if self.watch is None and self.processes:
            self.watch = threading.Thread(target=self._watch, daemon=True, name="preprocess-watch")
            self.watch.start()

    def _watch(self) -> None:
        """Note the first worker to end, before the executor terminates the others (SIGTERM)."""
        with contextlib.suppress(OSError, ValueError):
            self.first_ended = set(wait([p.sentinel for p in self.processes.values()]))

    def take(self) -> EncodedBatch:
        """The oldest batch in flight, tokenized."""
        try:
            batch = self.in_flight[0][1].result()
        except BrokenProcessPool:
            raise self._died() from None
        self.in_flight.popleft()
        return batch

    def _died(self) -> WorkerDied:
        """Stop every worker, then name the one that died first, its signal and its rows."""
        self.close(graceful=False)
        pid, dead = min(self.processes.items(), key=lambda item: (
            item[1].sentinel not in self.first_ended, item[1].exitcode == -signal.SIGTERM))
        held = [where for i, future, where in self.in_flight
                if self.taken_by[i % self.limit] == pid and future.done()
                and isinstance(future.exception(), BrokenProcessPool)]
        doing = f"while tokenizing {held[-1]}" if held else "between batches"
        memory = (" (fewer preprocess.workers or a smaller preprocess.batch_rows need less "
                  "memory)") if dead.exitcode == -signal.SIGKILL else ""
        return WorkerDied(f"preprocess worker pid {pid} {_death(dead.exitcode)} {doing}; nothing "
                          f"was published; re-run lctrain preprocess{memory}")

    def close(self, graceful: bool) -> None:
        """Let the workers finish (graceful) or stop them now; either way none is left running."""
        if not graceful:
            for process in self.processes.values():
                process.terminate()  # the executor sees them end, fails its futures, joins them
        self.executor.shutdown(wait=True)
        if self.watch is not None:
            self.watch.join()  # returns: every worker has ended


def _batches(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    while batch := list(islice(rows, size)):
        yield batch


def encoded_batches(rows: Iterator[Row], info: TokenizerInfo, text_field: str, batch_rows: int,
                    workers: int) -> Iterator[EncodedBatch]:
    """Batches of rows, tokenized by `workers` fork processes (1: in this process), in order.

    A worker that dies raises WorkerDied; its message says nothing was published, which holds
    because `preprocess` (the only caller) then aborts its ShardWriter."""
    batches = _batches(rows, batch_rows)
    if workers == 1:
        yield from map(BatchEncoder(info, text_field), batches)
        return
    pool, graceful = _WorkerPool(workers, info, text_field), False
    try:
        for batch in batches:
            if pool.full():
                yield pool.take()
            pool.submit(batch)
        while pool.in_flight:
            yield pool.take()
        graceful = True
    finally:
        pool.close(graceful)
