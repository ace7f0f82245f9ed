"""Every file under conf/ composes against the schema; plan and submit render from the recipes
(tests/test_recipes.py validates each recipe for its target world)."""

import json
import re
from pathlib import Path

import pytest

from lctrain.commands.plan import plan_world_size
from lctrain.commands.submit import render_sbatch
from lctrain.config.compose import compose
from lctrain.config.derived import local_world_size
from lctrain.config.paths import conf_dir, recipe_names, recipes_dir
from lctrain.planning.estimate import build_plan
from lctrain.prepare.checks import preflight
from lctrain.training.loop import run_lines
from tests.helpers import run_cli

MODELS = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
# A production recipe's layout on its preset model: the keys it requires (model.init_from,
# data.path, data.tokenizer) given as null, synthetic data (tests/test_recipes.py gives real ones)
LAYOUT_ONLY = ["model.init_from=null", "model.hf_overrides=[]", "data.source=synthetic",
               "data.path=null", "data.tokenizer=null"]


def test_expected_presets_and_recipes_exist():
    assert {"tiny", "llama3-8b", "llama3-70b"} <= set(MODELS)
    assert {"tiny", "debug-gpu", "llama-256k", "llama3-8b-128k", "llama3-70b-1m"} <= set(
        recipe_names())


def test_the_readmes_preset_lists_are_conf_model():
    """Each list of presets in the README names every file of conf/model/ (those of released
    shapes: all but tiny), no more."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lists = re.findall(r"presets(?: of released shapes)? are in `conf/model/` \(([^)]*)\)",
                       readme)
    assert len(lists) == 2, lists
    named = [sorted(re.findall(r"`([^`]+)`", text)) for text in lists]
    assert named == [MODELS, [m for m in MODELS if m != "tiny"]]


@pytest.mark.parametrize("model", MODELS)
def test_model_presets_compose(model):
    cfg = compose([f"model={model}"]).cfg
    assert cfg.model.name == model
    # a derived head dim (head_dim null) divides the model evenly (Qwen3.5-27B sets 256 on 24
    # heads of a 5120 model)
    assert cfg.model.head_dim is not None or cfg.model.dim % cfg.model.n_heads == 0


def test_llama3_8b_has_the_real_shape():
    from lctrain.config.model_size import param_count

    cfg = compose(["model=llama3-8b"]).cfg
    assert round(param_count(cfg.model) / 1e9, 2) == 8.03  # Meta-Llama-3-8B: 8.03B
    cfg = compose(["model=llama3-70b"]).cfg
    assert round(param_count(cfg.model) / 1e9, 1) == 70.6  # Meta-Llama-3-70B: 70.6B


def test_tiny_recipe_runs_here_and_accepts_layout_overrides():
    cfg = compose(["+recipe=tiny"]).cfg
    assert local_world_size(cfg) >= 4
    assert preflight(cfg, local_world_size(cfg)) == []
    cfg = compose(["+recipe=tiny", "parallel.dp=2", "train.global_batch=8"]).cfg
    assert preflight(cfg, local_world_size(cfg)) == []


def test_llama_256k_plan(capsys):
    cfg = compose(["+recipe=llama-256k", *LAYOUT_ONLY]).cfg
    assert cfg.model.name == "llama3-8b" and cfg.train.seq_len == 262144
    plan = build_plan(cfg, plan_world_size(cfg))
    assert plan["world_size"] == 256
    assert plan["layout"] == {"pp": 1, "dp": 4, "cp_ring": 8, "cp_ulysses": 2, "tp": 4,
                              "cp": 16, "sp": True}
    assert plan["shapes"]["qkv_local [B, S/cp, H/tp, d]"] == [1, 16384, 8, 128]
    assert len(plan["ranks"]) == 256 and plan["ranks"][9]["node"] == 1
    assert plan["notes"] == []  # tp x cp_ulysses = 8 fits a node
    code, out, _ = run_cli(["plan", "+recipe=llama-256k", *LAYOUT_ONLY, "--json"], capsys)
    assert code == 0
    assert json.loads(out)["grad_accum"] == 4
    _, text, _ = run_cli(["plan", "+recipe=llama-256k", *LAYOUT_ONLY], capsys)
    assert "pp=1 x dp=4 x cp_ring=8 x cp_ulysses=2 x tp=4" in text and "more (plan.max" in text


def test_plan_world_comes_from_the_layout_when_every_size_is_fixed(capsys):
    def plan(*overrides):
        code, out, _ = run_cli(["plan", "+recipe=tiny", *overrides], capsys)
        assert code == 0
        return out

    # GPU nodes (here, without a GPU, the note would be the CPU run's): cp2 x dp2 = 4 ranks,
    # whatever slurm.* says
    out = plan("train.device=cuda", "train.dtype=bf16")
    assert "world size 4:" in out and "planned for the layout's 4 ranks" in out
    out = plan("parallel.dp=-1", "slurm.nodes=2", "slurm.gpus_per_node=4")  # the allocation
    assert "world size 8:" in out and "planned for the layout" not in out


def test_plan_traffic_matches_digest_formulas():
    # docs/parallelism.md §5-6, per rank per attention forward; L tokens, P ranks, d model width
    cfg = compose(["model=llama3-8b", "parallel.cp=8", "parallel.attention=ulysses",
                   "train.seq_len=65536", "launch.nproc=8"]).cfg
    L, P, d, d_kv = 65536, 8, 4096, 8 * 128
    t = build_plan(cfg, 8)["traffic_elements_per_rank"]
    assert t["ulysses_per_layer_fwd"] == (2 * d + 2 * d_kv) * L * (P - 1) / P**2
    cfg.parallel.attention = "ring"
    t = build_plan(cfg, 8)["traffic_elements_per_rank"]
    assert t["ring_per_layer_fwd"] == (P - 1) * 2 * L * d_kv / P


def test_sbatch_renders_torchrun_rendezvous(tmp_path):
    composed = compose(["+recipe=llama-256k", "train.steps=10", *LAYOUT_ONLY,
                        f"hydra.run.dir={tmp_path / 'r'}"])
    script = render_sbatch(composed.cfg, composed.overrides, composed.run_dir)
    assert "#SBATCH --nodes=32" in script and "--nproc-per-node=8" in script
    assert "--rdzv-backend=c10d" in script and "srun --kill-on-bad-exit=1" in script
    assert "#SBATCH --signal=B:USR1@300" in script
    assert f"> {composed.run_dir.resolve() / 'STOP'}' USR1" in script
    assert f"hydra.run.dir='\"'\"'{(tmp_path / 'r').resolve()}'\"'\"'" in script
    assert script.count("hydra.run.dir=") == 1 and "+recipe=llama-256k train.steps=10" in script


def test_conf_and_recipes_found_from_repository():
    assert (conf_dir() / "config.yaml").is_file()
    assert (recipes_dir() / "tiny.yaml").is_file()
    assert Path(conf_dir()).name == "conf"


@pytest.mark.parametrize("recipe", recipe_names())
def test_config_yaml_is_what_omegaconf_writes_and_reads_back(recipe):
    """config.yaml is written without OmegaConf (training needs no CLI stack): byte for byte what
    OmegaConf writes for every recipe, and awkward strings read back as themselves."""
    from omegaconf import OmegaConf

    from lctrain.config.resolved import as_dict, to_yaml

    cfg = compose([f"+recipe={recipe}", *LAYOUT_ONLY]).cfg
    assert to_yaml(cfg) == OmegaConf.to_yaml(OmegaConf.structured(cfg))
    awkward = ["", " a", "true", "y", "null", "~", "1", "1e5", "-1", ".5", ".inf", "nan", "1f1b",
               "00:30:00", "24:00:00", "2024-01-01", "0x1F", "a: b", "a #b", "#x", "- x", "-x",
               "---", "it's", "'q'", '"d"', "a\nb", "a\tb", "\x00", "日本", "*a", "? x", "a:",
               "\u2028", "\ufeff", "C:\\path", "hf://org/name", "<<", "="]
    cfg.slurm.env = {f"k{i}": s for i, s in enumerate(awkward)} | {"": "empty key", "yes": "x"}
    cfg.deepspeed.config = {"a": [[1, 2], {"b": [*awkward, None, 1e-5, 1e17, float("inf")]}],
                            "e": {}, "l": []}
    assert OmegaConf.to_container(OmegaConf.create(to_yaml(cfg))) == as_dict(cfg)


def test_the_start_lines_name_family_attention_balance_and_the_aux_loss():
    """A run's start says what runs: the family, the CP algorithm and load balance (auto
    resolved), the engine; for experts, whether their load-balancing loss joins the loss."""
    (line,) = run_lines(compose(["+recipe=tiny"]).cfg)
    assert line == ("model tiny (family llama), ring attention over cp=2, load balance "
                    "documents, fsdp over dp x cp, fp32")
    moe = compose(["+recipe=tiny", "model=qwen3-30b-a3b", "parallel.ep=2"]).cfg
    assert "128 experts, 8 per token, ep=2; the load-balancing loss is added at " \
        "model.router_aux_loss_coef=0.001" in run_lines(moe)[1]
    off = compose(["+recipe=tiny", "model=qwen3-30b-a3b", "model.router_aux_loss_coef=0"]).cfg
    assert "no load-balancing loss" in run_lines(off)[1]
