"""`lctrain submit`: render an sbatch script (srun + torchrun c10d rendezvous) and submit it."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lctrain.commands.checks import preflight
from lctrain.config import ConfigError, LctrainConfig
from lctrain.config.compose import Composed, to_yaml


def render_sbatch(cfg: LctrainConfig, overrides: list[str], run_dir: Path) -> str:
    """The batch script: one srun task per node, each a torchrun over slurm.gpus_per_node ranks."""
    s = cfg.slurm
    run_dir = run_dir.resolve()
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={s.job_name}",
        f"#SBATCH --nodes={s.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={s.gpus_per_node}",
        f"#SBATCH --cpus-per-task={s.gpus_per_node * s.cpus_per_gpu}",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --signal=B:USR1@300",
    ]
    for flag, value in (("partition", s.partition), ("account", s.account), ("qos", s.qos)):
        if value:
            header.append(f"#SBATCH --{flag}={value}")
    keep = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    args = " ".join(shlex.quote(o) for o in [*keep, f"hydra.run.dir={run_dir}"])
    body = [
        "set -euo pipefail",
        *s.setup,
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=${MASTER_PORT:-29500}",
        "export OMP_NUM_THREADS=1",
        "# SLURM's USR1 (--signal above) reaches this shell only: it asks lctrain, through the",
        "# stop file, to checkpoint after the current step and exit cleanly",
        f"trap 'touch {shlex.quote(str(run_dir / 'STOP'))}' USR1",
        "srun --kill-on-bad-exit=1 torchrun \\",
        "  --nnodes=\"$SLURM_NNODES\" \\",
        f"  --nproc-per-node={s.gpus_per_node} \\",
        "  --rdzv-backend=c10d --rdzv-id=\"$SLURM_JOB_ID\" \\",
        "  --rdzv-endpoint=\"$MASTER_ADDR:$MASTER_PORT\" \\",
        f"  -m lctrain.cli train {args} &",
        "srun_pid=$!",
        "while true; do  # a trap interrupts wait: wait again until srun itself has ended",
        '  status=0; wait "$srun_pid" || status=$?',
        '  kill -0 "$srun_pid" 2>/dev/null || break',
        "done",
        'exit "$status"',
    ]
    return "\n".join(header + [""] + body) + "\n"


def run(composed: Composed, flags: set[str]) -> int:
    cfg = composed.cfg
    world = cfg.slurm.nodes * cfg.slurm.gpus_per_node
    problems = preflight(cfg, world)
    if problems:
        raise ConfigError(problems)
    script = render_sbatch(cfg, composed.overrides, composed.run_dir)
    if "--dry-run" in flags:
        print(script, end="")
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print("lctrain: sbatch not found on PATH; run on a SLURM login node, or use --dry-run "
              "to print the script", file=sys.stderr)
        return 1
    run_dir = composed.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "submit.sbatch"
    path.write_text(script)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    done = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode
