"""`lctrain plan` beside published long-context training figures (docs/parallelism.md §19):
the same model, sequence, GPUs and layout planned with lctrain's defaults for an H100 (or the
published card's memory), the published number and lctrain's prediction side by side.

    python bench/plan_published.py          # arithmetic only: a few seconds, no device

Sources (numbers as published; the conditions that differ from lctrain's are in §19):
  torchtitan  benchmarks/llama3_h100_202412_torchtitan.md, Table 2: Llama 3.1 8B, 8 H100
              (96 GB HBM2e, 500 W), FSDP + CP, full activation checkpointing, local batch 1,
              torch.compile + Float8 linears.
  NeMo        docs/source/performance/performance_long_sequence.md: Llama 2 7B, FP8,
              DGX-H100, a step of 4M tokens, model TFLOP/s per GPU with CP.
  ALST        Arctic Long Sequence Training (arXiv 2506.13996): the longest sequence Llama 3.1
              8B trains at on 1, 8 and 32 H100 80 GB (Ulysses over every GPU, ZeRO-3 with the
              optimizer state on the host, parameters too on 1 GPU, tiled MLP and loss,
              checkpoints offloaded to the host).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.config import LctrainConfig, derive  # noqa: E402
from lctrain.config.compose import compose  # noqa: E402
from lctrain.config.validation import layout_problems  # noqa: E402
from lctrain.planning.estimate import rank_memory  # noqa: E402
from lctrain.planning.flops import train_flops_per_step  # noqa: E402
from lctrain.planning.hardware import hardware_from_plan  # noqa: E402
from lctrain.planning.search import memory_gib  # noqa: E402
from lctrain.planning.timing import StepTime, predict_step_time  # noqa: E402

GPU = ["train.device=cuda", "train.dtype=bf16", "train.micro_batch=1", "data.source=synthetic"]
LLAMA2_7B = ["model.vocab_size=32000", "model.n_kv_heads=32", "model.ffn_dim=11008",
             "model.name=llama2-7b"]  # the rest of Llama 2 7B's shape is Llama 3 8B's
MODES = ("none", "selective", "full")

TORCHTITAN = [  # (sequence, cp, fsdp degree, tokens/s per GPU, GiB per GPU)
    (32_768, 1, 8, 3_890, 83.9),
    (65_536, 2, 4, 2_540, 84.2),
    (131_072, 4, 2, 1_071, 84.0),
    (262_144, 8, 1, 548, 84.5),
]
NEMO = [  # (sequence, GPUs, global batch, tp, dp, cp, TFLOP/s per GPU with CP)
    (32_768, 32, 128, 2, 8, 2, 610),
    (65_536, 64, 64, 4, 8, 2, 574),
    (131_072, 128, 32, 4, 8, 4, 555),
    (262_144, 256, 16, 4, 8, 8, 549),
    (524_288, 512, 8, 8, 4, 16, 549),
    (1_048_576, 1024, 4, 8, 4, 32, 536),
]
ALST = [  # (GPUs, the longest sequence published, what ALST keeps on the host)
    (1, 500_000, "optimizer+params"),
    (8, 3_700_000, "optimizer"),
    (32, 15_000_000, "optimizer"),
]
TILE = 4096
"""train.loss_chunk and train.mlp_chunk of the ALST rows: the tiles ALST's Liger loss and
tiled MLP cut a rank's sequence into are of this order."""


def planned(overrides: list[str], world: int) -> tuple[LctrainConfig, StepTime, float]:
    """The composed config, its predicted step and its memory per GPU (GiB, the pipeline rank
    with the most, allocator allowance included)."""
    cfg = compose(overrides).cfg
    problems = layout_problems(cfg, world)
    assert not problems, (overrides, problems)
    return cfg, predict_step_time(cfg, world, hardware_from_plan(cfg)), memory_gib(cfg, world)


def fastest_fitting(overrides: list[str], world: int):
    """`planned` at the checkpointing mode with the shortest predicted step among those that
    fit plan.gpu_memory_gib (the mode stated in the row), or the full mode's plan."""
    plans = {mode: planned([*overrides, f"train.activation_checkpointing={mode}"], world)
             for mode in MODES}
    fits = [m for m in MODES if plans[m][2] <= plans[m][0].plan.gpu_memory_gib]
    mode = min(fits, key=lambda m: plans[m][1].total_s) if fits else "full"
    return mode, *plans[mode]


def with_plan(cfg: LctrainConfig, **plan) -> LctrainConfig:
    return dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, **plan))


def tokens_per_s(cfg: LctrainConfig, world: int) -> float:
    return predict_step_time(cfg, world, hardware_from_plan(cfg)).tokens_per_s_per_rank


def implied_attention_efficiency(cfg: LctrainConfig, world: int, published: float) -> float:
    """The plan.attention_efficiency at which lctrain's model predicts `published` tokens/s per
    GPU (bisection; tokens/s grow with it): 0 when even 0.001 predicts more, 1 when even 1
    predicts fewer (the gap is then not the attention's)."""
    low, high = 0.001, 1.0
    if tokens_per_s(with_plan(cfg, attention_efficiency=low), world) > published:
        return 0.0
    if tokens_per_s(with_plan(cfg, attention_efficiency=high), world) < published:
        return 1.0
    for _ in range(30):
        mid = (low + high) / 2
        fast = tokens_per_s(with_plan(cfg, attention_efficiency=mid), world) > published
        low, high = (low, mid) if fast else (mid, high)
    return (low + high) / 2


def torchtitan_rows() -> list[str]:
    lines = [f"{'torchtitan 8B, 8 GPUs':<22} {'tok/s/GPU published':>19} {'lctrain':>8} "
             f"{'ratio':>6} {'implied attn eff':>16} {'GiB published':>13} {'lctrain':>8}  "
             "layout"]
    for seq, cp, fsdp, tps, gib in TORCHTITAN:
        overrides = [*GPU, "model=llama3-8b", f"train.seq_len={seq}", f"parallel.cp={cp}",
                     f"parallel.dp={fsdp}", f"train.global_batch={fsdp}",
                     "train.activation_checkpointing=full", "slurm.nodes=1",
                     "slurm.gpus_per_node=8", "plan.gpu_memory_gib=96"]
        if cp > 1:
            overrides.append("parallel.attention=allgather")
        cfg, step, mem = planned(overrides, 8)
        efficiency = implied_attention_efficiency(cfg, 8, tps)
        lines.append(f"{f'{seq // 1024}K':<22} {tps:>19,} {step.tokens_per_s_per_rank:>8,.0f} "
                     f"{step.tokens_per_s_per_rank / tps:>6.2f} {efficiency:>16.2f} "
                     f"{gib:>13.1f} {mem:>8.1f}  fsdp {fsdp}"
                     + (f" x cp {cp} (all-gather KV)" if cp > 1 else "")
                     + ", full checkpointing")
    return lines


def nemo_rows() -> list[str]:
    """Model TFLOP/s per GPU three ways: lctrain's FLOPs (causal attention counted once,
    §14) in bf16; the same step counted with full S x S attention, as Megatron's formula of
    the time did; and that count with the linear layers at FP8's rate (2 x plan.device_tflops
    at the same efficiency)."""
    lines = [f"{'NeMo Llama 2 7B':<16} {'published':>9} {'causal':>7} {'full S^2':>8} "
             f"{'+fp8':>6} {'ratio':>6} {'GiB':>6}  layout (TFLOP/s per GPU; checkpointing: "
             "the fastest that fits 80 GiB)"]
    for seq, gpus, batch, tp, dp, cp, tflops in NEMO:
        overrides = [*GPU, "model=llama3-8b", *LLAMA2_7B, f"train.seq_len={seq}",
                     f"parallel.tp={tp}", "parallel.sp=true", f"parallel.cp={cp}",
                     f"parallel.dp={dp}", "parallel.attention=ring",
                     f"train.global_batch={batch}", f"slurm.nodes={gpus // 8}",
                     "slurm.gpus_per_node=8"]
        mode, cfg, step, mem = fastest_fitting(overrides, gpus)
        tokens = derive(cfg, gpus).tokens_per_step
        flops = train_flops_per_step(cfg, tokens)
        full = flops + 6 * seq * cfg.model.dim * cfg.model.n_layers * tokens
        fp8 = with_plan(cfg, matmul_efficiency=2 * cfg.plan.matmul_efficiency)
        fp8_s = predict_step_time(fp8, gpus, hardware_from_plan(fp8)).total_s
        rates = [f / s / gpus / 1e12 for f, s in
                 ((flops, step.total_s), (full, step.total_s), (full, fp8_s))]
        lines.append(f"{f'{seq // 1024}K on {gpus}':<16} {tflops:>9,} {rates[0]:>7,.0f} "
                     f"{rates[1]:>8,.0f} {rates[2]:>6,.0f} {rates[2] / tflops:>6.2f} "
                     f"{mem:>6.1f}  tp {tp} + sp, cp {cp} ring, dp {dp} fsdp, {mode}")
    return lines


def alst_config(gpus: int, seq: int, offload: str, engine: str) -> list[str]:
    """ALST's setting for `gpus` H100s at `seq` tokens: Ulysses over every GPU, full
    checkpointing with the checkpoints on the host, tiles of TILE; the state offloaded by
    DeepSpeed's ZeRO-3 as ALST does (`engine` deepspeed: the optimizer state on the host, the
    weights too when `offload` is optimizer+params) or by lctrain's FSDP2
    (parallel.offload_state=`offload`)."""
    if engine == "deepspeed":
        state = ["parallel.dp_engine=deepspeed", "deepspeed.zero_stage=3",
                 "deepspeed.offload_optimizer=cpu",
                 f"deepspeed.offload_param={'cpu' if 'params' in offload else 'none'}"]
    else:
        state = ["parallel.dp_engine=fsdp", f"parallel.offload_state={offload}"]
    return [*GPU, "model=llama3-8b", f"train.seq_len={seq}", f"parallel.cp={gpus}",
            "parallel.attention=ulysses", "parallel.dp=1", *state, "train.global_batch=1",
            "train.activation_checkpointing=full", "train.offload_activations=true",
            f"train.loss_chunk={TILE}", f"train.mlp_chunk={TILE}",
            f"slurm.nodes={max(1, gpus // 8)}", f"slurm.gpus_per_node={min(gpus, 8)}"]


def longest_fitting(gpus: int, offload: str, engine: str) -> tuple[int, float]:
    """The longest sequence (a multiple of TILE x gpus) whose plan fits 80 GiB and its GiB, or
    0 and the GiB of the shortest when none fits."""
    unit = TILE * gpus

    def gib(k: int) -> float:
        return planned(alst_config(gpus, k * unit, offload, engine), gpus)[2]

    if gib(1) > 80:
        return 0, gib(1)
    low, high = 1, 2
    while gib(high) <= 80:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gib(mid) <= 80 else (low, mid)
    return low * unit, gib(low)


def alst_rows() -> list[str]:
    lines = [f"{'ALST Llama 3.1 8B':<18} {'longest published':>17} {'engine':<9} "
             f"{'lctrain':>10} {'ratio':>6} {'GiB':>5} {'host GiB/node':>13}  layout"]
    for gpus, seq, offload in ALST:
        for engine in ("deepspeed", "fsdp"):
            longest, gib = longest_fitting(gpus, offload, engine)
            cfg = compose(alst_config(gpus, max(longest, TILE * gpus), offload, engine)).cfg
            host = rank_memory(cfg, gpus, 0)["itemised"]["host"]
            on_host = ("optimizer state and weights" if "params" in offload
                       else "optimizer state")
            label = ("ZeRO-3" if engine == "deepspeed" else
                     f"FSDP2 parallel.offload_state={offload}")
            lines.append(f"{f'{gpus} H100 80 GB':<18} {seq:>17,} {engine:<9} {longest:>10,} "
                         f"{longest / seq:>6.2f} {gib:>5.1f} {host['per_node_gib']:>13,.0f}  "
                         f"cp {gpus} ulysses, {label}: {on_host} and checkpoints on the host, "
                         f"tiles of {TILE}")
    return lines


def main() -> None:
    for section in (torchtitan_rows, nemo_rows, alst_rows):
        print("\n".join(section()), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
