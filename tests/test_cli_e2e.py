"""The installed command end to end, in subprocesses: training with 4 local ranks, and conf/ +
recipes/ found from a non-editable install run in another folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


@pytest.mark.slow  # 15 s on 2 cores: 12 steps of the tiny recipe on 4 ranks, passkey evals twice
def test_train_tiny_recipe_four_ranks(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "lctrain.cli", "train", "+recipe=tiny", "train.steps=12",
         "train.global_batch=8", "train.micro_batch=1", "logging.log_every=1", "eval.every=6",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 rank(s) on cpu" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_sec"):
        assert all(key in r for r in records), key
    assert records[-1]["tokens"] == 12 * 8 * 256
    # ring, cp=2: per layer and sequence (P-1) * 2 * (L/P) * d_kv elements forward
    # (docs/parallelism.md §6) and twice that backward; d_kv = 2 KV heads x 16, L = 256,
    # P = 2; 4 layers; 4 sequences per rank and step (global batch 8 over dp=2); fp32: 4 bytes
    # per element
    per_layer_seq = 3 * (2 - 1) * 2 * (256 // 2) * (2 * 16)
    # with packed passkey documents only the travelling tokens go round (§24): per micro-batch
    # 3 x 2 x n x 32 elements per layer for its n travelling tokens of 128, so every step sends
    # a whole number of such tokens, fewer than all 4 x 128
    per_token = 3 * (2 - 1) * 2 * (2 * 16) * 4 * 4  # x 4 layers x 4 bytes
    for r in records:
        assert r["cp_bytes_sent"] % per_token == 0, r["cp_bytes_sent"]
        assert 0 < r["cp_bytes_sent"] < per_layer_seq * 4 * 4 * 4
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    # the passkey evals ran at steps 6 and 12, on every cell of the recipe
    cells = [f"eval/passkey/len{n}/depth{d:.2f}" for n in (64, 128, 256)
             for d in (0, 0.25, 0.5, 0.75, 1)]
    assert [r["step"] for r in records if "eval/passkey/acc" in r] == [6, 12]
    assert all(0 <= records[5][c] <= 1 for c in cells)
    assert "eval passkey len256: acc" in done.stdout
    config = (run_dir / "config.yaml").read_text()
    assert "cp: 2" in config and "attention: ring" in config and "steps: 12" in config


@pytest.mark.slow  # 4-5 s on 2 cores: pip install --target, then a subprocess
def test_non_editable_install_finds_conf_and_recipes(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--target", str(target), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    assert (target / "lctrain" / "recipes" / "llama-256k.yaml").is_file()
    assert (target / "lctrain" / "conf" / "model" / "llama3-8b.yaml").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import lctrain, sys; print(lctrain.__file__); import lctrain.attention, "
            "lctrain.data.loader as d; print(lctrain.attention.__file__); print(d.__file__); "
            "from lctrain.cli import main; main(sys.argv[1:])")
    # the recipe's layout without the checkpoint and corpus it requires (null, synthetic data)
    plan = ["plan", "+recipe=llama-256k", "model.init_from=null", "model.hf_overrides=[]",
            "data.source=synthetic", "data.path=null", "data.tokenizer=null"]
    done = subprocess.run([sys.executable, "-c", code, *plan],
                          cwd=elsewhere, env={**ENV, "PYTHONPATH": str(target)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(line.startswith(str(target)) for line in done.stdout.splitlines()[:3])
    assert "world size 256" in done.stdout
