"""`lctrain submit` and `lctrain status` against a real single-node Slurm (tools/local_slurm.py):
the tiny recipe on the CPU partition runs to its last step; a job stopped by Slurm's USR1
warning resumes, requeued by itself or resubmitted, and ends with the losses of the
uninterrupted run; a sweep of two values gives two finished runs; bad input is refused with
exit code 2 before anything is submitted.

The cluster is the one SLURM_CONF names when it answers (.ci/run starts one), else one started
here when this machine can (root, Slurm installed); otherwise these tests skip with the reason.
All jobs are submitted at once and run side by side on the node.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
JOB = ["+recipe=tiny", "slurm.gpus_per_node=0", "parallel.dp=1", "train.steps=12",
       "logging.log_every=1", "logging.progress=false", "eval.every=12", "eval.samples=2",
       "train.seq_len=128", "eval.lengths=[64,128]"]
"""The tiny recipe on 2 ranks (Ring attention over cp=2), shortened; every job of these tests
trains exactly this."""
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
JOB_TIMEOUT_S = 420


def _sinfo_works(env: dict) -> bool:
    if shutil.which("sinfo") is None:
        return False
    done = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and bool(done.stdout.strip())


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF) of a running Slurm, started here when none is."""
    if os.environ.get("SLURM_CONF") and _sinfo_works(ENV):
        yield dict(ENV)
        return
    if os.geteuid() != 0 or shutil.which("slurmctld") is None and not Path(
            "/usr/sbin/slurmctld").exists():
        pytest.skip("no Slurm answers and none can be started here (needs root and Debian's "
                    "slurmctld slurmd slurm-client munge; python tools/local_slurm.py start DIR "
                    "--install)")
    root = tmp_path_factory.mktemp("slurm")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "local_slurm.py"), "start",
                           str(root)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"the local Slurm did not start: {done.stderr.strip()}")
    try:
        yield {**ENV, "SLURM_CONF": str(root / "slurm.conf")}
    finally:
        subprocess.run([sys.executable, str(REPO / "tools" / "local_slurm.py"), "stop",
                        str(root)], capture_output=True, timeout=120)


def lctrain(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lctrain.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def submit(run_dir: Path, env: dict, *extra: str) -> str:
    done = lctrain(["submit", *JOB, *extra, f"hydra.run.dir={run_dir}"], env, run_dir.parent)
    assert done.returncode == 0, done.stderr
    assert f"run dir {run_dir}" in done.stdout
    return (run_dir / "slurm_jobs").read_text().split()[-1]


def job_fields(job_id: str, env: dict) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env,
                         capture_output=True, text=True, timeout=30).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(predicate, what: str, run_dir: Path, timeout_s: float = JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)  # polling a job's progress
    logs = "\n".join(p.read_text()[-3000:] for p in run_dir.glob("slurm-*.out"))
    pytest.fail(f"{what} did not happen within {timeout_s} s; job output:\n{logs}")


def finished(job_id: str, env: dict, run_dir: Path) -> dict:
    """scontrol's fields of the job once it ended (fails the test if it never does)."""
    def ended():
        fields = job_fields(job_id, env)
        return fields if fields.get("JobState") in DONE_STATES else None
    return wait_for(ended, f"job {job_id} ending", run_dir)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows}) == len(rows), "a step logged twice"
    return {r["step"]: r["loss"] for r in rows}


def submit_and_stop(run_dir: Path, env: dict, *extra: str) -> str:
    """Submit, and send Slurm's time-limit warning (USR1 to the batch shell) once training is
    under way."""
    job_id = submit(run_dir, env, *extra)
    wait_for(lambda: logged_steps(run_dir) >= 1, "step 1", run_dir)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True,
                   timeout=30)
    return job_id


@pytest.mark.slow  # 92 s on 2 cores where a Slurm runs: 5 jobs of 12 steps, 2 of them stopped
def test_submit_runs_stops_requeues_resubmits_and_sweeps(slurm, tmp_path):
    requeued, resubmitted = tmp_path / "requeued", tmp_path / "resubmitted"
    jobs = {requeued: submit_and_stop(requeued, slurm),
            resubmitted: submit_and_stop(resubmitted, slurm, "slurm.requeue=false")}
    # the recipe's learning rate is 3e-3: the sweep's second run is the uninterrupted one
    sweep = lctrain(["submit", "--multirun", *JOB, "optim.lr=1e-3,3e-3",
                     f"hydra.run.dir={tmp_path / 'sweep'}"], slurm, tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    assert sweep.stdout.count("submitted job") == 2
    sweep_dirs = sorted((tmp_path / "sweep").iterdir())
    assert [d.name for d in sweep_dirs] == ["0_optim.lr=0.001", "1_optim.lr=0.003"]

    # requeued by its own batch script; Slurm holds a requeued job back for about two minutes,
    # which the test cuts short
    wait_for(lambda: job_fields(jobs[requeued], slurm).get("Restarts") == "1",
             "the requeue", requeued)
    subprocess.run(["scontrol", "update", f"JobId={jobs[requeued]}", "StartTime=now"],
                   env=slurm, check=True, timeout=30)
    # not requeued (slurm.requeue=false): it ends after the stop checkpoint; submit it again
    fields = finished(jobs[resubmitted], slurm, resubmitted)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0"
    stopped_at = max(losses(resubmitted))
    assert 1 <= stopped_at < 12
    status = lctrain(["status", str(resubmitted)], slurm, tmp_path)
    assert f"step         {stopped_at} / 12" in status.stdout
    assert f"step-{stopped_at:08d}" in status.stdout
    second = submit(resubmitted, slurm, "slurm.requeue=false")

    for run_dir, job_id in [*jobs.items(), (resubmitted, second)]:
        assert finished(job_id, slurm, run_dir)["JobState"] == "COMPLETED"
    for run_dir in sweep_dirs:
        job_id = (run_dir / "slurm_jobs").read_text().split()[-1]
        assert finished(job_id, slurm, run_dir)["JobState"] == "COMPLETED"

    reference = losses(sweep_dirs[1])
    assert sorted(reference) == list(range(1, 13))
    log = (requeued / f"slurm-{jobs[requeued]}.out").read_text()
    assert "requeueing job" in log and "resumed from" in log
    assert "resumed from" in (resubmitted / f"slurm-{second}.out").read_text()
    for run_dir in (requeued, resubmitted):
        resumed = losses(run_dir)
        assert sorted(resumed) == list(range(1, 13))
        assert resumed == pytest.approx(reference, rel=1e-6, abs=1e-6)
        assert not (run_dir / "STOP").exists() and not (run_dir / "STOPPED").exists()
    assert losses(sweep_dirs[0])[12] != reference[12]  # two learning rates, two runs
    assert "lr: 0.001" in (sweep_dirs[0] / "config.yaml").read_text()

    status = lctrain(["status", str(requeued)], slurm, tmp_path)
    assert status.returncode == 0, status.stderr
    assert "COMPLETED" in status.stdout and "restarts 1" in status.stdout
    assert "step         12 / 12" in status.stdout


@pytest.mark.slow  # a Slurm to ask (started by the fixture where none runs); 4 in-process submits
def test_cluster_mismatch_is_refused_before_submitting(slurm, tmp_path, monkeypatch, capsys):
    cases = {
        "slurm.partition=nope": "slurm.partition=nope does not exist on this cluster; "
                                "partitions: cpu",
        "slurm.gpus_per_node=8 parallel.dp=-1": "offers 0 GPUs per node, so the job would never "
                                                "start; set slurm.gpus_per_node=0",
        "slurm.nodes=2": "slurm.nodes=2 but partition cpu has 1 node(s)",
        "slurm.cpus_per_task=4096": "exceeds the",
    }
    if "SLURM_CONF" in slurm:  # the cluster the fixture found or started
        monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)
    for override, message in cases.items():
        args = [a for a in JOB if not (override.startswith("slurm.gpus_per_node")
                                       and a.startswith("slurm.gpus_per_node"))]
        code, _, err = run_cli(["submit", *args, *override.split(),
                                f"hydra.run.dir={tmp_path / 'x'}"], capsys)
        assert code == 2, (override, err)
        assert message in err, (override, err)
    assert not (tmp_path / "x").exists()


def test_bad_submissions_without_a_cluster(tmp_path, monkeypatch, capsys):
    """Refused with exit code 2 on any machine: what the layout or the PATH rules out (the
    command run in this process, as the installed one runs it)."""
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as no_slurm:
        no_slurm.setenv("PATH", str(Path(sys.executable).parent))
        code, _, err = run_cli(["submit", *JOB, f"hydra.run.dir={tmp_path / 'a'}"], capsys)
    assert code == 2
    assert "sbatch is not on PATH" in err and "--dry-run" in err
    code, _, err = run_cli(["submit", *JOB, "slurm.nodes=3", "--dry-run"], capsys)
    assert code == 2
    assert "2 ranks (launch.nproc, default tp*cp*pp*dp) cannot be split evenly over " \
           "slurm.nodes=3 CPU nodes" in err
    code, _, err = run_cli(["submit", *JOB, "launch.nproc=6", "slurm.nodes=2", "--dry-run"],
                           capsys)
    assert code == 2 and "world size 6" in err
    code, _, err = run_cli(["submit", "--multirun", *JOB, "parallel.cp=2,3", "--dry-run"],
                           capsys)
    assert code == 2 and "none of the sweep's 2 jobs was submitted" in err
    assert "[parallel.cp=3]" in err and "[parallel.cp=2]" not in err
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob("outputs"))
