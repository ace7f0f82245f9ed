"""Every validation rule: one bad config each, the message names key, value and a fix.

The same cases run through the CLI in-process: exit code 2, the message on stderr, and no
process started (the launcher is replaced by one that fails the test).
"""

import pytest

from lctrain.config.suggest import nearest_multiple
from lctrain.config.validation import warnings_for
from lctrain.parallel import launch
from lctrain.prepare.checks import preflight
from tests.helpers import exit_code, run_cli, tiny_config

# (section overrides, world size, substrings of the single expected message)
BAD = {
    "world_fixed_dp": ({"parallel": {"tp": 2, "dp": 2}}, 6,
                       ["world size 6 != parallel.tp=2 x cp=1 x pp=1 x dp=2 = 4",
                        "set parallel.dp=-1 (derives dp=3)"]),
    "world_not_divisible": ({"parallel": {"cp": 4}}, 6,
                            ["world size 6 is not divisible by", "= 4", "run 8 processes"]),
    "heads_vs_ulysses": ({"parallel": {"cp": 4, "attention": "ulysses"},
                          "model": {"n_heads": 6, "n_kv_heads": 6, "dim": 48}}, 4,
                         ["parallel.cp=4 with parallel.attention=ulysses", "= 6",
                          "try parallel.cp in [2, 3, 6]"]),
    "heads_vs_usp": ({"parallel": {"cp": 4, "attention": "usp", "ulysses_degree": 4},
                      "model": {"n_heads": 6, "n_kv_heads": 6, "dim": 48}}, 4,
                     ["parallel.ulysses_degree=4 with parallel.attention=usp"]),
    "heads_vs_tp": ({"parallel": {"tp": 8}, "train": {"global_batch": 4}}, 8,
                    ["model.n_heads=4 is not divisible by parallel.tp=8", "[1, 2, 4]"]),
    "kv_heads_vs_tp": ({"parallel": {"tp": 4}}, 4,
                       ["model.n_kv_heads=2 is not divisible by parallel.tp=4",
                        "try parallel.tp in [1, 2]"]),
    "gqa_groups": ({"model": {"n_kv_heads": 3}}, 1,
                   ["model.n_heads=4 is not a multiple of model.n_kv_heads=3", "[1, 2, 4]"]),
    "usp_degree": ({"parallel": {"cp": 4, "attention": "usp", "ulysses_degree": 3},
                    "model": {"n_heads": 6, "n_kv_heads": 6, "dim": 48}}, 4,
                   ["parallel.ulysses_degree=3 does not divide parallel.cp=4", "[1, 2, 4]"]),
    "ulysses_degree_unused": ({"parallel": {"cp": 2, "ulysses_degree": 2}}, 2,
                              ["parallel.ulysses_degree=2 is only used with parallel.attention=usp"]),
    "zigzag_seq": ({"parallel": {"cp": 4, "load_balance": "zigzag"}, "train": {"seq_len": 36}},
                   4, ["train.seq_len=36 must be a multiple of 8", "load_balance=zigzag",
                       "try train.seq_len=40"]),
    "documents_seq": ({"parallel": {"cp": 4}, "train": {"seq_len": 34},
                       "data": {"document_masking": True}}, 4,
                      ["train.seq_len=34 must be a multiple of 4",
                       "load_balance=auto (documents)", "try train.seq_len=36"]),
    "documents_need_masking": ({"parallel": {"cp": 2, "load_balance": "documents"},
                                "data": {"document_masking": False}}, 2,
                               ["parallel.load_balance=documents", "data.document_masking=true",
                                "parallel.load_balance=zigzag"]),
    "contiguous_seq": ({"parallel": {"cp": 3, "load_balance": "none"}, "train": {"seq_len": 32}},
                       3, ["train.seq_len=32 must be a multiple of 3", "try train.seq_len=33"]),
    "sp_seq": ({"parallel": {"tp": 2, "sp": True}, "train": {"seq_len": 33}}, 2,
               ["train.seq_len=33 must be a multiple of 2", "parallel.sp=true",
                "try train.seq_len=34"]),
    "sp_cp_seq": ({"parallel": {"tp": 2, "sp": True, "cp": 3, "load_balance": "none"},
                   "train": {"seq_len": 33}}, 6,
                  ["train.seq_len=33 must be a multiple of 6", "try train.seq_len=36"]),
    "layers_pp": ({"parallel": {"pp": 4}, "model": {"n_layers": 3},
                   "train": {"global_batch": 8}}, 4,
                  ["model.n_layers=3 cannot fill 4 stages", "try parallel.pp=3"]),
    "pp_layers": ({"parallel": {"pp": 2, "pp_layers": [1, 2]}}, 2,
                  ["parallel.pp_layers=[1, 2] must give 2 stages", "2 layers in all",
                   "try parallel.pp_layers=null"]),
    "pp_gpipe_virtual": ({"parallel": {"pp": 2, "pp_schedule": "gpipe", "pp_virtual_stages": 2},
                          "model": {"n_layers": 4}}, 2,
                         ["parallel.pp_schedule=gpipe runs one stage per rank",
                          "set parallel.pp_schedule=interleaved_1f1b"]),
    "pp_zbv_virtual": ({"parallel": {"pp": 2, "pp_schedule": "zbv"},
                        "train": {"global_batch": 8}}, 2,
                       ["parallel.pp_schedule=zbv runs two stages per rank",
                        "set parallel.pp_virtual_stages=2"]),
    "pp_zero_bubble_selective": ({"parallel": {"pp": 2, "pp_schedule": "zero_bubble",
                                               "pp_virtual_stages": 2},
                                  "model": {"n_layers": 4},
                                  "train": {"global_batch": 4,
                                            "activation_checkpointing": "selective"}}, 2,
                                 ["parallel.pp_schedule=zero_bubble with train.activation_"
                                  "checkpointing=selective", "allows one backward per block",
                                  "use train.activation_checkpointing=full"]),
    "pp_zbv_microbatches": ({"parallel": {"pp": 2, "pp_schedule": "zbv", "pp_virtual_stages": 2},
                             "model": {"n_layers": 4}, "train": {"global_batch": 2}}, 2,
                            ["parallel.pp_schedule=zbv at parallel.pp=2 needs at least 4",
                             "try train.global_batch=4"]),
    "pp_rounds": ({"parallel": {"pp": 2, "pp_schedule": "interleaved_1f1b",
                                "pp_virtual_stages": 2},
                   "model": {"n_layers": 4}, "train": {"global_batch": 5}}, 2,
                  ["runs micro-batches in rounds of parallel.pp=2", "5 is neither below 2",
                   "try train.global_batch=4"]),
    "ddp_tp": ({"parallel": {"tp": 2, "dp": 2, "dp_engine": "ddp"}}, 4,
               ["parallel.dp_engine=ddp with parallel.tp=2", "set parallel.dp_engine=fsdp"]),
    "zero_bubble_dp": ({"parallel": {"pp": 2, "dp": 2, "pp_schedule": "zero_bubble",
                                     "pp_virtual_stages": 2, "dp_engine": "ddp"},
                        "model": {"n_layers": 4}, "train": {"global_batch": 4}}, 4,
                       ["parallel.pp_schedule=zero_bubble with dp x cp = 2", "DDP reduces them",
                        "use parallel.pp_schedule=interleaved_1f1b"]),
    "global_batch": ({"train": {"global_batch": 10, "micro_batch": 2}}, 2,
                     ["train.global_batch=10 is not divisible by train.micro_batch=2 x dp=2 = 4",
                      "try train.global_batch=12"]),
    "pp_microbatches": ({"parallel": {"pp": 2}, "train": {"global_batch": 1}}, 2,
                        ["parallel.pp_schedule=1f1b at parallel.pp=2 needs at least 2",
                         "try train.global_batch=2"]),
    "attention_name": ({"parallel": {"attention": "flash"}}, 1,
                       ["parallel.attention='flash' is not one of ulysses, ring, usp, allgather"]),
    "load_balance_name": ({"parallel": {"load_balance": "striped"}}, 1,
                          ["parallel.load_balance='striped' is not one of auto, zigzag, none, "
                           "documents"]),
    "dtype_name": ({"train": {"dtype": "fp16"}}, 1, ["train.dtype='fp16' is not one of fp32, bf16"]),
    "nonpositive_cp": ({"parallel": {"cp": 0}}, 1, ["parallel.cp=0 must be a positive integer"]),
    "nonpositive_dp": ({"parallel": {"dp": 0}}, 1, ["parallel.dp=0 must be positive or -1"]),
    "nonpositive_seq": ({"train": {"seq_len": -5}}, 1,
                        ["train.seq_len=-5 must be a positive integer"]),
    "dim_heads": ({"model": {"dim": 66}}, 1,
                  ["model.dim=66 is not divisible by model.n_heads=4", "try model.dim=68"]),
    "odd_head_dim": ({"model": {"dim": 36}}, 1, ["head dim", "= 9 must be even for RoPE"]),
    "vocab_tp": ({"parallel": {"tp": 2}, "model": {"vocab_size": 127}}, 2,
                 ["model.vocab_size=127 is not divisible by parallel.tp=2",
                  "try model.vocab_size=128"]),
    "missing_token_dataset": ({"data": {"source": "tokens", "path": "/nonexistent/tok"}}, 1,
                              ["data.path=/nonexistent/tok is neither a built-in source"]),
    "tokens_without_path": ({"data": {"source": "tokens"}}, 1,
                            ["data.source=tokens needs data.path="]),
    "recall_pairs": ({"data": {"source": "recall", "recall_pairs": 100}}, 1,
                     ["data.recall_pairs=100 must lie in [1, model.vocab_size / 4 = 32]"]),
    "task_vocab": ({"data": {"source": "passkey"}, "model": {"vocab_size": 16}}, 1,
                   ["the passkey task(s) need model.vocab_size >= 32; got 16"]),
    "eval_length": ({"eval": {"every": 5, "lengths": [1000]}}, 1,
                    ["eval.lengths contains 1000", "train.seq_len=32"]),
    "checkpoint_load": ({"checkpoint": {"load": "/nonexistent/ckpt"}}, 1,
                        ["checkpoint.load=/nonexistent/ckpt is not a directory"]),
    "checkpoint_keep": ({"checkpoint": {"keep": -1}}, 1, ["checkpoint.keep=-1 must be >= 0"]),
    "model_only": ({"checkpoint": {"load_model_only": True}}, 1,
                   ["checkpoint.load_model_only=true needs checkpoint.load="]),
    "on_nan": ({"train": {"on_nan": "ignore"}}, 1,
               ["train.on_nan='ignore' is not one of stop, skip"]),
    "eval_task": ({"eval": {"every": 5, "tasks": ["copy"]}}, 1,
                  ["eval.tasks contains 'copy'; pick from passkey, recall"]),
    "min_lr": ({"optim": {"min_lr": 1.0}}, 1, ["optim.min_lr=1.0 must lie in [0, optim.lr="]),
    "warmup": ({"optim": {"warmup_steps": -1}}, 1, ["optim.warmup_steps=-1 must be >= 0"]),
    "synthetic_docs": ({"data": {"doc_len_min": 30, "doc_len_max": 10}}, 1,
                       ["data.doc_len_min=30, data.doc_len_max=10"]),
    "offload_without_full": ({"train": {"offload_activations": True,
                                        "activation_checkpointing": "selective"}}, 1,
                             ["train.offload_activations=true offloads the block inputs",
                              "set train.activation_checkpointing=full"]),
    "loss_chunk": ({"train": {"loss_chunk": -1}}, 1, ["train.loss_chunk=-1 must be >= 0"]),
    "mlp_chunk": ({"train": {"mlp_chunk": -2}}, 1, ["train.mlp_chunk=-2 must be >= 0"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_rule_reports_key_value_and_fix(name):
    sections, world, expected = BAD[name]
    problems = preflight(tiny_config(**sections), world)
    assert len(problems) == 1, problems
    for text in expected:
        assert text in problems[0], (text, problems[0])


def test_valid_layouts_pass():
    assert preflight(tiny_config(), 1) == []
    assert preflight(tiny_config(parallel={"dp": -1}), 4) == []
    assert preflight(tiny_config(parallel={"tp": 2, "sp": True, "cp": 2, "attention": "usp",
                                          "ulysses_degree": 2}, train={"global_batch": 2}), 8) == []


def test_all_problems_reported_at_once():
    cfg = tiny_config(parallel={"attention": "flash"}, train={"dtype": "fp8"},
                      optim={"warmup_steps": -3})
    problems = preflight(cfg, 1)
    assert len(problems) == 3
    assert any("parallel.attention" in p for p in problems)
    assert any("train.dtype" in p for p in problems)
    assert any("optim.warmup_steps" in p for p in problems)


def test_sp_without_tp_is_a_warning_not_an_error():
    cfg = tiny_config(parallel={"sp": True})
    assert preflight(cfg, 1) == []
    assert any("parallel.sp=true has no effect with parallel.tp=1" in w for w in warnings_for(cfg))


def test_pipeline_keys_without_pp_are_a_warning():
    cfg = tiny_config(parallel={"pp_schedule": "zbv", "pp_virtual_stages": 2})
    assert preflight(cfg, 1) == []
    assert any("are ignored with parallel.pp=1" in w for w in warnings_for(cfg))


def test_nearest_multiple():
    assert nearest_multiple(1000, 16) == 1008
    assert nearest_multiple(3, 8) == 8
    assert nearest_multiple(36, 8) == 40


def _to_overrides(sections: dict) -> list[str]:
    out = []
    for section, values in sections.items():
        for key, value in values.items():
            value = str(value).lower() if isinstance(value, bool) else value
            out.append(f"{section}.{key}={value}")
    return out


CLI_BASE = ["+recipe=tiny", "parallel.cp=1", "model.vocab_size=128", "model.dim=64", "model.n_layers=2",
            "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96", "train.seq_len=32",
            "train.global_batch=4", "train.micro_batch=1", "parallel.dp=-1", "optim.warmup_steps=1",
            "data.doc_len_min=8", "data.doc_len_max=24"]


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for an invalid config")

    monkeypatch.setattr(launch, "run_ranks", refuse)
    monkeypatch.setattr("lctrain.training.loop.train", refuse)


@pytest.mark.parametrize("name", sorted(BAD))
def test_cli_exits_2_before_any_process(name, capsys, no_launch, tmp_path):
    sections, world, expected = BAD[name]
    argv = ["train", *CLI_BASE, *_to_overrides(sections), f"launch.nproc={world}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    for text in expected:
        assert text in err, (text, err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,expected", [
    ("+unknown.key=1", "unknown key unknown"),
    ("+train.bogus=3", "unknown key train.bogus; valid keys under train: steps"),
    ("train.steps=abc", "train.steps"),
    ("+recipe=nope", "recipe"),
    ("parallel.nonsense=2", "nonsense"),
    # a mistyped key, set or added, names the keys it is closest to
    ("parallel.cpp=2", "unknown key parallel.cpp (did you mean parallel.cp or parallel.pp?)"),
    ("+parallel.cpp=2", "unknown key parallel.cpp (did you mean parallel.cp or parallel.pp?)"),
    ("paralel.cp=2", "unknown key paralel (did you mean parallel?); valid keys: model"),
    ("train.stepss=3", "unknown key train.stepss (did you mean train.steps?)"),
])
def test_cli_rejects_unknown_keys_and_bad_types(override, expected, capsys, no_launch):
    code, _, err = run_cli(["train", *CLI_BASE, override], capsys)
    assert code == 2
    assert expected in err


@pytest.mark.parametrize("overrides,expected", [
    (["train.stages=[{seq_len: 128, steps: 300}, {seq_len: 256, steps: -50}]", "train.steps=250"],
     "train.stages[1].steps=-50 must be a positive integer"),
    (["train.stages=[{seq_len: 0, steps: 100}, {seq_len: 256, steps: 150}]", "train.steps=250"],
     "train.stages[0].seq_len=0 must be a positive integer"),
    (["eval.lengths=[128, 0]"], "eval.lengths contains 0, which must be a positive integer"),
    (["data.answer_len=0"], "data.answer_len=0 must be a positive integer"),
    (["data.source=tokens", "data.path=/nowhere", "data.length_mix=[{max_len: -1, weight: 1}]"],
     "data.length_mix[0].max_len=-1 must be a positive integer"),
])
def test_counts_in_stage_and_length_keys_must_be_positive(overrides, expected, capsys,
                                                          no_launch):
    """A negative stage length used to add up (300 - 50 = 250 steps) and train."""
    code, _, err = run_cli(["train", *CLI_BASE, *overrides], capsys)
    assert code == 2
    assert expected in err, err


def test_cli_reports_several_unknown_keys_together(capsys, no_launch):
    code, _, err = run_cli(["plan", *CLI_BASE, "+a.b=1", "+train.c=2"], capsys)
    assert code == 2
    assert "unknown key a;" in err and "unknown key train.c;" in err


def test_cli_unknown_command_and_flag(capsys):
    for argv in (["fly"], ["train", "--json"]):
        assert exit_code(argv) == 2


def test_cli_refuses_a_model_this_machine_cannot_host(capsys, no_launch):
    code, _, err = run_cli(["train", "+recipe=tiny", "model=llama3-70b", "train.device=cpu"],
                           capsys)
    assert code == 2
    assert "4 CPU ranks of model.name=llama3-70b need about" in err and "GiB is available" in err
