"""`lctrain plot`: figures read back as pixels (size, not blank, each run's colour where its data
is), the last row of a resumed step wins, and every bad input is exit code 2 with a message."""

import json

import numpy as np
import pytest
from matplotlib import colors
from matplotlib import image as mpimg

from lctrain.commands import plot
from lctrain.rundir.metrics_log import read_metrics
from tests.helpers import run_cli


def _row(step, mfu=True, run=0, **extra):
    """A logged step; `run` shifts every curve so that two runs' lines do not overlap."""
    row = {"step": step, "loss": 5.0 - 0.3 * step + run, "lr": 1e-3, "grad_norm": 1.0,
           "tokens_per_sec": 1000.0 + 10 * step * (1 + run), "step_time": 0.5,
           "data_time": 0.01, "tflops_per_rank": 100.0, "peak_mem_bytes": (3 + step + run) * 2**30,
           "traffic/tp": 1e6, "traffic/cp": 2e6, "traffic/pp": 0, "traffic/dp": 4e6}
    if mfu:
        row["mfu"] = 0.3 + 0.01 * step
    return row | extra


def _write(run_dir, rows, extra_lines=()):
    run_dir.mkdir(parents=True)
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def _two_runs(tmp_path):
    """Run a: resumed at step 3 (steps 3 and 4 logged twice), with evals; run b: no mfu."""
    evals = {"eval/passkey/acc": 0.5, "eval/passkey/len64/acc": 0.75,
             "eval/passkey/len64/depth0.25": 1.0, "val_loss": 4.0, "val_loss/pos0-64": 4.3,
             "val_loss/pos64-128": 4.0, "val_loss/pos128-256": 3.8}
    a_rows = [_row(s) for s in range(1, 5)] + [_row(s) for s in range(3, 7)]
    a_rows[1] |= evals | {"eval/passkey/acc": 0.25}
    a_rows[3] |= evals
    a_rows[-1] |= evals | {"eval/passkey/acc": 0.9}
    b_rows = [_row(s, run=1) | {"mfu": None} for s in range(1, 7)]
    return _write(tmp_path / "x" / "a", a_rows), _write(tmp_path / "y" / "b", b_rows)


def _pixels_near(img, color, tol=0.06):
    rgb = np.array(colors.to_rgb(color))
    return int((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).sum())


def test_plot_overlays_runs_one_colour_each(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    out = tmp_path / "out"
    code, stdout, _ = run_cli(["plot", str(a), str(b), f"--out={out}"], capsys)
    assert code == 0
    stems = ["loss", "tokens_per_sec", "mfu", "memory", "eval", "loss_by_position"]
    assert stdout.split() == [str(out / f"{s}.png") for s in stems + ["passkey_heatmap"]]
    images = {s: mpimg.imread(out / f"{s}.png") for s in stems}
    for stem, img in images.items():
        assert img.shape[:2] == (450, 800), stem
        assert (img[..., :3].min(axis=-1) < 0.9).mean() > 0.01, f"{stem}.png is blank"
    a_colour, b_colour = plot.PALETTE[:2]
    for stem in ("loss", "tokens_per_sec", "memory"):
        assert _pixels_near(images[stem], a_colour) > 500, stem
        assert _pixels_near(images[stem], b_colour) > 500, stem
    # run b logged no mfu (null) and no evals: only run a's colour there
    for stem in ("mfu", "eval", "loss_by_position"):
        assert _pixels_near(images[stem], a_colour) > 500, stem
        assert _pixels_near(images[stem], b_colour) < 20, stem


def test_default_out_is_the_first_runs_plots_and_skips_are_said(tmp_path, capsys):
    run_dir = _write(tmp_path / "solo", [_row(s, mfu=False) for s in range(1, 4)])
    code, stdout, _ = run_cli(["plot", str(run_dir)], capsys)
    assert code == 0
    assert "skipped mfu.png: no run logged mfu" in stdout
    assert "skipped eval.png: no run logged eval/<task>/acc" in stdout
    assert "skipped loss_by_position.png: no run logged val_loss/pos<lo>-<hi>" in stdout
    assert str(run_dir / "plots" / "loss.png") in stdout
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == [
        "loss.png", "memory.png", "tokens_per_sec.png"]


def test_a_resumed_step_keeps_its_last_row(tmp_path):
    a, _ = _two_runs(tmp_path)
    rows = read_metrics(a / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert "eval/passkey/acc" not in rows[3]  # the step-4 row before the resume had evals
    assert rows[5]["eval/passkey/acc"] == 0.9
    steps, values = plot.series(rows, "eval/passkey/acc")
    assert (steps, values) == ([2, 6], [0.25, 0.9])


def test_eval_lines_and_labels(tmp_path):
    a, b = _two_runs(tmp_path)
    c = _write(tmp_path / "z" / "a", [_row(1)])
    runs = plot.load_runs([str(a), str(b), str(c)])
    assert [r.label for r in runs] == ["x/a", "b", "z/a"]
    figures = plot.build_lines(runs)
    assert [line.label for line in figures["eval"]] == ["x/a passkey", "x/a passkey/len64"]
    assert [line.label for line in figures["mfu"]] == ["x/a", "z/a"]
    assert figures["mfu"][0].values[0] == pytest.approx(31.0)  # percent
    assert figures["memory"][2].values == [pytest.approx(4.0)]  # GiB
    assert [line.color for line in figures["loss"]] == [plot.PALETTE[0]] * 2 + [
        plot.PALETTE[1], plot.PALETTE[2]]
    # the loss by position band of each eval step (step 4's evals were logged again without)
    by_position = figures["loss_by_position"]
    assert [line.label for line in by_position] == ["x/a step 2", "x/a step 6"]
    assert by_position[0].steps == [64, 128, 256] and by_position[0].values == [4.3, 4.0, 3.8]
    assert [line.linestyle for line in by_position] == list(plot.LINESTYLES[:2])


def test_heatmap_of_each_task_by_length_and_depth(tmp_path, capsys):
    cells = {f"eval/needle/len{n}/depth{d}": n / 1000 + float(d) for n in (128, 256)
             for d in ("0.00", "0.50", "1.00")}
    cells.pop("eval/needle/len256/depth0.50")  # a cell never logged
    a = _write(tmp_path / "a", [_row(1), _row(2) | cells | {"eval/needle/acc": 0.5}])
    b = _write(tmp_path / "b", [_row(1) | {"eval/needle/len64/depth0.00": 1.0}, _row(2)])
    grids = plot.heatmaps(plot.load_runs([str(a), str(b)]))
    assert list(grids) == ["needle"] and [g.label for g in grids["needle"]] == ["a", "b"]
    grid_a, grid_b = grids["needle"]
    assert (grid_a.step, grid_a.lengths, grid_a.depths) == (2, [128, 256], [0.0, 0.5, 1.0])
    assert grid_a.values[0] == pytest.approx([0.128, 0.628, 1.128])
    assert grid_a.values[1][2] == pytest.approx(1.256)
    assert np.isnan(grid_a.values[1][1])
    assert (grid_b.step, grid_b.values) == (1, [[1.0]])  # its last row with cells
    code, stdout, _ = run_cli(["plot", str(a), str(b), f"--out={tmp_path / 'out'}"], capsys)
    assert code == 0 and str(tmp_path / "out" / "needle_heatmap.png") in stdout.split()
    image = mpimg.imread(tmp_path / "out" / "needle_heatmap.png")
    assert image.shape[:2] == (450, 800)


@pytest.mark.parametrize("case, message", [
    ("missing", "nope: no such file or directory"),
    ("not_run", "not a run dir (no metrics.jsonl)"),
    ("malformed", "metrics.jsonl:3: not valid JSON"),
    ("no_step", "metrics.jsonl:2: not a JSON object with an integer \"step\""),
    ("empty", "no plottable step"),
    ("out_flag", "--out takes one folder: --out=DIR"),
])
def test_bad_input_is_exit_2_with_a_message(tmp_path, capsys, case, message):
    path, flags = tmp_path / case, []
    if case == "missing":
        path = tmp_path / "nope"
    elif case == "not_run":
        path.mkdir()
    elif case == "malformed":
        _write(path, [_row(1), _row(2)], ['{"step": 3, "loss":'])
    elif case == "no_step":
        _write(path, [_row(1), {"loss": 1.0}])
    elif case == "empty":
        _write(path, [{"step": 1, "mfu": None}])
    else:
        _write(path, [_row(1)])
        flags = ["--out"]
    code, _, err = run_cli(["plot", str(path), *flags], capsys)
    assert code == 2
    assert message in err
