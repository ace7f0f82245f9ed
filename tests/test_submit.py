"""`lctrain submit` without a cluster: the batch script for GPU and CPU partitions, the
rendezvous on the head node, sweep expansion, and the stop-file tokens that decide a requeue.
(The same script against a real Slurm: tests/test_slurm.py.)"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lctrain.commands.job import head_address, rendezvous_port
from lctrain.commands.submit import (
    Partition,
    cluster_problems,
    expand_sweep,
    fill,
    render_sbatch,
    run_dir_override,
)
from lctrain.config.compose import compose
from lctrain.training.preemption import STOPPED, PreemptionWatcher, job_token

GOLDEN = Path(__file__).parent / "golden" / "sbatch"

GPU_JOB = ["model=llama3-8b", "parallel.tp=8", "parallel.cp=4", "parallel.attention=ring",
           "train.seq_len=131072", "train.global_batch=8", "slurm.nodes=4", "parallel.dp=-1"]


def script_of(overrides: list[str], tmp_path: Path) -> str:
    composed = compose([*overrides, f"hydra.run.dir={tmp_path / 'r'}"])
    return render_sbatch(composed.cfg, composed.overrides, composed.run_dir)


def test_gpu_script_requests_gpus_and_runs_the_submitters_python(tmp_path):
    script = script_of([*GPU_JOB, "+slurm.env.NCCL_SOCKET_IFNAME=ib0", "slurm.partition=gpu"],
                       tmp_path)
    run_dir = (tmp_path / "r").resolve()
    assert "#SBATCH --nodes=4\n" in script and "#SBATCH --gpus-per-node=8\n" in script
    assert "#SBATCH --cpus-per-task=64\n" in script and "#SBATCH --partition=gpu\n" in script
    assert "#SBATCH --requeue\n" in script and "#SBATCH --signal=B:USR1@300\n" in script
    assert f"srun --kill-on-bad-exit=1 {sys.executable} -m torch.distributed.run" in script
    assert "--nproc-per-node=8" in script and "--rdzv-backend=c10d" in script
    assert "torchrun" not in script  # never whatever PATH the batch shell has
    assert "export NCCL_SOCKET_IFNAME=ib0\n" in script
    assert f"{sys.executable} -m lctrain.commands.job rendezvous" in script
    assert "29500" not in script
    assert f"'hydra.run.dir='\"'\"'{run_dir}'\"'\"''" in script  # Hydra-quoted, shell-quoted
    assert "checkpoint.resume=auto" in script  # a requeued job resumes
    assert f"> {run_dir / 'STOP'}' USR1" in script
    assert f"cat {run_dir / STOPPED}" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # the trap is in place before anything that can take time
    assert script.index("trap ") < script.index("head=") < script.index("srun ")


def test_cpu_partition_script_requests_no_gpu(tmp_path):
    script = script_of(["+recipe=tiny", "slurm.gpus_per_node=0", "slurm.requeue=false",
                        "slurm.python=/opt/py/bin/python3", "checkpoint.resume=none"], tmp_path)
    assert "--gpus" not in script and "--gres" not in script
    assert "#SBATCH --cpus-per-task=4\n" in script and "--nproc-per-node=4" in script
    assert "export OMP_NUM_THREADS=1\n" in script
    assert "/opt/py/bin/python3 -m torch.distributed.run" in script
    assert "#SBATCH --no-requeue\n" in script and "scontrol requeue" not in script
    assert "checkpoint.resume=auto" not in script  # typed by the user: kept
    two_nodes = script_of(["+recipe=tiny", "slurm.gpus_per_node=0", "slurm.nodes=2",
                           "slurm.cpus_per_task=6"], tmp_path)
    assert "--nproc-per-node=2" in two_nodes and "#SBATCH --nodes=2\n" in two_nodes
    assert "#SBATCH --cpus-per-task=6\n" in two_nodes and "OMP_NUM_THREADS=3\n" in two_nodes


GOLDEN_JOBS = {  # golden file: overrides (the files were rendered before the script became a
    # template; @PYTHON@ stands for the submitter's own Python)
    "gpu": [*GPU_JOB, "+slurm.env.NCCL_SOCKET_IFNAME=ib0", "+slurm.env.NCCL_DEBUG=WARN",
            "slurm.partition=gpu", "slurm.account=proj42", "slurm.qos=high",
            "slurm.time=02:00:00", "slurm.job_name=long-ctx",
            "slurm.setup=['module load cuda/12.4','source /opt/env.sh']",
            "slurm.python=/opt/py/bin/python3", "slurm.signal_before_s=120",
            run_dir_override(Path("/srv/runs/it's a run"))],
    "cpu": ["+recipe=tiny", "slurm.gpus_per_node=0", "slurm.nodes=2", "slurm.cpus_per_task=6",
            "slurm.requeue=false", "slurm.python=/opt/py/bin/python3", "checkpoint.resume=none",
            "train.steps=7", "hydra.run.dir=/srv/runs/cpu"],
    "default_python": ["+recipe=tiny", "slurm.gpus_per_node=0", "hydra.run.dir=/srv/runs/tiny"],
}


@pytest.mark.parametrize("name", sorted(GOLDEN_JOBS))
def test_script_matches_its_golden_file(name):
    composed = compose(GOLDEN_JOBS[name])
    script = render_sbatch(composed.cfg, composed.overrides, composed.run_dir)
    expected = (GOLDEN / f"{name}.sbatch").read_text().replace("@PYTHON@",
                                                               shlex.quote(sys.executable))
    assert script == expected


def test_template_fill_keeps_the_shells_own_syntax():
    text = "a={{a}} $HOME ${X:-0} $(pwd)\n{{lines}}\nend\n"
    assert fill(text, {"a": 1, "lines": []}) == "a=1 $HOME ${X:-0} $(pwd)\nend\n"
    assert fill(text, {"a": "{{b}}", "lines": ["x", "{{a}}"]}) == \
        "a={{b}} $HOME ${X:-0} $(pwd)\nx\n{{a}}\nend\n"  # values are never read again
    with pytest.raises(KeyError, match="lines"):
        fill(text, {"a": 1})
    with pytest.raises(AssertionError, match="give a list"):
        fill(text, {"a": 1, "lines": "x"})
    with pytest.raises(ValueError, match="Invalid placeholder"):
        fill("{{run-dir}}", {})


def test_script_is_valid_bash_and_its_trap_writes_the_token(tmp_path):
    script = script_of(["+recipe=tiny", "slurm.gpus_per_node=0"], tmp_path)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    trap = next(line for line in script.splitlines() if line.startswith("trap "))
    (tmp_path / "r").mkdir()
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}
    subprocess.run(["bash", "-c", f"{trap}\nkill -USR1 $$\n"], env=env, check=True)
    assert (tmp_path / "r" / "STOP").read_text() == "77.2\n"


def test_rendezvous_address_and_port():
    assert head_address("localhost", 1) == "127.0.0.1"  # one node: loopback is fine
    with pytest.raises(ValueError, match="loopback address 127.0.0.1, which the other 3"):
        head_address("localhost", 4)
    assert head_address("localhost", 4, env_addr="10.1.2.3") == "10.1.2.3"
    with pytest.raises(ValueError, match="does not resolve"):
        head_address("no-such-host.invalid", 2)
    ports = {rendezvous_port(job, restart) for job in range(1000, 1100) for restart in (0, 1)}
    assert len(ports) == 200 and all(15000 <= p < 30000 for p in ports)
    env = {**os.environ, "SLURM_NNODES": "2", "SLURM_JOB_ID": "5"}
    env.pop("MASTER_ADDR", None)
    done = subprocess.run([sys.executable, "-m", "lctrain.commands.job", "rendezvous",
                           "localhost"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "/etc/hosts" in done.stderr
    # the batch script runs it before torch: the standard library and lctrain's two modules only
    code = ("import sys, lctrain.commands.job; print(sorted(m.partition('.')[0] for m in "
            "sys.modules if m.partition('.')[0] in ('lctrain', 'omegaconf', 'hydra', 'torch') "
            "and m != 'lctrain.commands.job'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "['lctrain', 'lctrain']", done.stderr


def test_sweep_expansion_and_quoted_run_dirs():
    combos = expand_sweep(["+recipe=tiny", "parallel.cp=1,2", "train.seq_len=128,256",
                           "optim.lr=1e-3"])
    assert [label for _, label in combos] == [
        "parallel.cp=1,train.seq_len=128", "parallel.cp=1,train.seq_len=256",
        "parallel.cp=2,train.seq_len=128", "parallel.cp=2,train.seq_len=256"]
    assert combos[1][0] == ["+recipe=tiny", "parallel.cp=1", "train.seq_len=256",
                            "optim.lr=1e-3"]
    assert [label for _, label in expand_sweep(["train.steps=range(1,4)"])] == [
        "train.steps=1", "train.steps=2", "train.steps=3"]
    odd = Path("/tmp/s/0_parallel.cp=1,train.seq_len=128/it's")
    assert compose([run_dir_override(odd)]).run_dir == odd


def test_cluster_checks_against_partitions():
    parts = {"cpu": Partition("cpu", 2, 16, 0, True), "gpu": Partition("gpu", 8, 64, 8, False)}
    cfg = compose(GPU_JOB).cfg
    assert cluster_problems(cfg, parts)[0].startswith(
        "slurm.gpus_per_node=8 but partition cpu offers 0 GPUs per node")
    cfg.slurm.partition = "gpu"
    assert cluster_problems(cfg, parts) == []
    cfg.slurm.nodes, cfg.slurm.cpus_per_gpu = 9, 9
    assert cluster_problems(cfg, parts) == [
        "slurm.nodes=9 but partition gpu has 8 node(s)",
        "--cpus-per-task=72 exceeds the 64 CPUs of a node in partition gpu; set "
        "slurm.cpus_per_task (or slurm.cpus_per_gpu) lower"]
    cfg.slurm.partition = "big"
    assert cluster_problems(cfg, parts) == [
        "slurm.partition=big does not exist on this cluster; partitions: cpu, gpu"]


def test_stop_file_tokens(tmp_path, monkeypatch):
    """A stop file from another job (or start) is discarded at start; one written for this start
    is honoured; STOPPED records an early stop and a completed run removes both."""
    stop = tmp_path / "STOP"
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert job_token() == "9.1"

    class OneRank:
        world_size, device = 1, "cpu"

    stop.write_text("9.0\n")  # the previous start of this job
    (tmp_path / STOPPED).write_text("9.0\n")
    watcher = PreemptionWatcher(stop, rank=0)
    assert not stop.exists() and not (tmp_path / STOPPED).exists()
    assert not watcher.requested(OneRank)
    watcher.restore()

    stop.write_text("9.1\n")  # USR1 while this start was still starting up
    watcher = PreemptionWatcher(stop, rank=0)
    assert watcher.requested(OneRank) and (tmp_path / STOPPED).read_text() == "9.1\n"
    watcher.completed()  # ...but it was the last step: nothing to requeue
    assert not stop.exists() and not (tmp_path / STOPPED).exists()
    watcher.restore()
