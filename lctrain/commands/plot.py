"""`lctrain plot RUN_DIR [RUN_DIR ...] [--out=DIR]`: PNGs of each run's metrics.jsonl against
step, runs overlaid in every figure, one colour per run (`PALETTE`, in the order given), the
legend naming each run by its directory (`parent/name` where two names are the same):

  loss.png            train loss (solid) and val_loss (dashed)
  tokens_per_sec.png  throughput, tokens/s
  mfu.png             model FLOPs utilisation, percent
  memory.png          peak_mem_bytes (the max over ranks), GiB
  eval.png            accuracy, one line style per eval/<task>/acc and eval/<task>/len<N>/acc
                      (the per-depth cells are left out)
  <task>_heatmap.png  accuracy by context length (rows) and needle depth (columns) of each
                      task's cells (eval/<task>/len<N>/depth<d>) at each run's last eval step,
                      one panel per run (needle_heatmap.png for eval.tasks=[needle])
  loss_by_position.png  validation loss against position (val_loss/pos<lo>-<hi>, plotted at
                      each band's end on a log2 axis), one line per eval step: the last
                      `POSITION_STEPS` eval steps of each run, one line style per step

A figure whose metric no run logged is skipped, and the command says so. Where: --out=DIR, else
the first RUN_DIR's plots/ folder, whether one run or several are given. A step logged twice (a
run resumed from a checkpoint appends its rows again) keeps its last row.

Nothing but json and matplotlib: the command starts without torch, and matplotlib (Agg) is
imported only once there is something to draw.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from lctrain.commands import CommandArgs
from lctrain.config import ConfigError
from lctrain.rundir import RunDir
from lctrain.rundir.metrics_log import read_metrics

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf")
"""One colour per run, in the order the runs are given (repeats after eight runs)."""
LINESTYLES = ("-", "--", ":", "-.")
"""One line style per metric within a figure (loss / val_loss, each eval key)."""
FIGURES = {  # file stem: (y label, scale, keys; None: every eval accuracy key logged)
    "loss": ("loss", 1.0, ("loss", "val_loss")),
    "tokens_per_sec": ("tokens/s", 1.0, ("tokens_per_sec",)),
    "mfu": ("MFU (%)", 100.0, ("mfu",)),
    "memory": ("peak memory, max over ranks (GiB)", 1.0 / 2**30, ("peak_mem_bytes",)),
    "eval": ("accuracy", 1.0, None),
}
EVAL_ACC = re.compile(r"eval/([^/]+)/(?:len(\d+)/)?acc")
CELL = re.compile(r"eval/([^/]+)/len(\d+)/depth([0-9.]+)")
"""eval/<task>/len<N>/depth<d>: one cell of a task's length x depth grid."""
POSITION_BAND = re.compile(r"val_loss/pos(\d+)-(\d+)")
"""val_loss/pos<lo>-<hi>: the validation loss of the targets at positions [lo, hi)."""
POSITION_STEPS = len(LINESTYLES)
"""Eval steps per run drawn in loss_by_position.png (the last ones), one line style each."""
XAXES = {"loss_by_position": ("position (end of band), tokens", 2)}
"""Figures not against step: x label and log base."""
"""eval/<task>/acc and eval/<task>/len<N>/acc; the per-depth cells do not match."""
FIGSIZE, DPI = (8, 4.5), 100  # 800 x 450 pixels


@dataclass(frozen=True)
class Run:
    label: str
    rows: list[dict]
    """One row per step, ascending; the last row logged for each step."""


@dataclass(frozen=True)
class Line:
    label: str
    color: str
    linestyle: str
    steps: list[int]
    values: list[float]


def labels(dirs: list[Path]) -> list[str]:
    """Each run's directory name; `parent/name` where names repeat; the full path if that does."""
    names = [d.name for d in dirs]
    names = [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(dirs, names)]


def load_runs(paths: list[str]) -> list[Run]:
    """Every run named, or one ConfigError listing every path that is not a readable run dir."""
    if not paths:
        raise ConfigError(["give at least one RUN_DIR: lctrain plot RUN_DIR [RUN_DIR ...]"],
                          header="cannot plot")
    dirs = [Path(p).resolve() for p in paths]
    problems, rows = [], []
    for given, d in zip(paths, dirs):
        if not d.exists():
            problems.append(f"{given}: no such file or directory")
        elif not RunDir(d).metrics.is_file():
            problems.append(f"{given}: not a run dir (no metrics.jsonl); a run dir is the "
                            "hydra.run.dir of `lctrain train`, holding metrics.jsonl (one JSON "
                            "row per logged step) beside its checkpoints")
        else:
            try:
                rows.append(read_metrics(RunDir(d).metrics))
            except ConfigError as e:
                problems += e.problems
    if problems:
        raise ConfigError(problems, header="cannot plot")
    return [Run(label, r) for label, r in zip(labels(dirs), rows)]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where `key` is a finite number (absent or null: no point)."""
    points = [(row["step"], float(row[key])) for row in rows
              if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool)
              and math.isfinite(row[key])]
    return [s for s, _ in points], [v for _, v in points]


def eval_keys(runs: list[Run]) -> list[str]:
    """Every eval accuracy key any run logged: per task, the overall one first, then by length."""
    found = {k for run in runs for row in run.rows for k in row if EVAL_ACC.fullmatch(k)}

    def order(key: str) -> tuple[str, int]:
        task, length = EVAL_ACC.fullmatch(key).groups()
        return task, int(length) if length else -1

    return sorted(found, key=order)


def build_lines(runs: list[Run]) -> dict[str, list[Line]]:
    """Figure stem -> its lines (empty: no run logged that metric); colour by run, style by key."""
    figures = {}
    for stem, (_, scale, keys) in FIGURES.items():
        keys = keys if keys is not None else eval_keys(runs)
        lines = []
        for i, run in enumerate(runs):
            for j, key in enumerate(keys):
                steps, values = series(run.rows, key)
                if not steps:
                    continue
                name = key.removeprefix("eval/").removesuffix("/acc")
                lines.append(Line(run.label if len(keys) == 1 else f"{run.label} {name}",
                                  PALETTE[i % len(PALETTE)], LINESTYLES[j % len(LINESTYLES)],
                                  steps, [v * scale for v in values]))
        figures[stem] = lines
    figures["loss_by_position"] = position_lines(runs)
    return figures


def position_lines(runs: list[Run]) -> list[Line]:
    """The validation loss by position band of each run's last POSITION_STEPS eval steps: x is
    each band's end (its upper position), y its loss."""
    lines = []
    for i, run in enumerate(runs):
        rows = [row for row in run.rows if any(POSITION_BAND.fullmatch(k) for k in row)]
        for j, row in enumerate(rows[-POSITION_STEPS:]):
            bands = sorted((int(m.group(2)), float(row[k])) for k in row
                           if (m := POSITION_BAND.fullmatch(k)))
            lines.append(Line(f"{run.label} step {row['step']}", PALETTE[i % len(PALETTE)],
                              LINESTYLES[j % len(LINESTYLES)], [end for end, _ in bands],
                              [loss for _, loss in bands]))
    return lines


@dataclass(frozen=True)
class Grid:
    """A task's accuracy by (length, depth) at one run's last eval step with its cells."""

    label: str
    step: int
    lengths: list[int]
    depths: list[float]
    values: list[list[float]]
    """[length][depth]; NaN where the cell was not logged."""


def heatmaps(runs: list[Run]) -> dict[str, list[Grid]]:
    """task -> one grid per run that logged its cells."""
    grids: dict[str, list[Grid]] = {}
    for run in runs:
        for task in sorted({m.group(1) for row in run.rows for k in row
                            if (m := CELL.fullmatch(k))}):
            row = [r for r in run.rows if any((m := CELL.fullmatch(k)) and m.group(1) == task
                                              for k in r)][-1]
            cells = {(int(m.group(2)), float(m.group(3))): float(v) for k, v in row.items()
                     if (m := CELL.fullmatch(k)) and m.group(1) == task}
            lengths = sorted({n for n, _ in cells})
            depths = sorted({d for _, d in cells})
            grids.setdefault(task, []).append(Grid(
                run.label, row["step"], lengths, depths,
                [[cells.get((n, d), math.nan) for d in depths] for n in lengths]))
    return grids


def _pyplot(out: Path):
    """matplotlib's pyplot on the Agg backend, `out` created. Lazy: a second of import, and
    only when there is something to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    return plt


def draw_heatmaps(grids: dict[str, list[Grid]], out: Path) -> list[Path]:
    """<task>_heatmap.png per task: a panel per run, each cell's accuracy written in it."""
    plt = _pyplot(out) if grids else None
    written = []
    for task, panels in grids.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(FIGSIZE[0], FIGSIZE[1]), dpi=DPI,
                                 squeeze=False)
        for ax, grid in zip(axes[0], panels):
            image = ax.imshow(grid.values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(grid.depths)), [f"{d:g}" for d in grid.depths])
            ax.set_yticks(range(len(grid.lengths)), [str(n) for n in grid.lengths])
            ax.set(xlabel="needle depth", title=f"{task}: {grid.label}, step {grid.step}")
            for i, row in enumerate(grid.values):
                for j, value in enumerate(row):
                    if not math.isnan(value):
                        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        axes[0][0].set_ylabel("context length")
        fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
        fig.savefig(out / f"{task}_heatmap.png", dpi=DPI)
        plt.close(fig)
        written.append(out / f"{task}_heatmap.png")
    return written


def draw(figures: dict[str, list[Line]], out: Path) -> list[Path]:
    """One PNG per figure that has lines, in `out`; returns their paths."""
    plt = _pyplot(out) if any(figures.values()) else None
    written = []
    for stem, lines in figures.items():
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
        for line in lines:  # a single point gets a marker, or it would not show
            ax.plot(line.steps, line.values, color=line.color, linestyle=line.linestyle,
                    linewidth=2, marker="o" if len(line.steps) == 1 else None, label=line.label)
        xlabel, base = XAXES.get(stem, ("step", None))
        if base:
            ax.set_xscale("log", base=base)
        ax.set(xlabel=xlabel, ylabel=FIGURES[stem][0] if stem in FIGURES else "val_loss",
               title=stem)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=DPI)
        plt.close(fig)
        written.append(out / f"{stem}.png")
    return written


def _out_dir(paths: list[str], flags: frozenset[str]) -> Path:
    """--out=DIR, else the first RUN_DIR's plots/."""
    given = [f.split("=", 1)[1] if "=" in f else "" for f in flags if f.split("=", 1)[0] == "--out"]
    if any(not g for g in given) or len(given) > 1:
        raise ConfigError(["--out takes one folder: --out=DIR"], header="cannot plot")
    out = Path(given[0]) if given else Path(paths[0]) / "plots"
    if out.exists() and not out.is_dir():
        raise ConfigError([f"--out={out}: a file, not a folder"], header="cannot plot")
    return out


def run(args: CommandArgs) -> int:
    paths = args.words
    runs = load_runs(paths)
    out = _out_dir(paths, args.flags)
    figures = build_lines(runs)
    grids = heatmaps(runs)
    if not any(figures.values()) and not grids:
        raise ConfigError([f"no plottable step in {', '.join(paths)}: no row has a number for "
                           "loss, tokens_per_sec, mfu, peak_mem_bytes or an eval accuracy"],
                          header="cannot plot")
    for stem, lines in figures.items():
        if not lines:
            keys = ((FIGURES[stem][2] or ("eval/<task>/acc",)) if stem in FIGURES
                    else ("val_loss/pos<lo>-<hi> (eval.position_band)",))
            print(f"skipped {stem}.png: no run logged {' or '.join(keys)}")
    for path in draw(figures, out) + draw_heatmaps(grids, out):
        print(path)
    return 0
