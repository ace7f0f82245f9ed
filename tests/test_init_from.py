"""Continued pretraining from a Hugging Face Llama: config.json decides the model (no model.*
override needed), contradictions and unsupported features are refused by name, hf_overrides
are applied and reported, training starts at transformers' loss on every layout, token shards
must come from the model's tokenizer, and validation documents are never trained on."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from lctrain.config import ConfigError, ModelConfig
from lctrain.config.compose import compose
from lctrain.data.shards import ShardWriter, TokenStore
from lctrain.data.sources import build_source, build_val_source
from lctrain.data.splits import held_out
from lctrain.models.hf import hf_config
from lctrain.prepare.checks import preflight
from lctrain.prepare.init_from import resolve_model, same_value
from lctrain.training import loop
from tests.helpers import on_ranks, reference_model, run_cli, train_each, train_on_ranks

FAMILIES = {  # a random HF Llama of each shape family
    "gqa_untied": ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=96, rope_theta=50000.0),
    "tied": ModelConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=4, ffn_dim=64,
                        tie_embeddings=True, norm_eps=1e-6, rope_theta=100000.0),
    "mqa": ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=80),
    "llama3_rope": ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                               ffn_dim=96, rope_theta=500000.0, rope_type="llama3",
                               rope_factor=4.0, rope_original_max_position=16),
}
RUN = ["+recipe=tiny", "data.source=synthetic", "data.document_masking=false",
       "train.seq_len=32", "train.global_batch=4", "train.steps=1", "eval.every=0",
       "logging.progress=false", "optim.warmup_steps=1", "data.doc_len_min=8",
       "data.doc_len_max=24"]


def save_hf(path, family: str | ModelConfig, old_style_rope: bool = False):
    """A random transformers Llama of `family` saved with save_pretrained (safetensors)."""
    torch.manual_seed(0)
    shape = FAMILIES[family] if isinstance(family, str) else family
    model = transformers.LlamaForCausalLM(hf_config(shape)).eval()
    model.save_pretrained(path)
    if old_style_rope:  # top-level rope_theta + rope_scaling, as released checkpoints have
        cfg = json.loads((path / "config.json").read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = rope
        (path / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        out[family].mkdir()
        save_hf(out[family], family, old_style_rope=family == "llama3_rope")
    return out


def resolved(*overrides):
    return resolve_model(compose(list(overrides)))


def test_config_json_decides_and_plan_shows_the_origins(hf_dirs, capsys):
    for family, want in FAMILIES.items():
        composed = resolved("+recipe=tiny", f"model.init_from={hf_dirs[family]}")
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                      "tie_embeddings", "norm_eps", "rope_theta", "rope_type"):
            assert getattr(composed.cfg.model, field) == getattr(want, field), (family, field)
            assert composed.origins[field] == "config.json"
        if want.rope_type == "llama3":
            assert composed.cfg.model.rope_factor == 4.0
            assert composed.cfg.model.rope_original_max_position == 16
    gqa = resolved("+recipe=tiny", f"model.init_from={hf_dirs['gqa_untied']}")
    assert "model.rope_theta: 500000.0 (recipe or preset) -> 50000.0 (config.json)" in gqa.notes
    assert "model.n_layers: 4 (default) -> 2 (config.json)" in gqa.notes
    code, out, _ = run_cli(["plan", *RUN, f"model.init_from={hf_dirs['gqa_untied']}",
                            "launch.nproc=4", "--json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert plan["model"]["rope_theta"] == {"value": 50000.0, "origin": "config.json"}
    assert plan["model"]["init_std"]["origin"] == "default"


@pytest.mark.parametrize("override,ours,theirs", [
    ("model.n_layers=3", "3", "2"), ("model.rope_theta=12345", "12345.0", "50000.0"),
    ("model.tie_embeddings=true", "True", "False"), ("model.norm_eps=0.001", "0.001", "1e-05"),
])
def test_a_contradicting_override_is_exit_2_naming_both(hf_dirs, capsys, override, ours, theirs):
    code, _, err = run_cli(["plan", *RUN, f"model.init_from={hf_dirs['gqa_untied']}", override],
                           capsys)
    assert code == 2 and "contradicts" in err, err
    assert f"={ours} on the command line" in err and f"which has {theirs}" in err
    assert f"model.hf_overrides=[{override.split('=')[0].split('.')[1]}]" in err


def test_numbers_equal_as_float32_do_not_contradict(hf_dirs, tmp_path):
    """config.json written from float32: rms_norm_eps 9.999999747378752e-06 is 1e-5."""
    hf = tmp_path / "hf"
    shutil.copytree(hf_dirs["gqa_untied"], hf)
    config = json.loads((hf / "config.json").read_text())
    config["rms_norm_eps"] = 9.999999747378752e-06
    (hf / "config.json").write_text(json.dumps(config))
    composed = resolved("+recipe=tiny", f"model.init_from={hf}", "model.norm_eps=1e-5")
    assert composed.cfg.model.norm_eps == 1e-5 and composed.origins["norm_eps"] == "config.json"
    assert not any("norm_eps" in note for note in composed.notes)
    with pytest.raises(ConfigError, match="model.norm_eps=1.0001e-05 on the command line"):
        resolved("+recipe=tiny", f"model.init_from={hf}", "model.norm_eps=1.0001e-5")
    assert same_value(2, 2.0) and same_value("a", "a") and not same_value(True, 1)
    assert not same_value(2**24 + 1, 2**24)  # integers exactly


def _train(cfg, run_dir):
    return loop.train(cfg, run_dir)


def test_hf_overrides_are_applied_reported_and_exported(hf_dirs, tmp_path):
    composed = resolved(*RUN, f"model.init_from={hf_dirs['gqa_untied']}",
                        "model.hf_overrides=[rope_theta]", "model.rope_theta=1000000.0",
                        f"checkpoint.export_hf={tmp_path / 'out'}", "parallel.cp=1",
                        "parallel.dp=1")
    cfg = composed.cfg
    assert cfg.model.rope_theta == 1e6 and composed.origins["rope_theta"] == "hf_overrides"
    assert "model.rope_theta=1000000.0 replaces config.json's 50000.0 (model.hf_overrides)" in (
        composed.notes)
    on_ranks(_train, 1, cfg, str(tmp_path / "run"))
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_theta"] == 1e6
    config_yaml = (tmp_path / "run" / "config.yaml").read_text()
    assert "rope_theta: 1000000.0" in config_yaml and "- rope_theta" in config_yaml
    with pytest.raises(ConfigError, match="model.hf_overrides lists n_layers"):
        resolved(*RUN, f"model.init_from={hf_dirs['gqa_untied']}", "model.hf_overrides=[n_layers]")
    with pytest.raises(ConfigError, match="model.hf_overrides is set but model.init_from is not"):
        resolved(*RUN, "model.hf_overrides=[rope_theta]")


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": True}, "attention_bias=true"), ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "the MLP activation 'gelu'"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type='dynamic'"),
    ({"model_type": "gemma2"}, "model_type='gemma2'"),
])
def test_what_lctrain_cannot_compute_is_refused_by_name(tmp_path, change, message):
    save_hf(tmp_path, "gqa_untied")
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolved(*RUN, f"model.init_from={tmp_path}")


def _first_global_batch(cfg) -> torch.Tensor:
    source = build_source(cfg)
    return torch.stack([torch.from_numpy(source.window(i).read(0, cfg.train.seq_len + 1))
                        for i in range(cfg.train.global_batch)])


@pytest.mark.parametrize("family", ["mqa"])  # 3-4 s on 2 cores; GQA, llama3 RoPE and tied
# embeddings on every layout, from config.json of every family: tests/test_model_families.py
def test_init_from_trains_from_transformers_loss_on_every_layout(hf_dirs, tmp_path, family):
    hf = save_hf(tmp_path / "again", family)  # the same weights (same seed) as hf_dirs[family]
    layouts = {"cp2_dp2": ["parallel.cp=2", "parallel.dp=2", "train.micro_batch=1"],
               "tp2_sp_cp2": ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2",
                              "parallel.sp=true", "train.micro_batch=4"]}
    cfgs, wants = {}, {}
    for name, layout in layouts.items():
        composed = resolved(*RUN, f"model.init_from={hf_dirs[family]}", *layout)
        cfg = composed.cfg
        if family == "mqa" and name.startswith("tp2"):  # one KV head cannot split over tp=2
            assert any("model.n_kv_heads=1 is not divisible by parallel.tp=2" in p
                       for p in preflight(cfg, 4))
            continue
        assert preflight(cfg, 4) == []
        tokens = _first_global_batch(cfg)
        with torch.no_grad():
            logits = hf(input_ids=tokens[:, :-1]).logits
        cfgs[name] = cfg
        wants[name] = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    for per_layout in on_ranks(train_each, 4, cfgs, str(tmp_path), timeout_s=300):
        for name, history in per_layout.items():
            assert history[0]["loss"] == pytest.approx(wants[name], rel=1e-4), (family, name)


def test_shards_of_another_tokenizer_are_refused_naming_both(hf_dirs, tmp_path):
    from lctrain.data.preprocess import preprocess
    from tests.test_preprocess import SENTENCES, train_tokenizer, write_jsonl

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_hf(model_dir, dataclasses.replace(FAMILIES["gqa_untied"], vocab_size=192))
    train_tokenizer(["<s>", "</s>"]).save(str(model_dir / "tokenizer.json"))
    other = tmp_path / "other.json"
    train_tokenizer(["</s>", "<s>"]).save(str(other))  # the specials swap ids
    write_jsonl(tmp_path / "corpus.jsonl", SENTENCES * 3)
    for name, tokenizer in (("same", None), ("other", str(other))):
        composed = resolved(f"model.init_from={model_dir}", f"data.path={tmp_path / 'corpus.jsonl'}",
                            f"preprocess.output={tmp_path / name}", "preprocess.workers=1",
                            *([f"data.tokenizer={tokenizer}"] if tokenizer else []))
        if tokenizer is None:  # preprocess defaults to the model's tokenizer
            assert composed.cfg.data.tokenizer == str(model_dir)
        preprocess(composed.cfg, progress=False)
    for name in ("same", "other"):
        cfg = resolved(*RUN, f"model.init_from={model_dir}", "data.source=tokens",
                       f"data.path={tmp_path / name}", "train.seq_len=8").cfg
        problems = preflight(cfg, 4)
        if name == "same":
            assert problems == []
        else:
            (problem,) = problems
            assert f"data.path={tmp_path / name} was tokenized with '{other}'" in problem
            assert f"model.init_from={model_dir}'s tokenizer" in problem
            assert f"data.tokenizer={model_dir}" in problem


def _token_dataset(path, n_docs=60, vocab=128, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 40, n_docs)
    writer = ShardWriter(path, "uint16", 500)
    writer.add(rng.integers(1, vocab, int(lengths.sum())).astype(np.uint16), lengths)
    writer.commit({"vocab_size": vocab})
    return TokenStore(path)


def test_validation_documents_never_appear_in_a_training_batch(tmp_path):
    store = _token_dataset(tmp_path / "data")
    cfg = compose(["+recipe=tiny", "data.source=tokens", f"data.path={tmp_path / 'data'}",
                   "data.val_fraction=0.2", "train.seq_len=32", "model.vocab_size=128"]).cfg
    train_docs, val_docs = held_out(store, 0.2, cfg.train.seed)
    assert len(val_docs) and set(train_docs) | set(val_docs) == set(range(store.num_documents))
    train, val = build_source(cfg), build_val_source(cfg)
    seen = set()
    for i in range(train.samples_per_epoch):  # a whole epoch of training samples
        seen |= set(train.pieces(i)[0].tolist())
    assert seen == set(train_docs.tolist())  # every training document, no validation one
    held = set()
    for i in range(val.samples_per_epoch):
        held |= set(val.pieces(i)[0].tolist())
    assert held == set(val_docs.tolist())
    again = compose(["+recipe=tiny", "data.source=tokens", f"data.path={tmp_path / 'data'}",
                     "data.val_fraction=0.2", "train.seq_len=32",
                     f"train.seed={cfg.train.seed + 1}"]).cfg
    assert set(held_out(store, 0.2, again.train.seed)[1]) != set(val_docs)  # seeded


@pytest.mark.slow  # 5 s on 2 cores: 4 layouts of 1 and 4 ranks
def test_validation_loss_at_any_layout_equals_the_reference(tmp_path):
    """val_loss, and the loss by position band (eval.position_band=8: [0, 8), [8, 16),
    [16, 32)), equal the one-process reference's token losses on every layout; the bands,
    token-weighted, recombine to val_loss."""
    _token_dataset(tmp_path / "data")
    base = ["+recipe=tiny", "data.source=tokens", f"data.path={tmp_path / 'data'}",
            "data.val_fraction=0.25", "train.seq_len=32", "model.vocab_size=128",
            "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96",
            "model.n_layers=2", "train.steps=1", "train.global_batch=4", "eval.every=1",
            "eval.tasks=[]", "eval.val_sequences=4", "optim.lr=1e-20", "optim.min_lr=0",
            "logging.progress=false", "data.document_masking=false", "eval.position_band=8"]
    cfg = compose(base + ["parallel.cp=1", "parallel.dp=1", "train.micro_batch=4"]).cfg
    val = build_val_source(cfg)  # the reference: the untrained model on the same sequences
    tokens = torch.stack([torch.from_numpy(val.window(i).read(0, 33)) for i in range(4)])
    with torch.no_grad():
        logits = reference_model(cfg)(tokens[:, :-1])
    token_losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    want = token_losses.mean().item()
    bands = {"val_loss/pos0-8": (0, 8), "val_loss/pos8-16": (8, 16), "val_loss/pos16-32": (16, 32)}
    want_bands = {key: token_losses[:, lo:hi].mean().item() for key, (lo, hi) in bands.items()}
    layouts = [(1, ["parallel.cp=1", "parallel.dp=1", "train.micro_batch=4"]),
               (4, ["parallel.cp=2", "parallel.dp=2", "train.micro_batch=2"]),
               (4, ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2", "parallel.sp=true",
                    "train.micro_batch=4"]),
               (4, ["parallel.cp=1", "parallel.pp=2", "parallel.dp=2", "train.micro_batch=1"])]
    runs = {}
    for i, (world, layout) in enumerate(layouts):
        cfg = compose(base + layout).cfg
        assert preflight(cfg, world) == []
        runs[str(i)] = (world, cfg)
    histories = train_on_ranks(runs, str(tmp_path / "runs"))  # one spawn per world size
    for i, (_, layout) in enumerate(layouts):
        for history in histories[str(i)]:
            last = history[-1]
            assert last["val_loss"] == pytest.approx(want, rel=1e-5), layout
            assert last["val_ppl"] == pytest.approx(np.exp(want), rel=1e-5)
            for key, value in want_bands.items():
                assert last[key] == pytest.approx(value, rel=1e-5), (layout, key)
            weights = {key: hi - lo for key, (lo, hi) in bands.items()}  # tokens per band
            recombined = sum(last[k] * w for k, w in weights.items()) / sum(weights.values())
            assert recombined == pytest.approx(last["val_loss"], rel=1e-6), layout
