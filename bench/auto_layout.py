"""How good is parallel.auto's choice on this CPU? (docs/parallelism.md §23): the layout search
for the tiny recipe on 4 ranks, ranked with this machine's calibration, then the top layouts
each trained on 4 forked gloo ranks (1 thread each) and timed. Prints every layout's predicted
and measured step time side by side, and where the search's winner (what parallel.auto=true
trains) ranks among the measured ones.

    python bench/auto_layout.py                   # calibrates first; ~4 min on 2 cores
    python bench/auto_layout.py --calibration /tmp/cal.json --reuse --top 6 --steps 8

The 4 ranks share this machine's cores: the step-time model prices that oversubscription only
as a floor (ranks / cores, §15), so the goal stated for the bench is modest: the auto choice is
the measured best or within 10% of it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.commands.calibrate import calibrate  # noqa: E402
from lctrain.config.compose import compose  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.planning.hardware import hardware_for  # noqa: E402
from lctrain.planning.search import (  # noqa: E402
    as_override,
    layout_label,  # noqa: E402
    search,
)
from lctrain.training.loop import train  # noqa: E402

WORLD = 4
RECIPE = ["+recipe=tiny", "eval.every=0", "checkpoint.every=0", "logging.progress=false",
          "train.device=cpu"]


def _quiet_train(cfg, run_dir: str) -> list[dict]:
    with contextlib.redirect_stdout(io.StringIO()):
        return train(cfg, run_dir)


def measured_step_s(overrides: dict, steps: int, calibration: str) -> float:
    """The median step time after the first of the tiny recipe trained in the layout
    `overrides` selects, on WORLD forked ranks."""
    cfg = compose([*RECIPE, f"train.steps={steps}", f"logging.log_every={steps}",
                   f"plan.calibration={calibration}",
                   *(f"{k}={as_override(v)}" for k, v in overrides.items())]).cfg
    with tempfile.TemporaryDirectory() as run_dir:
        history = run_ranks(_quiet_train, WORLD, (cfg, run_dir), start_method="fork", threads=1,
                            backend="gloo", timeout_s=600)[0]
    return statistics.median(h["step_time"] for h in history[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=None,
                        help="calibration file (default: a temporary one, measured first)")
    parser.add_argument("--reuse", action="store_true",
                        help="use --calibration as it is instead of measuring it again")
    parser.add_argument("--top", type=int, default=6, help="layouts trained (default 6)")
    parser.add_argument("--steps", type=int, default=8, help="steps per layout (default 8)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.calibration or Path(tmp) / "calibration.json")
        cfg = compose([*RECIPE, f"plan.calibration={path}"]).cfg
        if not (args.reuse and path.is_file()):
            print(f"calibrating into {path} (model.dim={cfg.model.dim}, train.seq_len="
                  f"{cfg.train.seq_len}) ...", flush=True)
            calibrate(path, cfg.model, cfg.train.seq_len)
        hw = hardware_for(cfg, gpu_available=False)
        result = search(cfg, WORLD, hw)
        top = result.ranked[:args.top]
        print(f"search: {result.layouts} valid layouts of {WORLD} ranks, {len(result.ranked)} "
              f"fit; training the top {len(top)} for {args.steps} steps each", flush=True)
        measured = [measured_step_s(c.overrides, args.steps, str(path)) for c in top]
    best = min(measured)
    order = sorted(range(len(top)), key=lambda i: measured[i])
    print(f"\n{'predicted rank':>14} {'measured rank':>13} {'predicted s':>11} "
          f"{'measured s':>10} {'measured/predicted':>18}  layout")
    for i, c in enumerate(top):
        print(f"{i + 1:>14} {order.index(i) + 1:>13} {c.step.total_s:>11.4f} {measured[i]:>10.4f} "
              f"{measured[i] / c.step.total_s:>18.2f}  {layout_label(c.overrides)}")
    gap = measured[0] / best - 1
    print(f"\nparallel.auto's choice (predicted rank 1) is measured rank {order.index(0) + 1} of "
          f"{len(top)}, {gap:.1%} slower than the measured best "
          f"({'within' if gap <= 0.10 else 'outside'} the 10% goal)")


if __name__ == "__main__":
    main()
