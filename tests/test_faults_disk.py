"""Disk and file faults: a full disk (ENOSPC) or a read-only run dir (EROFS) while writing
metrics.jsonl, config.yaml or a checkpoint manifest stops training with a message naming the
file, its errno and what to do; the newest complete checkpoint still resumes to the losses of an
uninterrupted run, no half-written file replaces a good one, and metrics.jsonl parses line by
line. A token shard truncated, rewritten or replaced under a running job is caught before its
memory map is read.

Faults are injected in the ranks (forked: nothing leaks into this process) by replacing `os` or
`open` in the one module under test, for the targeted path only: tests run as root, where a
chmod-ed directory does not stop writes.
"""

import errno
import json
import os
import time

import numpy as np
import pytest

from lctrain.data.loader import DataLoader
from lctrain.data.shards import DatasetChangedError, ShardWriter, TokenStore
from lctrain.parallel.launch import RankFailure, run_ranks
from lctrain.rundir import files
from lctrain.rundir.metrics_log import read_metrics
from lctrain.training import checkpoint as ck
from lctrain.training import metrics as M
from tests.helpers import dp2_config, on_ranks, with_overrides

ENOSPC = "No space left on device (errno 28, ENOSPC)"
EROFS = "Read-only file system (errno 30, EROFS)"


def _cfg(steps=6, **sections):
    return dp2_config(steps, logging={"log_every": 1}, **sections)


def _resume(cfg, **checkpoint):
    return with_overrides(cfg, checkpoint={"resume": "auto", **checkpoint})


def _train(cfg, run_dir, fault=None):
    """train() in this rank, after `fault(rank)` installed its patches (if any)."""
    import torch.distributed as dist

    import lctrain.training.loop as T

    if fault is not None:
        fault(dist.get_rank() if dist.is_initialized() else 0)
    return T.train(cfg, run_dir)


def _losses(history):
    return [(h["step"], h["loss"], h["grad_norm"]) for h in history]


def _rows(path):
    """metrics.jsonl read strictly: every line one JSON object (as lctrain plot / status do)."""
    text = path.read_text()
    assert text.endswith("\n"), "a torn last line"
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in read_metrics(path)]
    return rows


class _Os:
    """`os` for one module, with some functions replaced."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def _oserror(code, path=None):
    return OSError(code, os.strerror(code), *([str(path)] if path else []))


class _TornFile:
    """A file on a disk that fills up: half of the first write lands, then ENOSPC."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise _oserror(errno.ENOSPC)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def _full_disk_for(match):
    """A fault: in the run dir's writers (lctrain.rundir.files: write_atomic, the manifest),
    files whose path `match`es are written halfway, then the disk is full."""
    def install(me):
        def torn_open(path, mode="r", *args, **kwargs):
            f = open(path, mode, *args, **kwargs)
            return _TornFile(f) if "w" in mode and match(str(path)) else f
        files.open = torn_open
    return install


def _read_only_replace(match):
    """A fault: os.replace(src, dst) fails with EROFS where match(src, dst), in checkpoint.py
    (a checkpoint's rename) and lctrain.rundir.files (write_atomic)."""
    def install(me):
        def replace(src, dst):
            if match(str(src), str(dst)):
                raise _oserror(errno.EROFS, dst)
            return os.replace(src, dst)
        ck.os = files.os = _Os(replace=replace)
    return install


def _metrics_disk_full_at_row(n):
    """A fault: metrics.jsonl's n-th row gets half written (a short write), then ENOSPC."""
    def install(me):
        rows, full = [0], [False]

        def write(fd, data):
            if not os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
                return os.write(fd, data)
            if full[0]:
                raise _oserror(errno.ENOSPC)
            rows[0] += 1
            if rows[0] == n:
                full[0] = True
                return os.write(fd, data[:len(data) // 2])
            return os.write(fd, data)
        M.os = _Os(write=write)
    return install


def _metrics_read_only(me):
    def open_(path, flags, *args):
        if str(path).endswith("metrics.jsonl"):
            raise _oserror(errno.EROFS, path)
        return os.open(path, flags, *args)
    M.os = _Os(open=open_)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of an uninterrupted 6-step run."""
    return _losses(on_ranks(_train, 2, _cfg(), str(tmp_path_factory.mktemp("ref")))[0])


@pytest.mark.slow  # 3 s on 2 cores, and the 6-step reference run (the shard checks stay fast)
def test_metrics_and_config_write_faults_stop_with_the_file_named(tmp_path, reference):
    cfg, run = _cfg(), tmp_path / "run"
    metrics = run / "metrics.jsonl"
    # the disk fills up in the middle of step 3's row: the half row is cut off
    with pytest.raises(RankFailure) as failure:
        on_ranks(_train, 2, cfg, str(run), _metrics_disk_full_at_row(3))
    message = str(failure.value)
    assert failure.value.rank == 0 and "RunDirError" in message
    assert f"cannot append the row of step 3 to {metrics}: {ENOSPC}" in message
    assert "its rows before step 3 are whole (the partial row was removed)" in message
    assert f"Free space on the disk holding {run} (or raise the quota), or pick another " \
           "hydra.run.dir" in message and "checkpoint.resume=auto" in message
    assert [r["step"] for r in _rows(metrics)] == [1, 2]
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == ["step-00000002"]

    # the run dir is read-only when the run restarts: config.yaml, then metrics.jsonl
    config = (run / "config.yaml").read_bytes()
    resume = _resume(cfg)
    for fault, want in [
        (_read_only_replace(lambda src, dst: dst.endswith("config.yaml")),
         f"cannot write {run / 'config.yaml'}: {EROFS}; the previous config.yaml is unchanged. "
         f"Remount the file system of {run} read-write, or pick another hydra.run.dir."),
        (_full_disk_for(lambda p: "config.yaml.tmp" in p),
         f"cannot write {run / 'config.yaml'}: {ENOSPC}; the previous config.yaml is unchanged"),
    ]:
        with pytest.raises(RankFailure, match="RunDirError") as failure:
            on_ranks(_train, 2, resume, str(run), fault)
        assert failure.value.rank == 0 and want in str(failure.value)
        assert (run / "config.yaml").read_bytes() == config
        assert not [p.name for p in run.iterdir() if ".tmp" in p.name]
    with pytest.raises(RankFailure, match="RunDirError") as failure:
        on_ranks(_train, 2, resume, str(run), _metrics_read_only)
    assert failure.value.rank == 0 and (
        f"cannot open {metrics}: {EROFS}; it is unchanged; training stopped. Remount the file "
        f"system of {run} read-write, or pick another hydra.run.dir.") in str(failure.value)
    assert [r["step"] for r in _rows(metrics)] == [1, 2]

    # the disk has room again: the newest complete checkpoint resumes the uninterrupted run
    assert _losses(on_ranks(_train, 2, resume, str(run))[0]) == reference[2:]
    assert [r["step"] for r in _rows(metrics)] == list(range(1, 7))
    assert "resume: auto" in (run / "config.yaml").read_text()


@pytest.mark.slow  # 3 s on 2 cores: 5 runs of 2 ranks
def test_manifest_write_faults_keep_the_newest_complete_checkpoint(tmp_path, reference):
    cfg, run = _cfg(), tmp_path / "run"
    root = run / "checkpoints"
    with pytest.raises(RankFailure, match="CheckpointError") as failure:
        on_ranks(_train, 2, cfg, str(run),
                 _full_disk_for(lambda p: "step-00000004" in p and p.endswith(ck.MANIFEST)))
    message = str(failure.value)
    assert (f"checkpoint of step 4 could not be written to {root} (rank 0: "
            f"{root / '.step-00000004.partial' / ck.MANIFEST}: {ENOSPC})") in message
    assert (f"the previous checkpoint {root / 'step-00000002'} is intact (checkpoint.resume=auto "
            f"continues from it). Free space on the disk holding {root} (or raise the quota), "
            "or pick another checkpoint.dir.") in message
    assert [p.name for p in root.iterdir()] == ["step-00000002"]  # no partial directory left
    assert not ck.damaged_files(root / "step-00000002")
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3]
    assert _losses(on_ranks(_train, 2, _resume(cfg), str(run))[0]) == reference[2:]

    # the run is redone from step 2 and checkpoint 4 cannot be renamed over the earlier one
    step4 = root / "step-00000004"
    manifest = (step4 / ck.MANIFEST).read_bytes()
    redo = _resume(cfg, load=str(root / "step-00000002"))
    with pytest.raises(RankFailure, match="CheckpointError") as failure:
        on_ranks(_train, 2, redo, str(run), _read_only_replace(
            lambda src, dst: src.endswith(".step-00000004.partial") and dst == str(step4)))
    assert f"rank 0: {step4}: {EROFS}" in str(failure.value)
    assert f"Remount the file system of {root} read-write" in str(failure.value)
    assert [p.name for p in ck.complete_checkpoints(root)] == [
        "step-00000006", "step-00000004", "step-00000002"]
    assert (step4 / ck.MANIFEST).read_bytes() == manifest and not ck.damaged_files(step4)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]
    assert _losses(on_ranks(_train, 2, _resume(cfg, load=str(step4)), str(run))[0]) == \
        reference[4:]


# ---- token shards changed under a running job ---------------------------------------------


def _dataset(path, shard_tokens=400, documents=60, vocab=128, seed=0):
    """A token dataset of documents 8..24 tokens long (one shard unless shard_tokens is small)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 25, documents)
    writer = ShardWriter(path, "uint16", shard_tokens)
    writer.add(rng.integers(0, vocab, int(lengths.sum())).astype(np.uint16), lengths)
    writer.commit({"vocab_size": vocab})
    return path


def _first_doc(store, shard):
    return int(np.flatnonzero(store._doc_shard == shard)[0])


def _shard_changes(path):
    """In a forked process (a SIGBUS there fails the test, not pytest): the message of each
    change, or what a read returned instead of raising."""
    store = TokenStore(path)
    shard0, shard1 = (path / s["tokens"] for s in store.meta["shards"][:2])
    out = {}

    def attempt(name, shard):
        try:
            got = store.read(_first_doc(store, shard), 0, 8).copy()
            out[name] = ("read", got.tolist())
        except DatasetChangedError as e:
            out[name] = ("error", str(e), store._maps[shard] is None)

    attempt("before", 0)
    size = shard0.stat().st_size
    os.truncate(shard0, size // 2)  # truncated after its map was read
    attempt("truncated", 0)
    stat = shard1.stat()
    shard1.write_bytes(bytes(reversed(shard1.read_bytes())))  # rewritten in place, same size
    os.utime(shard1, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    attempt("rewritten", 1)  # never mapped before: caught before the map is made
    out["sizes"] = (size, size // 2, stat.st_size)
    return out


def test_a_changed_shard_is_caught_before_its_map_is_read(tmp_path):
    path = _dataset(tmp_path / "tok", shard_tokens=200)
    got = run_ranks(_shard_changes, 1, (path,), start_method="fork", backend=None,
                    timeout_s=60)[0]
    size, truncated, size1 = got["sizes"]
    assert got["before"][0] == "read"
    kind, message, unmapped = got["truncated"]
    assert kind == "error" and not unmapped, got["truncated"]
    assert message.startswith(f"token shard {path / 'tokens-00000.bin'} changed while this job "
                              f"was reading it (truncated: it held {size} bytes when the job "
                              f"opened it, {truncated} bytes now); its tokens were not used. "
                              "A dataset must not change under a running job: write new data "
                              "with `lctrain preprocess` into a new directory")
    kind, message, unmapped = got["rewritten"]
    assert kind == "error" and unmapped, got["rewritten"]
    assert (f"{path / 'tokens-00001.bin'} changed while this job was reading it (rewritten in "
            f"place: the same size ({size1} bytes), but its modification time moved by +2.000 s "
            "since the job opened it)") in message
    # replaced by another file (a new inode) with the same size and modification time
    path = _dataset(tmp_path / "tok2", shard_tokens=200)
    store = TokenStore(path)
    shard = path / "tokens-00001.bin"
    stat = shard.stat()
    (tmp_path / "copy").write_bytes(shard.read_bytes())
    os.utime(tmp_path / "copy", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(tmp_path / "copy", shard)
    with pytest.raises(DatasetChangedError, match=r"replaced by another file of the same size"):
        store.read(_first_doc(store, 1), 0, 4)
    shard.unlink()
    with pytest.raises(DatasetChangedError, match=r"tokens-00001.bin changed .*\(gone: No such"):
        store.read(_first_doc(store, 1), 0, 4)


def _truncate_after_first_step(path):
    """A fault: rank 0 truncates the shard right after reading step 1's batch (before step 1's
    collectives, so every rank reads step 2 from the truncated file)."""
    def install(me):
        real, calls = DataLoader.next_step, [0]

        def next_step(self):
            out = real(self)
            calls[0] += 1
            if me == 0 and calls[0] == 1:
                os.truncate(path, path.stat().st_size // 2)
            return out
        DataLoader.next_step = next_step
    return install


def test_a_shard_truncated_during_training_stops_it(tmp_path):
    data = _dataset(tmp_path / "tok", shard_tokens=10**6, documents=120)
    shard = data / "tokens-00000.bin"
    cfg = _cfg(4, data={"source": "tokens", "path": str(data)},
               checkpoint={"every": 0})
    run = tmp_path / "run"
    with pytest.raises(RankFailure, match="DatasetChangedError") as failure:
        on_ranks(_train, 2, cfg, str(run), _truncate_after_first_step(shard))
    assert f"token shard {shard} changed while this job was reading it (truncated" in \
        str(failure.value)
    # rank 1 may meet the change in step 1 already (rank 0 truncates after its own read)
    metrics = run / "metrics.jsonl"
    assert metrics.read_text() == "" or [r["step"] for r in _rows(metrics)] == [1]


def test_the_shard_check_costs_little_per_read(tmp_path):
    """The check is one os.stat per document piece read, timed against the same reads without
    it. A tiny-recipe step (~0.7 s) reads about 20 pieces per rank, so even 50 us per read
    would stay below 0.15% of a step; measured, it is about 2 us."""
    store = TokenStore(_dataset(tmp_path / "tok"))
    docs = [int(d) for d in np.random.default_rng(0).integers(0, store.num_documents, 2000)]

    def per_read(reps=5):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for d in docs:
                store.read(d, 0, 8).copy()
            best = min(best, (time.perf_counter() - t0) / len(docs))
        return best

    checked = per_read()
    real, store.check = store.check, lambda shard: None
    unchecked = per_read()
    store.check = real
    assert checked - unchecked < 50e-6, (checked, unchecked)
