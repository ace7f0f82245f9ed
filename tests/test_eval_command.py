"""`lctrain eval`: a checkpoint saved by training, scored under another layout, gives the scores
training logged at that step (retrieval accuracy, validation loss and its position bands); a
Hugging Face model is scored from model.init_from alone; results land in the console,
metrics.jsonl and eval.json; nothing to score, no weights, or lengths beyond the context, is
exit 2 naming the fix."""

import json

import pytest

from lctrain.config.compose import compose
from lctrain.training.scoring import evaluate
from tests.helpers import on_ranks, run_cli, train_each
from tests.test_init_from import _token_dataset, save_hf

BASE = ["+recipe=tiny", "data.source=tokens", "data.val_fraction=0.25", "train.seq_len=32",
        "model.vocab_size=128", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=96", "model.n_layers=2", "train.global_batch=4", "eval.val_sequences=4",
        "eval.tasks=[passkey]", "eval.lengths=[32]", "eval.depths=[0,1]", "eval.samples=2",
        "eval.position_band=8", "logging.progress=false", "data.document_masking=false"]


def _train_then_evaluate(trained, scored, run_dir: str) -> tuple[list[dict], dict]:
    history = train_each({"trained": trained}, run_dir)["trained"]
    return history, evaluate(scored, f"{run_dir}/scored")


@pytest.mark.slow  # 3 s: a training run and its checkpoint scored on 2 ranks
def test_a_checkpoint_scores_under_another_layout_as_training_logged_it(tmp_path):
    _token_dataset(tmp_path / "data")
    data = f"data.path={tmp_path / 'data'}"
    trained = compose([*BASE, data, "train.steps=2", "eval.every=2", "checkpoint.every=2",
                       "parallel.cp=2", "parallel.dp=2", "train.micro_batch=1"]).cfg
    step2 = tmp_path / "runs" / "trained" / "checkpoints" / "step-00000002"
    scored = compose([*BASE, data, f"checkpoint.load={step2}", "parallel.cp=2", "parallel.dp=1",
                      "parallel.tp=2", "parallel.sp=true", "train.micro_batch=4"]).cfg
    history, results = on_ranks(_train_then_evaluate, 4, trained, scored,
                                str(tmp_path / "runs"), timeout_s=300)[0]
    logged = history[-1]
    keys = [k for k in results if k.startswith(("eval/", "val_loss"))]
    assert {"val_loss", "val_loss/pos0-8", "val_loss/pos16-32", "eval/passkey/acc"} <= set(keys)
    for key in keys:
        assert results[key] == pytest.approx(logged[key], rel=1e-5), key
    written = json.loads((tmp_path / "runs" / "scored" / "eval.json").read_text())
    assert written["step"] == 2 and written["weights"] == str(step2)
    assert written["results"] == results
    rows = [json.loads(line) for line in (tmp_path / "runs" / "scored" / "metrics.jsonl").open()]
    assert len(rows) == 1 and rows[0]["step"] == 2 and rows[0]["val_loss"] == results["val_loss"]


def test_a_hugging_face_model_is_scored_from_the_command_line(tmp_path, capsys):
    _token_dataset(tmp_path / "data")
    save_hf(tmp_path / "hf", "gqa_untied")
    common = [*BASE, f"data.path={tmp_path / 'data'}", "parallel.cp=1", "parallel.dp=1",
              "train.micro_batch=4"]
    code, _, err = run_cli(["eval", *common, f"model.init_from={tmp_path / 'hf'}",
                            f"hydra.run.dir={tmp_path / 'run'}"], capsys)
    assert code == 0, err
    written = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert written["step"] == 0 and written["weights"] == str(tmp_path / "hf")
    assert written["results"]["val_loss"] > 0 and "eval/passkey/len32/acc" in written["results"]
    code, _, err = run_cli(["eval", *common, f"hydra.run.dir={tmp_path / 'none'}"], capsys)
    assert code == 2 and "lctrain eval scores trained weights, and none are named" in err
    code, _, err = run_cli(["eval", *common, f"model.init_from={tmp_path / 'hf'}",
                            "eval.tasks=[]", "data.val_fraction=0",
                            f"hydra.run.dir={tmp_path / 'nothing'}"], capsys)
    assert code == 2 and "eval.tasks is empty and no validation data is set" in err
    # the eval grid is checked though training never evaluates (eval.every=0): it crashed
    code, _, err = run_cli(["eval", *common, f"model.init_from={tmp_path / 'hf'}",
                            "eval.every=0", "eval.lengths=[64,4096]",
                            f"hydra.run.dir={tmp_path / 'long'}"], capsys)
    assert code == 2 and "eval.lengths contains 4096; each context length must lie in" in err
