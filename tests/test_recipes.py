"""Every recipe validates for the world it targets and its planned peak memory fits that world's
GPU, as its header says; the production recipes train only from a Hugging Face checkpoint and a
preprocessed corpus, and refuse to start (exit 2, naming the keys) when those are not given.

No process and no weight: `lctrain plan` is arithmetic, so the Hugging Face directories are a
config.json (Meta's Llama 3 values) beside an empty *.safetensors file, and the corpus is token
shards just longer than one sequence.
"""

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
from omegaconf import OmegaConf

from lctrain.commands.plan import plan_world_size
from lctrain.config.compose import compose
from lctrain.config.paths import recipe_names, recipes_dir
from lctrain.data.shards import ShardWriter
from lctrain.planning.estimate import build_plan
from lctrain.planning.hardware import hardware_from_plan
from lctrain.planning.timing import step_time_summary
from lctrain.prepare.checks import preflight
from lctrain.prepare.init_from import resolve_model
from tests.helpers import run_cli

H100_GIB = 79.6  # what an H100 80 GB reports (81,559 MiB)


@dataclass(frozen=True)
class Target:
    world: int
    """Ranks: slurm.nodes x slurm.gpus_per_node (what `lctrain submit` asks for), or the local
    processes of a CPU recipe."""
    gpu_gib: float | None
    """Memory of the target GPU; None for a CPU recipe."""


TARGETS = {
    "tiny": Target(4, None),
    "debug-gpu": Target(1, H100_GIB),
    "llama-256k": Target(256, H100_GIB),
    "llama3-8b-128k": Target(64, H100_GIB),
    "llama3-70b-1m": Target(256, H100_GIB),
    # (planned, not traced: its linear layers' chunked scan is ~20M ops on fake tensors at 256K)
    "qwen3.5-256k": Target(32, None),
}
PRODUCTION = ("llama-256k", "llama3-8b-128k", "llama3-70b-1m")
REQUIRED = {"model.init_from", "data.path", "data.tokenizer"}

_LLAMA3 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
           "eos_token_id": 128001, "torch_dtype": "bfloat16"}
HF_CONFIGS = {  # model preset -> Meta's config.json
    "llama3-8b": _LLAMA3 | {"hidden_size": 4096, "intermediate_size": 14336,
                            "num_hidden_layers": 32, "num_attention_heads": 32},
    "llama3-70b": _LLAMA3 | {"hidden_size": 8192, "intermediate_size": 28672,
                             "num_hidden_layers": 80, "num_attention_heads": 64},
    # Qwen3.5-9B as released: multimodal, the language model's config nested in text_config
    "qwen3.5-9b": {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": False, "vision_config": {"depth": 27, "hidden_size": 1152},
        "text_config": {
            "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 256, "intermediate_size": 12288, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attn_output_gate": True,
            "mtp_num_hidden_layers": 1,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                            for i in range(32)],
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                "rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25}}},
}


def required_keys(recipe: str) -> set[str]:
    """The keys recipes/NAME.yaml leaves to the command line (Hydra's mandatory value ???)."""
    return set(OmegaConf.missing_keys(OmegaConf.load(recipes_dir() / f"{recipe}.yaml")))


def preset(recipe: str) -> str:
    """The model preset recipes/NAME.yaml selects (`override /model: NAME`)."""
    defaults = OmegaConf.load(recipes_dir() / f"{recipe}.yaml").defaults
    return next(d["override /model"] for d in defaults if "override /model" in d)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Overrides that give each production recipe's required keys: a Hugging Face directory
    of the recipe's model and a token corpus holding one 1M-token sequence."""
    root = tmp_path_factory.mktemp("recipe-inputs")
    for name, config in HF_CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        (root / name / "model.safetensors").write_bytes(b"")  # plan and preflight never read it
    lengths = np.array([2**19, 2**19, 4096])
    writer = ShardWriter(root / "tokens", "uint32", 2**20)
    writer.add(np.random.default_rng(0).integers(1, 128256, int(lengths.sum()), dtype=np.uint32),
               lengths)
    writer.commit({"vocab_size": 128256})

    def overrides(recipe: str) -> list[str]:
        if not required_keys(recipe):
            return []
        model = root / preset(recipe)
        return [f"model.init_from={model}", f"data.path={root / 'tokens'}",
                f"data.tokenizer={model}"]

    return overrides


def header_gib(recipe: str) -> float:
    """The planned memory per GPU that recipes/NAME.yaml's header quotes."""
    text = (recipes_dir() / f"{recipe}.yaml").read_text()
    found = re.search(r"prints\s+(?:#\s+)?total ([\d.]+) GiB", text)
    assert found, f"recipes/{recipe}.yaml: the header should quote lctrain plan's total"
    return float(found.group(1))


def header_traced_gib(recipe: str) -> float | None:
    """The traced peak (`lctrain plan --trace`) recipes/NAME.yaml's header quotes, if any."""
    found = re.search(r"traced ([\d.]+) GiB", (recipes_dir() / f"{recipe}.yaml").read_text())
    return float(found.group(1)) if found else None


def test_every_recipe_has_a_target():
    assert set(recipe_names()) == set(TARGETS)


@pytest.mark.parametrize("recipe", sorted(TARGETS))
def test_recipe_validates_for_its_world_and_fits_its_gpu(recipe, inputs):
    composed = resolve_model(compose([f"+recipe={recipe}", *inputs(recipe)]))
    cfg, target = composed.cfg, TARGETS[recipe]
    world = plan_world_size(cfg)
    assert world == target.world
    if target.gpu_gib is not None:  # `lctrain submit` asks Slurm for the world plan checks
        assert cfg.slurm.nodes * cfg.slurm.gpus_per_node == world
        assert cfg.train.device in ("cuda", "auto") and cfg.train.dtype == "bf16"
    assert preflight(cfg, world) == []
    plan = build_plan(cfg, world)
    peak = plan["memory_gib"]["total"]
    assert peak == pytest.approx(header_gib(recipe), abs=5e-4), "update the recipe's header"
    quoted = re.search(r"\(([\d.]+) GiB modelled", (recipes_dir() / f"{recipe}.yaml").read_text())
    assert quoted and float(quoted.group(1)) == pytest.approx(
        plan["memory_gib"]["modelled"], abs=5e-4), "update the recipe's header"
    if target.gpu_gib is not None:
        assert peak <= target.gpu_gib and plan["memory_per_rank"]["verdict"] == "FITS"
        # the header quotes the traced peak (docs/parallelism.md §29, a run of minutes here),
        # within 5% of the plan's modelled bytes
        traced = header_traced_gib(recipe)
        assert traced is not None, "quote `lctrain plan --trace`'s peak in the header"
        modelled = plan["memory_per_rank"]["bytes"]["modelled"] / 2**30
        assert abs(traced / modelled - 1) <= 0.05, (traced, modelled)
        # the header quotes the plan's predicted step (plan.*: H100 numbers)
        t = step_time_summary(cfg, world, hardware_from_plan(cfg))
        header = (recipes_dir() / f"{recipe}.yaml").read_text()
        assert f"predicts {t['total_s']:.3f} s per step, {t['tokens_per_s_per_rank']:,.0f} " \
               "tokens/s per GPU" in header, "update the recipe's header"
    # tp x cp_ulysses stays inside a node (NVLink): no note says a group spans nodes
    assert not [n for n in plan["notes"] if "span nodes" in n]


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_production_recipes_need_a_checkpoint_and_a_corpus(recipe, inputs):
    assert required_keys(recipe) == REQUIRED
    composed = resolve_model(compose([f"+recipe={recipe}", *inputs(recipe)]))
    cfg = composed.cfg
    assert cfg.data.source == "tokens"  # never synthetic data by default
    assert cfg.model.init_from is not None
    # the context extension survives config.json (whose rope_theta is 500000, positions 8192)
    assert cfg.model.rope_theta > 500000.0
    assert cfg.model.max_position_embeddings == cfg.train.seq_len
    assert composed.origins["rope_theta"] == "hf_overrides"


@pytest.mark.parametrize("recipe", ["tiny", "debug-gpu"])
def test_demo_recipes_need_nothing(recipe):
    assert required_keys(recipe) == set()
    assert compose([f"+recipe={recipe}"]).cfg.data.source in ("synthetic", "passkey")


def _refusal(command: str, recipe: str, capsys) -> str:
    code, _, err = run_cli([command, f"+recipe={recipe}"], capsys)
    assert code == 2
    return err


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("recipe", PRODUCTION)
def test_without_a_checkpoint_a_production_recipe_exits_2(recipe, command, capsys):
    assert "model.init_from" in _refusal(command, recipe, capsys)


@pytest.mark.parametrize("recipe", PRODUCTION)
def test_every_omitted_required_key_is_named(recipe, capsys):
    err = _refusal("plan", recipe, capsys)
    assert all(key in err for key in REQUIRED), err
    # and the command that plans the recipe without them, which plans it
    command = err.split(f"to plan or trace +recipe={recipe} without them: lctrain ")[1]
    code, out, _ = run_cli(command.split("\n")[0].split(), capsys)
    assert code == 0 and "memory per rank" in out
