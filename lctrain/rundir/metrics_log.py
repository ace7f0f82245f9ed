"""A run's metrics.jsonl read back: one JSON object per logged step (lctrain.training.metrics
writes them), the last row of a step winning when a resumed run logged it again. A line that is
not such an object is a ConfigError naming the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from lctrain.config import ConfigError


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, one per step, ascending by step: a training row replaces
    the step's earlier one (a resumed run logs its steps again, on another trajectory); a row
    of scores alone (`lctrain eval` of a checkpoint, no loss) joins the step's row."""
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError([f"{path}:{number}: not valid JSON ({e.msg}); fix or delete "
                                   "that line"], header="unreadable metrics") from None
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                raise ConfigError([f"{path}:{number}: not a JSON object with an integer "
                                   "\"step\"; fix or delete that line"],
                                  header="unreadable metrics")
            step = row["step"]
            by_step[step] = row if "loss" in row else {**by_step.get(step, {}), **row}
    return [by_step[s] for s in sorted(by_step)]
