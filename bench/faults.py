"""Fault injection: each fault lctrain must survive, injected into a real run, one row each.

    python bench/faults.py [--only NAME ...] [--timeout-s 6]

Columns: detected (the run ended, or refused, with the message that names the fault), seconds
to detect (from the injection to the run's exit), processes left (lctrain processes alive 10 s
after the exit, then killed), data lost (bytes of complete checkpoints that no longer verify),
next run resumed (a run with checkpoint.resume=auto from the same run dir completed). Goal for
every row: yes / within launch.timeout_s + 10 s / 0 / 0 / yes.

Each scenario is a function returning a `Row`; tests/test_faults.py runs the fast ones with
assertions, this script all of them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lctrain.rundir.rank_records import read_records  # noqa: E402
from lctrain.training.checkpoint import complete_checkpoints, damaged_files  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
       "PYTHONUNBUFFERED": "1"}
SMALL = ["+recipe=tiny", "train.steps=400", "train.seq_len=128", "logging.log_every=1",
         "logging.progress=false", "eval.every=0", "checkpoint.every=2", "checkpoint.keep=0"]
"""A long tiny run (it never ends by itself during a scenario), checkpointing every 2 steps."""
LAYOUTS = {  # a group kind: the 2-rank layout whose rank 1 is stopped
    "tp": ["parallel.tp=2", "parallel.cp=1", "parallel.dp=1"],
    "cp_ring": ["parallel.cp=2", "parallel.dp=1", "parallel.attention=ring"],
    "dp": ["parallel.cp=1", "parallel.dp=2"],
    "pp": ["parallel.pp=2", "parallel.cp=1", "parallel.dp=1"],
}
SETTLE_S = 10.0
"""How long after a run ends its processes may take to go."""


@dataclass
class Row:
    fault: str
    detected: bool = False
    seconds: float = float("nan")
    processes_left: int = 0
    data_lost: int = 0
    resumed: bool = False
    message: str = ""
    notes: list[str] = field(default_factory=list)


def lctrain(args: list[str], run_dir: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lctrain.cli", "train", *args,
                             f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling a run's progress
    raise TimeoutError(f"{what} within {timeout_s} s")


def rank_pids(run_dir: Path, world: int, step: int) -> dict[int, int]:
    """rank -> pid once every rank's progress record shows `step`."""
    def ready():
        records = read_records(run_dir)
        if len(records) == world and all(r["step"] >= step for r in records):
            return {r["rank"]: r["pid"] for r in records}
        return None
    return wait_for(ready, 120, f"{world} ranks at step {step}")


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def settle(pids) -> int:
    """Processes of `pids` still alive after SETTLE_S (then killed)."""
    deadline = time.monotonic() + SETTLE_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(pids)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return len(left)


def checkpoint_bytes(run_dir: Path) -> dict[Path, int]:
    return {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            for p in complete_checkpoints(run_dir / "checkpoints")}


def lost_bytes(before: dict[Path, int]) -> int:
    """Bytes of the complete checkpoints of `before` that are gone or no longer verify."""
    return sum(size for path, size in before.items()
               if not path.is_dir() or damaged_files(path, hashes=True))


def resumes(run_dir: Path, layout: list[str]) -> bool:
    """A run with checkpoint.resume=auto from the run dir completes two more steps."""
    newest = complete_checkpoints(run_dir / "checkpoints")
    if not newest:
        return False
    step = int(newest[0].name.split("-")[1])
    done = subprocess.run([sys.executable, "-m", "lctrain.cli", "train", *SMALL, *layout,
                           f"train.steps={step + 2}", "checkpoint.resume=auto",
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=ENV,
                          capture_output=True, text=True, timeout=300)
    return done.returncode == 0 and f"resumed from {newest[0]}" in done.stdout


def parent_sigkill(root: Path) -> Row:
    """kill -9 of the `lctrain train` that forked 4 ranks: every rank must go with it."""
    run_dir = root / "parent-kill"
    run_dir.mkdir(parents=True)
    return _kill_launcher(Row("SIGKILL of the launcher (4 forked ranks)"), lctrain(SMALL, run_dir),
                          run_dir, 4, [])


def agent_sigkill(root: Path) -> Row:
    """kill -9 of torchrun's agent (2 ranks): its workers must go with it."""
    run_dir, layout = root / "agent-kill", ["parallel.cp=2", "parallel.dp=1"]
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "lctrain.cli", "train", *SMALL, *layout, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _kill_launcher(Row("SIGKILL of torchrun's agent (2 ranks)"), proc, run_dir, 2, layout)


def _kill_launcher(row: Row, proc: subprocess.Popen, run_dir: Path, world: int,
                   layout: list[str]) -> Row:
    """SIGKILL `proc` once its `world` ranks train; the ranks must end with it."""
    pids = rank_pids(run_dir, world, 3)
    before = checkpoint_bytes(run_dir)
    t0 = time.monotonic()
    proc.kill()
    proc.wait()
    try:
        wait_for(lambda: not alive(pids.values()), SETTLE_S, "ranks gone")
        row.detected, row.seconds = True, time.monotonic() - t0
        row.message = "every rank ended with its launcher"
    except TimeoutError:
        row.message = f"ranks {alive(pids.values())} outlived their launcher"
    row.processes_left = settle(pids.values())
    row.data_lost = lost_bytes(before)
    row.resumed = resumes(run_dir, layout)
    return row


def rank_sigstop(root: Path, group: str, timeout_s: int, stall_s: int = 0) -> Row:
    """SIGSTOP of rank 1 in a 2-rank layout whose only group is `group`: the job must end
    within launch.timeout_s (or, with `stall_s` and a long collective timeout, within
    launch.stall_s) with a report naming rank 1."""
    layout = LAYOUTS[group]
    how = f"launch.stall_s={stall_s}" if stall_s else f"launch.timeout_s={timeout_s}"
    row = Row(f"SIGSTOP of one rank ({group} group; {how})")
    run_dir = root / f"stop-{group}-{stall_s}"
    run_dir.mkdir(parents=True)
    limits = ([f"launch.timeout_s={timeout_s * 50}", f"launch.stall_s={stall_s}"] if stall_s
              else [f"launch.timeout_s={timeout_s}"])
    proc = lctrain([*SMALL, *layout, *limits], run_dir)
    pids = rank_pids(run_dir, 2, 3)
    before = checkpoint_bytes(run_dir)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        row.message = "the job did not end"
    else:
        row.seconds = time.monotonic() - t0
        row.detected = proc.returncode == 1 and "behind: rank 1 " in err and \
            "rank(s) 1 fell behind" in err
        row.message = next((line for line in err.splitlines() if line.startswith("behind:")),
                           err.strip().splitlines()[-1] if err.strip() else "")
        if not (run_dir / "stall-report.txt").is_file():
            row.detected = False
            row.notes.append("no stall-report.txt")
    row.processes_left = settle([proc.pid, *pids.values()])
    row.data_lost = lost_bytes(before)
    row.resumed = resumes(run_dir, layout)
    return row


def two_jobs_one_run_dir(root: Path) -> Row:
    """A second `lctrain train` into the run dir of a running one: refused (exit 2) naming the
    first; the first then stops cleanly (SIGTERM: checkpoint, exit 0) and its run resumes."""
    row, run_dir = Row("a second job in a running job's run dir"), root / "two-jobs"
    run_dir.mkdir(parents=True)
    first = lctrain(SMALL, run_dir)
    pids = rank_pids(run_dir, 4, 3)
    before = checkpoint_bytes(run_dir)
    t0 = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "lctrain.cli", "train", *SMALL,
                             f"hydra.run.dir={run_dir}"], cwd=root, env=ENV,
                            capture_output=True, text=True, timeout=120)
    row.seconds = time.monotonic() - t0
    row.detected = second.returncode == 3 and f"pid {first.pid}" in second.stderr
    row.message = second.stderr.strip().splitlines()[-1][:160] if second.stderr else ""
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    if first.returncode != 0:
        row.notes.append(f"the first job exited {first.returncode} after SIGTERM")
    row.processes_left = settle([first.pid, *pids.values()])
    row.data_lost = lost_bytes(before)
    row.resumed = resumes(run_dir, [])
    return row


INJECT = """
import builtins, errno, os, sys, time
target, after, code, log = sys.argv[1], int(sys.argv[2]), getattr(errno, sys.argv[3]), sys.argv[4]
count, real_write, real_open = [0], os.write, builtins.open

def hit(path):  # the (after+1)-th write to a file named `target` fails, and every one after it
    if not str(path).endswith(target):
        return False
    count[0] += 1
    if count[0] > after:
        with real_open(log, "a") as f:
            f.write(f"{time.time()}\\n")
        return True
    return False

def write(fd, data):
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = ""
    if hit(path):
        raise OSError(code, os.strerror(code), path)
    return real_write(fd, data)

def open_(file, mode="r", *args, **kwargs):
    if "w" in mode and hit(file):
        raise OSError(code, os.strerror(code), str(file))
    return real_open(file, mode, *args, **kwargs)

real_replace = os.replace

def replace(src, dst, **kwargs):
    if hit(dst):
        raise OSError(code, os.strerror(code), str(dst))
    return real_replace(src, dst, **kwargs)

os.write, os.replace, builtins.open = write, replace, open_
from lctrain.cli import main
main(sys.argv[5:])
"""
"""`python -c INJECT TARGET AFTER ERRNO LOG lctrain-args...`: lctrain with a disk that fails
(ENOSPC, EROFS) every write to, or rename onto, a file named TARGET after the first AFTER; each
failure's time is appended to LOG. Forked ranks inherit it."""


def disk_fault(root: Path, target: str, after: int, code: str) -> Row:
    """Writes to `target` fail with `code` after `after` of them: the run must stop naming the
    file and the errno, leave every complete checkpoint intact, and resume once the disk is
    back."""
    row, run_dir = Row(f"{code} writing {target} (after {after} writes)"), root / "disk"
    run_dir.mkdir(parents=True)
    log = root / "faults.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", INJECT, target, str(after), code, str(log), "train", *SMALL,
         f"hydra.run.dir={run_dir}"], cwd=root, env=ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    ended = time.time()
    if log.is_file():
        row.seconds = ended - float(log.read_text().split()[0])
    message = os.strerror(getattr(__import__("errno"), code))
    row.detected = proc.returncode == 1 and message in err and target in err and \
        "Traceback" not in err.split("lctrain:")[-1]
    row.message = next((line for line in reversed(err.splitlines()) if target in line), "")[:200]
    row.processes_left = settle([proc.pid])
    row.data_lost = lost_bytes(checkpoint_bytes(run_dir))
    row.resumed = resumes(run_dir, []) or (not complete_checkpoints(run_dir / "checkpoints")
                                            and run_again(run_dir))
    return row


def run_again(run_dir: Path) -> bool:
    """With no checkpoint to resume, a new run in the run dir completes."""
    done = subprocess.run([sys.executable, "-m", "lctrain.cli", "train", *SMALL, "train.steps=2",
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=ENV,
                          capture_output=True, text=True, timeout=300)
    return done.returncode == 0


def shard_truncated(root: Path) -> Row:
    """A token shard truncated under a running job: the next read must fail naming the shard,
    no token of it trained on; with the shard restored the run resumes."""
    import numpy as np

    from lctrain.data.shards import ShardWriter

    row, run_dir, data = Row("a token shard truncated mid-run"), root / "shard", root / "tokens"
    run_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 129, 4000)
    writer = ShardWriter(data, "uint16", 1 << 20)
    writer.add(rng.integers(0, 512, int(lengths.sum())).astype(np.uint16), lengths)
    writer.commit({"vocab_size": 512})
    layout = ["data.source=tokens", f"data.path={data}"]
    proc = lctrain([*SMALL, *layout], run_dir)
    pids = rank_pids(run_dir, 4, 3)
    shard = sorted(data.glob("*.bin"))[0]
    whole = shard.read_bytes()
    t0 = time.monotonic()
    with open(shard, "r+b") as f:
        f.truncate(len(whole) // 2)
    try:
        _, err = proc.communicate(timeout=120)
        row.seconds = time.monotonic() - t0
        row.detected = proc.returncode == 1 and f"token shard {shard} changed" in err
        row.message = next((line for line in err.splitlines() if "changed while" in line),
                           "")[:200]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        row.message = "the run went on"
    row.processes_left = settle([proc.pid, *pids.values()])
    row.data_lost = lost_bytes(checkpoint_bytes(run_dir))
    shard.write_bytes(whole)
    row.resumed = resumes(run_dir, layout)
    return row


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def preprocess_worker_kill(root: Path) -> Row:
    """SIGKILL of one `lctrain preprocess` worker mid-run (the OOM killer): the run must fail
    naming the signal, publish nothing, leave no worker, and a re-run must complete."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    row = Row("SIGKILL of a preprocess worker")
    corpus, output = root / "corpus", root / "tok"
    corpus.mkdir(parents=True)
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "mat", "park"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.train_from_iterator([" ".join(words)], trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<s>", "</s>"], show_progress=False))
    tok.save(str(root / "tokenizer.json"))
    rows = [json.dumps({"text": " ".join(words[(i * 7 + j) % 10] for j in range(200))})
            for i in range(200)]
    for k in range(8):  # 8 files of 40,000 rows: several seconds of tokenizing
        (corpus / f"part{k}.jsonl").write_text("\n".join(rows * 200) + "\n")
    args = [sys.executable, "-m", "lctrain.cli", "preprocess", f"data.path={corpus}",
            f"data.tokenizer={root / 'tokenizer.json'}", f"preprocess.output={output}",
            "preprocess.workers=2"]
    proc = subprocess.Popen(args, cwd=root, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    workers = wait_for(lambda: children(proc.pid) if len(children(proc.pid)) >= 2 else None,
                       60, "2 preprocess workers")
    time.sleep(1.0)  # let them tokenize for a while
    t0 = time.monotonic()
    os.kill(workers[0], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=60)
        row.seconds = time.monotonic() - t0
        row.detected = proc.returncode == 1 and "killed by SIGKILL" in err
        row.message = err.strip().splitlines()[-1] if err.strip() else ""
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        row.message = "preprocess hung"
    row.processes_left = settle([proc.pid, *workers])
    row.data_lost = 0 if not output.exists() else sum(
        f.stat().st_size for f in output.rglob("*") if f.is_file())  # published half-done
    again = subprocess.run(args, cwd=root, env=ENV, capture_output=True, text=True, timeout=600)
    row.resumed = again.returncode == 0 and output.is_dir()
    return row


SCENARIOS: dict[str, Callable[[Path, int], Row]] = {
    "parent_sigkill": lambda root, t: parent_sigkill(root),
    "agent_sigkill": lambda root, t: agent_sigkill(root),
    "preprocess_worker_kill": lambda root, t: preprocess_worker_kill(root),
    "two_jobs_one_run_dir": lambda root, t: two_jobs_one_run_dir(root),
    "enospc_metrics": lambda root, t: disk_fault(root, "metrics.jsonl", 5, "ENOSPC"),
    "enospc_manifest": lambda root, t: disk_fault(root, "manifest.json", 1, "ENOSPC"),
    "erofs_config": lambda root, t: disk_fault(root, "config.yaml", 0, "EROFS"),
    "shard_truncated": lambda root, t: shard_truncated(root),
    **{f"sigstop_{g}": functools.partial(lambda root, t, g: rank_sigstop(root, g, t), g=g)
       for g in LAYOUTS},
    "stall_cp_ring": lambda root, t: rank_sigstop(root, "cp_ring", t, stall_s=t),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=list(SCENARIOS), help="scenarios to run")
    parser.add_argument("--timeout-s", type=int, default=6, help="launch.timeout_s of the runs")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or SCENARIOS:
            rows.append(SCENARIOS[name](Path(tmp) / name, args.timeout_s))
            print(f"# {name}: {rows[-1].message}", file=sys.stderr, flush=True)
    print("| fault | detected | seconds to detect | processes left | data lost (bytes) | "
          "next run resumed |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.fault} | {'yes' if r.detected else 'NO'} | {r.seconds:.1f} | "
              f"{r.processes_left} | {r.data_lost} | {'yes' if r.resumed else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))


if __name__ == "__main__":
    main()
