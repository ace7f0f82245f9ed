"""lctrain without its CLI stack: with hydra, omegaconf, wandb and datasets unimportable, every
module below the prepare layer (lctrain.config.compose aside) and tools/gpu_check.py (with its
gpu_checks) import, and a tiny single-process training runs; none of the blocked packages is
loaded. A bare GPU box with only torch installed runs tools/gpu_check.py this way. Where an
optional package is needed after all (logging.wandb, a parquet input), its absence says what to
install."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("hydra", "omegaconf", "wandb", "datasets")
PACKAGES = ("attention", "config", "data", "layout", "models", "parallel", "planning", "rundir",
            "training")

BLOCK = f"""
import importlib, importlib.util, json, pkgutil, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked by tests/test_imports.py")
        return None

sys.meta_path.insert(0, Blocked())

def loaded():
    return sorted(m for m in sys.modules if m.partition(".")[0] in {BLOCKED!r})
"""

IMPORT_ALL = BLOCK + f"""
names = []
for package in {PACKAGES!r}:
    module = importlib.import_module("lctrain." + package)
    names += [f"lctrain.{{package}}.{{m.name}}" for m in pkgutil.iter_modules(module.__path__)]
names = [n for n in names if n != "lctrain.config.compose"]
for name in names:
    importlib.import_module(name)
spec = importlib.util.spec_from_file_location("gpu_check", {str(ROOT / "tools" / "gpu_check.py")!r})
sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
spec.loader.exec_module(sys.modules["gpu_check"])
print(json.dumps({{"imported": names, "loaded": loaded()}}))
"""

TRAIN = BLOCK + """
from lctrain.config import LctrainConfig, ModelConfig
from lctrain.training.loop import train

cfg = LctrainConfig()
cfg.model = ModelConfig(vocab_size=512, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
cfg.train.steps, cfg.train.seq_len, cfg.train.global_batch = 2, 64, 2
cfg.train.micro_batch, cfg.train.device = 2, "cpu"
cfg.logging.progress, cfg.logging.wandb, cfg.logging.tensorboard = False, False, False
history = train(cfg, sys.argv[1])
print(json.dumps({"losses": [h["loss"] for h in history], "loaded": loaded()}))
"""


def _run(code: str, *args: str) -> dict:
    """`code` in a fresh interpreter, offline; the JSON object its last line prints."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):  # one process, whatever launched pytest
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_modules_below_the_cli_import_without_hydra_omegaconf_wandb_datasets():
    out = _run(IMPORT_ALL)
    assert {"lctrain.training.loop", "lctrain.config.resolved", "lctrain.data.ingest",
            "lctrain.parallel.runtime", "lctrain.models.hf"} <= set(out["imported"])
    assert out["loaded"] == []


@pytest.mark.slow  # 4 s on 2 cores: a training run in a fresh interpreter
def test_tiny_training_runs_without_hydra_omegaconf_wandb_datasets(tmp_path):
    out = _run(TRAIN, str(tmp_path / "run"))
    assert len(out["losses"]) == 2 and all(loss > 0 for loss in out["losses"])
    assert out["loaded"] == []
    assert "vocab_size: 512" in (tmp_path / "run" / "config.yaml").read_text()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_missing_optional_package_says_what_to_install(tmp_path, monkeypatch):
    from lctrain.config import LoggingConfig
    from lctrain.data.ingest import Input, _streamed
    from lctrain.training.metrics import MetricsLogger

    for name in ("wandb", "datasets"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(LoggingConfig(progress=False, wandb=True), tmp_path, 0, 1)
    with pytest.raises(ImportError, match="pip install datasets"):
        _streamed(Input("parquet", str(tmp_path / "x.parquet")), "train")
