"""The CUDA path's defects, each checked on the CPU where it shows there: validation of what
flash-attn and forked ranks cannot do, ranks spawned (not forked) once CUDA is in play, a clear
error without flash-attn, collectives that get tensors on their group's device, the long-standing
collective names, selective checkpointing of the CUDA attention ops, deterministic kernels, host
document ids, and a process group that is always destroyed."""

import pytest
import torch
import torch.distributed as dist

from lctrain.attention import ContextParallelAttention, cuda_kernels, delta_rule, kernels
from lctrain.attention.kernels import KernelOptions
from lctrain.comm import all_gather, check_collective_devices
from lctrain.commands import train as train_command
from lctrain.config.validation import validate
from lctrain.data.batch import MicroBatch, micro_batch_from_tokens
from lctrain.parallel import launch
from lctrain.parallel.checkpointing import saved_ops
from lctrain.parallel.parallelize import build_attention_core
from lctrain.parallel.runtime import setup_distributed
from lctrain.tracing.measure import build_measured_model
from lctrain.training import loop
from tests.helpers import exit_code, on_ranks, run_cli, tiny_config

CLI = ["+recipe=tiny", "model.vocab_size=128", "model.dim=64", "model.n_layers=2",
       "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=96", "train.seq_len=32",
       "train.global_batch=4", "train.micro_batch=1", "train.steps=1", "optim.warmup_steps=1",
       "data.doc_len_min=8", "data.doc_len_max=24", "eval.every=0"]


@pytest.mark.parametrize("sections,expected", [
    ({"data": {"document_masking": True}}, ["train.dtype=fp32 on CUDA", "train.dtype=bf16"]),
    ({"parallel": {"cp": 2}, "train": {"dtype": "bf16"}, "model": {"dim": 48}},
     ["head dim model.dim / model.n_heads = 12 on CUDA", "try model.dim=64"]),
    ({"launch": {"start_method": "fork"}}, ["launch.start_method=fork with CUDA"]),
    # at cp=1 without documents, windows and sinks still run lctrain's (flash) kernels
    ({"model": {"family": "mistral", "sliding_window": 16}},
     ["train.dtype=fp32 on CUDA", "sliding windows", "train.dtype=bf16"]),
    ({"model": {"family": "gpt_oss", "n_experts": 4, "experts_per_token": 2,
                "expert_ffn_dim": 32}},
     ["train.dtype=fp32 on CUDA", "attention sinks", "train.dtype=bf16"]),
])
def test_validation_names_what_cuda_cannot_run(sections, expected):
    cfg = tiny_config(**sections)
    cfg.train.device = "cuda"
    (problem,) = validate(cfg, cfg.parallel.cp)
    assert all(text in problem for text in expected), problem
    cfg.train.device = "cpu"  # the CPU kernels take all of it
    assert validate(cfg, cfg.parallel.cp) == []


def test_a_window_as_long_as_the_sequence_keeps_sdpa_in_fp32():
    """A window covering train.seq_len (and every stage's length) is full causal attention:
    torch's SDPA runs it, which takes fp32 on CUDA."""
    cfg = tiny_config(model={"family": "mistral", "sliding_window": 32})
    cfg.train.device = "cuda"
    assert validate(cfg, 1) == []


def test_ranks_are_spawned_once_cuda_is_in_play(monkeypatch, tmp_path):
    started = {}

    def record(fn, nproc, args, **kwargs):
        started.update(kwargs, nproc=nproc)

    monkeypatch.setattr(launch, "cuda_devices", lambda: 4)
    monkeypatch.setattr(launch, "run_ranks", record)
    code = exit_code(["train", *CLI, "parallel.cp=1", "parallel.dp=2",
                      "data.document_masking=false", "train.dtype=bf16",
                      f"hydra.run.dir={tmp_path}"])
    assert code == 0 and started["start_method"] == "spawn" and started["nproc"] == 2
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # a parent that used CUDA
    with pytest.raises(RuntimeError, match="ranks forked from it cannot use CUDA"):
        on_ranks(_nothing, 2)


def _nothing():
    return None


@pytest.mark.parametrize("layout", [
    ["parallel.cp=2", "parallel.attention=ring"], ["parallel.cp=2", "parallel.attention=ulysses"],
    ["parallel.cp=2", "parallel.attention=allgather"],
    ["parallel.cp=4", "parallel.attention=usp", "parallel.ulysses_degree=2"],
    ["parallel.cp=1", "train.deterministic=true"]])
def test_cuda_layouts_validate_without_flash_attn(monkeypatch, tmp_path, layout):
    """A stock CUDA torch (no flash-attn): every cp layout, packed documents and deterministic
    attention validate and start, on torch's built-in flash kernels (train.attention_kernel=auto)."""
    started = {}
    monkeypatch.setattr(launch, "cuda_devices", lambda: 4)
    monkeypatch.setattr(cuda_kernels, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(launch, "run_ranks", lambda fn, nproc, args, **kw: started.update(
        nproc=nproc, cfg=args[0]))
    monkeypatch.setattr(loop, "train", lambda cfg, run_dir: started.update(nproc=1, cfg=cfg))
    code = exit_code(["train", *CLI, *layout, "parallel.dp=1", "data.document_masking=true",
                      "train.dtype=bf16", "train.device=cuda", f"hydra.run.dir={tmp_path}"])
    assert code == 0 and started["nproc"] == started["cfg"].parallel.cp
    assert KernelOptions(started["cfg"].train.attention_kernel).backend_for(
        torch.device("cuda")) == "torch"


def test_debug_gpu_recipe_validates_without_flash_attn(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 1)
    monkeypatch.setattr(cuda_kernels, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(loop, "train", lambda cfg, run_dir: [])
    assert exit_code(["train", "+recipe=debug-gpu", f"hydra.run.dir={tmp_path}"]) == 0


def test_kernel_names_are_checked_against_the_device(monkeypatch, capsys):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 2)
    monkeypatch.setattr(cuda_kernels, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(launch, "run_ranks", None)
    # flash-attn named but absent: the install, exit 2
    code, _, err = run_cli(["train", *CLI, "parallel.cp=2", "parallel.dp=1", "train.dtype=bf16",
                            "train.attention_kernel=flash_attn"], capsys)
    assert code == 2 and "flash-attn is not installed" in err
    assert "--no-build-isolation" in err and "train.attention_kernel=torch" in err
    # flash-linear-attention named but absent: the install, exit 2; named on the CPU: refused
    monkeypatch.setitem(delta_rule.DELTA_RULES, "fla",
                        delta_rule.RuleCode(delta_rule.DELTA_RULES["fla"].rule, lambda: False))
    code, _, err = run_cli(["train", *CLI, "parallel.cp=2", "parallel.dp=1", "train.dtype=bf16",
                            "train.linear_kernel=fla"], capsys)
    assert code == 2 and "flash-linear-attention is not installed" in err
    assert "train.linear_kernel=torch" in err
    cfg = tiny_config(train={"linear_kernel": "fla", "device": "cpu"})
    (problem,) = validate(cfg, cfg.parallel.cp)
    assert "train.linear_kernel=fla runs on CUDA only" in problem
    cfg = tiny_config(train={"attention_kernel": "torch", "device": "cpu"})
    (problem,) = validate(cfg, cfg.parallel.cp)
    assert "train.attention_kernel=torch runs on CUDA only" in problem
    cfg = tiny_config(train={"attention_kernel": "reference", "device": "cuda", "dtype": "bf16"})
    (problem,) = validate(cfg, cfg.parallel.cp)
    assert "train.attention_kernel=reference runs on the CPU only" in problem


def _train_and_evaluate_under_the_device_check(cfg, run_dir):
    with check_collective_devices():
        history = loop.train(cfg, run_dir)
    with check_collective_devices(), pytest.raises(RuntimeError, match="got a tensor on meta"):
        dist.all_reduce(torch.ones(2, device="meta"))
    return history[-1]["loss"]


def test_collectives_get_tensors_on_their_groups_device(tmp_path):
    cfg = tiny_config(parallel={"cp": 2, "dp": 1, "tp": 2, "sp": True},
                      train={"steps": 1, "global_batch": 2, "micro_batch": 2},
                      eval={"every": 1, "lengths": [32], "depths": [0.5], "samples": 1},
                      checkpoint={"every": 1})
    losses = on_ranks(_train_and_evaluate_under_the_device_check, 4, cfg, str(tmp_path))
    assert len(set(losses)) == 1


def _allgather_without_newer_names():
    # torch < 2.7 has no all_gather_single / reduce_scatter_single: lctrain must not need them
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):
            delattr(dist, name)
    x = torch.full((1, 2), float(dist.get_rank()))
    y = all_gather(x, dist.group.WORLD, dim=1)
    return y.tolist()


def test_collectives_use_long_standing_names():
    assert on_ranks(_allgather_without_newer_names, 2)[0] == [[0.0, 0.0, 1.0, 1.0]]


def test_selective_checkpointing_keeps_the_cuda_attention_ops():
    kept = saved_ops("selective", cp=1)
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_flash_attention_for_cpu"):
        assert getattr(torch.ops.aten, op).default in kept, op
    torch_ops = kernels.forward_ops("torch")  # what the torch backend's forward calls
    assert torch_ops == {torch.ops.aten._flash_attention_forward.default}
    assert torch_ops <= saved_ops("selective", 1, torch_ops)
    assert not torch_ops & saved_ops("selective", 2, torch_ops)  # cp > 1: core recomputed


def test_deterministic_reaches_the_kernels_and_documents_stay_on_the_host():
    cfg = tiny_config(train={"deterministic": True}, data={"document_masking": True})
    core = build_attention_core(cfg, setup_distributed(cfg))
    assert isinstance(core, ContextParallelAttention) and core.options.deterministic
    tokens = torch.randint(1, 128, (1, 33))
    mb = micro_batch_from_tokens(tokens, 32, lengths=[torch.tensor([20, 13]).numpy()],
                                 document_masking=True)
    assert mb.to(torch.device("cpu")).doc_ids is mb.doc_ids


def test_each_rank_destroys_its_process_group(monkeypatch, tmp_path):
    def fake_train(cfg, run_dir):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)

    monkeypatch.setattr(loop, "train", fake_train)
    train_command._rank_main(tiny_config(), str(tmp_path))
    assert not dist.is_initialized()


def test_measured_model_moves_its_batch_to_the_runtime_device(monkeypatch):
    """The memory measurement (selective_memory, offload_and_tiling on a GPU) feeds the model a
    batch on the runtime's device, as the loop does; document ids stay on the host."""
    moved = []
    to = MicroBatch.to

    def recording(self, device):
        moved.append(device)
        return to(self, device)

    monkeypatch.setattr(MicroBatch, "to", recording)
    cfg = tiny_config(data={"document_masking": True})
    _, run_forward = build_measured_model(cfg, batch=1)
    assert moved == [setup_distributed(cfg).device]
    assert torch.isfinite(run_forward())
