"""`lctrain preprocess` survives its workers: a worker killed mid-run (the OOM killer's SIGKILL)
fails the run within seconds with a message naming the signal and the rows it held, publishes
nothing and leaves no process behind; a re-run is byte-identical to a run never interrupted.

The kill is deterministic: the test patches encoding.BatchEncoder.__call__ before the pool forks, so the
worker that takes the batch holding one chosen row SIGKILLs itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lctrain.data import encoding
from lctrain.data import preprocess as pre
from tests.test_preprocess import REPO, WORDS, all_files, make_cfg, train_tokenizer, write_jsonl

KILL_ROW = ("b.jsonl:", 40)
"""The worker that takes this row (line 40 of b.jsonl) kills itself."""


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(["<s>", "</s>"]).save(str(path))
    return path


def write_corpus(corpus: Path) -> None:
    """a.jsonl (150 rows) then b.jsonl (90): with 16 rows a batch, b.jsonl:40 is in batch 11 of
    15, rows 176-191 = b.jsonl lines 27-42."""
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 12))) for _ in range(240)]
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", texts[:150])
    write_jsonl(corpus / "b.jsonl", texts[150:])


def kill_at(row: tuple[str, int], log: Path):
    """A BatchEncoder.__call__ that logs `pid time` and SIGKILLs its process on `row`."""
    encode = encoding.BatchEncoder.__call__

    def dying(self, rows):
        if any(prefix.endswith(row[0]) and n == row[1] for _, prefix, n, _ in rows):
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(self, rows)
    return dying


def logging_init(log: Path):
    """An _init_worker that appends the worker's pid to `log` first."""
    init = encoding._init_worker

    def init_and_log(*args):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        init(*args)
    return init_and_log


def is_gone(pid: int) -> bool:
    """True once `pid` is neither running nor an unreaped zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_killed_worker_fails_the_run_fast_and_a_rerun_is_identical(tok_path, tmp_path,
                                                                      monkeypatch):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    keys = dict(workers=2, batch_rows=16)
    pre.preprocess(make_cfg(corpus, tok_path, tmp_path / "never-killed", **keys), progress=False)

    killed, started = tmp_path / "killed.log", tmp_path / "workers.log"
    monkeypatch.setattr(encoding.BatchEncoder, "__call__", kill_at(KILL_ROW, killed))
    monkeypatch.setattr(encoding, "_init_worker", logging_init(started))
    out = tmp_path / "out"
    with pytest.raises(encoding.WorkerDied) as failure:
        pre.preprocess(make_cfg(corpus, tok_path, out, **keys), progress=False)
    detected = time.time()

    pid, killed_at = killed.read_text().split()
    assert detected - float(killed_at) < 10, f"took {detected - float(killed_at):.1f} s"
    assert str(failure.value) == (
        f"preprocess worker pid {pid} was killed by SIGKILL (the OOM killer?) while tokenizing "
        f"{corpus}/b.jsonl lines 27-42; nothing was published; re-run lctrain preprocess (fewer "
        "preprocess.workers or a smaller preprocess.batch_rows need less memory)")
    workers = [int(p) for p in started.read_text().split()]
    assert len(workers) == 2 and int(pid) in workers
    assert all(map(is_gone, workers)), [p for p in workers if not is_gone(p)]
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "killed.log", "never-killed",
                                                          "workers.log"]  # no partial shards

    monkeypatch.undo()
    pre.preprocess(make_cfg(corpus, tok_path, out, **keys), progress=False)
    assert all_files(out) == all_files(tmp_path / "never-killed")


CLI_KILL = """\
import sys
from pathlib import Path
from lctrain.cli import main
from lctrain.data import encoding
from tests.test_faults_preprocess import kill_at
encoding.BatchEncoder.__call__ = kill_at(("b.jsonl:", 40), Path(sys.argv[1]))
main(sys.argv[2:])
"""


def test_cli_reports_a_killed_worker_as_a_run_failure(tok_path, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    command = [sys.executable, "-c", CLI_KILL, str(tmp_path / "killed.log"), "preprocess",
               f"data.path={corpus}", f"data.tokenizer={tok_path}",
               f"preprocess.output={tmp_path}/out", "preprocess.workers=2",
               "preprocess.batch_rows=16"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "was killed by SIGKILL (the OOM killer?) while tokenizing" in done.stderr
    assert f"{corpus}/b.jsonl lines 27-42; nothing was published" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()
