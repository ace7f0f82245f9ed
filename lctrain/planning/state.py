"""The state one rank keeps: parameters per pipeline rank and stage (TP shards, experts per ep
rank, the tied embedding's copy), weights + gradients + AdamW moments per data-parallel engine
on the device and on the host (offload), the gradients accumulation keeps between micro-steps,
FSDP's gathered weights, and the allocator's allowance (docs/parallelism.md §9, §12, §22, §27).
Pure arithmetic on a config: no process, device or tensor.
"""

from __future__ import annotations

from lctrain.config import LctrainConfig, derive
from lctrain.config.derived import compute_bytes, data_parallel_engine_of, reduces_each_micro_step
from lctrain.config.model_size import block_params, block_split, expert_params, layer_kinds
from lctrain.layout.stages import split_layers, stages_of


def local_params(cfg: LctrainConfig, pp_rank: int = 0) -> tuple[int, int]:
    """(block parameters, root parameters) pipeline rank `pp_rank` holds before FSDP: TP shards
    the matmuls, the embedding and the output layer and replicates the norms; the rank holds
    the blocks of its stages, the embedding if it runs the first stage, the final norm and an
    untied output layer, or a tied one's copy under pp > 1, if it runs the last."""
    m, p = cfg.model, cfg.parallel
    stages, mine = split_layers(cfg), stages_of(cfg, pp_rank)
    layers = [i for s in mine for i in stages[s]]
    blocks = sum(n * (block_split(m, i)[0] // p.tp + block_split(m, i)[1])
                 for i, n in layer_kinds(m, layers))
    vocab = m.vocab_size * m.dim // p.tp
    root = vocab if 0 in mine else 0
    if len(stages) - 1 in mine:
        root += m.dim + (0 if m.tie_embeddings and p.pp == 1 else vocab)
    return blocks, root


def tied_copy_params(cfg: LctrainConfig, pp_rank: int = 0) -> int:
    """Elements of the tied embedding's copy that pipeline rank `pp_rank` holds in its last
    stage's output layer (docs/parallelism.md §27), before FSDP: counted by `local_params`,
    without AdamW moments."""
    m, p = cfg.model, cfg.parallel
    last = len(split_layers(cfg)) - 1
    if not m.tie_embeddings or p.pp == 1 or last not in stages_of(cfg, pp_rank):
        return 0
    return m.vocab_size * m.dim // p.tp


def stage_params(cfg: LctrainConfig, stage: int) -> int:
    """Parameters of pipeline stage `stage`, whole (all TP shards): summed over the stages,
    `param_count`."""
    m, stages = cfg.model, split_layers(cfg)
    total = sum(n * block_params(m, i) for i, n in layer_kinds(m, stages[stage]))
    if stage == 0:
        total += m.vocab_size * m.dim
    if stage == len(stages) - 1:
        total += m.dim + (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return total


def state_bytes_per_rank(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """Weights, gradients and AdamW moments one rank of pipeline rank `pp_rank` keeps on its
    device: the sum of `state_parts` (docs/parallelism.md §9, §12)."""
    return sum(state_parts(cfg, world_size, pp_rank).values())


def state_parts(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """The state one rank keeps on its device, itemised: "weights", "gradients" and
    "optimizer_state" (the AdamW moments). TP and PP split the model; FSDP shards all three
    over dp x cp (4 + 4 + 8 bytes per parameter), DDP replicates them there. DeepSpeed, as
    bench/engines.py measures it: the model's weights in the compute dtype (whole under
    ZeRO-1/2, a 1/n partition under ZeRO-3) plus an fp32 master partition; gradients whole under
    ZeRO-1, a partition under ZeRO-2/3; parts offloaded to the host count 0. Without a
    data-parallel engine (one rank of dp x cp) under TP, the vocab-parallel embedding's gradient
    is the whole table on every TP rank (torch's row-wise embedding returns it replicated; FSDP
    would reshard it)."""
    d, p = derive(cfg, world_size), cfg.parallel
    params, n = sum(local_params(cfg, pp_rank)), d.dp * p.cp
    optimized = params - tied_copy_params(cfg, pp_rank)  # what AdamW keeps moments for
    engine = data_parallel_engine_of(cfg, world_size)
    moments = 0.0 if p.offload_state == "optimizer" else 1.0  # HostAdamW keeps them
    if engine == "fsdp":
        on_device = 0.0 if p.offload_state == "optimizer+params" else 1.0
        return {"weights": on_device * 4 * params / n, "gradients": on_device * 4 * params / n,
                "optimizer_state": on_device * moments * 8 * optimized / n}
    if engine != "deepspeed":  # DDP, or one rank of dp x cp: the rank's E/ep experts whole
        elsewhere = _experts_elsewhere(cfg, pp_rank)
        params, optimized = params - elsewhere, optimized - elsewhere
        extra = _whole_embedding_extra(cfg, pp_rank) if n == 1 else 0
        return {"weights": 4 * params, "gradients": 4 * params + extra,
                "optimizer_state": moments * 8 * optimized}
    ds, a = cfg.deepspeed, compute_bytes(cfg)
    offload = ds.offload_optimizer == "cpu"
    weights = 0 if ds.offload_param == "cpu" else a * params / (n if ds.zero_stage == 3 else 1)
    return {"weights": weights + (0.0 if offload else 4 * params / n),
            "gradients": 0.0 if offload else 4 * params / (n if ds.zero_stage >= 2 else 1),
            "optimizer_state": 0.0 if offload else 8 * params / n}


def _experts_elsewhere(cfg: LctrainConfig, pp_rank: int) -> int:
    """Expert parameters that `local_params` counts for pipeline rank `pp_rank` but other ranks
    of its ep group hold: it counts a 1/tp share of every expert with the TP-sharded
    matrices, and the rank holds E/ep whole experts (expert parallelism spans the TP ranks and
    never splits an expert), so 1/tp - 1/ep of them (negative when ep < tp)."""
    m, p = cfg.model, cfg.parallel
    layers = [i for s in stages_of(cfg, pp_rank) for i in split_layers(cfg)[s]]
    experts = sum(n * expert_params(m, i) for i, n in layer_kinds(m, layers))
    return experts // p.tp - experts // p.ep


def _whole_embedding_extra(cfg: LctrainConfig, pp_rank: int) -> int:
    """Bytes by which the vocab-parallel embedding's fp32 gradient exceeds its TP shard on a
    rank of the first stage: torch's row-wise embedding returns the whole table's gradient on
    every TP rank (0 without TP)."""
    m, p = cfg.model, cfg.parallel
    if p.tp == 1 or 0 not in stages_of(cfg, pp_rank):
        return 0
    return 4 * m.vocab_size * m.dim * (p.tp - 1) // p.tp


def accumulated_grad_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """Gradients that gradient accumulation keeps beside the state's (docs/parallelism.md §9,
    §29): the micro-steps before the last run without gradient sync, so
      - FSDP keeps every unit's whole (TP-local, E/ep experts) gradient in fp32, the reduce
        dtype, from the first micro-step's backward to the last one's reduce-scatter, the
        vocab-parallel embedding's whole table (`_whole_embedding_extra`);
      - DDP's gradients of those micro-steps are tensors of their own until the last one's
        backward copies them into its buckets (of which the gradients are then views).
    4 bytes per local parameter; 0 without accumulation, without a data-parallel engine, under
    DeepSpeed, or when gradients are reduced every micro-step (parallel.offload_state=
    optimizer+params)."""
    d = derive(cfg, world_size)
    engine = data_parallel_engine_of(cfg, world_size)
    if engine not in ("fsdp", "ddp") or d.grad_accum == 1 or reduces_each_micro_step(cfg):
        return 0.0
    params = sum(local_params(cfg, pp_rank)) - tied_copy_params(cfg, pp_rank)
    extra = _whole_embedding_extra(cfg, pp_rank) if engine == "fsdp" else 0
    return 4 * (params - _experts_elsewhere(cfg, pp_rank)) + extra


def host_state_parts(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> dict[str, float]:
    """The state one rank keeps in host memory (docs/parallelism.md §22), itemised like
    `state_parts`: under parallel.offload_state=optimizer+params FSDP's fp32 shards, their
    gradients and AdamW moments, 4 + 4 + 8 bytes per parameter / (dp x cp); under
    optimizer, HostAdamW's weight and gradient buffers and the moments, 4 + 4 + 8 bytes per
    parameter the rank holds (a 1/(dp x cp) shard under FSDP, all of them otherwise); with the
    DeepSpeed engine, what its offload keys move (an estimate: fp32 master partition, moments
    and gradient partition, 4 + 8 + 4 bytes per parameter / (dp x cp); ZeRO-3's weights in the
    compute dtype / (dp x cp)). Empty when nothing is offloaded."""
    p = cfg.parallel
    engine = data_parallel_engine_of(cfg, world_size)
    if p.offload_state == "none" and engine != "deepspeed":
        return {}
    d = derive(cfg, world_size)
    params, n = sum(local_params(cfg, pp_rank)), d.dp * p.cp
    if engine == "deepspeed":
        ds, out = cfg.deepspeed, {}
        if ds.offload_optimizer == "cpu":
            out = {"weights": 4 * params / n, "gradients": 4 * params / n,
                   "optimizer_state": 8 * params / n}
        if ds.offload_param == "cpu":
            out["weights"] = out.get("weights", 0.0) + compute_bytes(cfg) * params / n
        return out
    params -= tied_copy_params(cfg, pp_rank)  # on the device: the optimizer never sees it
    local = params / n if engine == "fsdp" else params
    return {"weights": 4 * local, "gradients": 4 * local, "optimizer_state": 8 * local}


ALLOCATOR_FRACTION = 0.10
"""The allocator allowance on top of the modelled bytes: 10% of them (the caching allocator's
block rounding and fragmentation) ..."""
ALLOCATOR_FIXED_GIB = 1.0
"""... plus 1 GiB (the CUDA context, NCCL's and the kernels' workspaces: outside any formula)."""


def allocator_allowance(modelled_bytes: float) -> float:
    """Bytes the plan adds to a rank's modelled total: ALLOCATOR_FRACTION of it plus
    ALLOCATOR_FIXED_GIB GiB (a stated allowance, not a measurement)."""
    return ALLOCATOR_FRACTION * modelled_bytes + ALLOCATOR_FIXED_GIB * 2**30


def gathered_weight_bytes(cfg: LctrainConfig, world_size: int, pp_rank: int = 0) -> float:
    """FSDP's gathered (unsharded) weights at the peak of a step, in bf16 under
    train.dtype=bf16; 0 without FSDP. Without pipelining: the root's (embedding, final norm,
    output layer: kept from the forward to the backward) and two blocks' (the one computing and
    the one prefetched). Under pp > 1 all of the rank's: torch's pipeline stages turn off
    resharding after the backward until the step's last one (`backward_maybe_with_nosync`),
    so a stage stays gathered from its backward to its next forward, and the multi-stage
    schedules gather whole stages ahead (`_add_unshard_reshard`; docs/parallelism.md §13)."""
    if data_parallel_engine_of(cfg, world_size) != "fsdp":
        return 0.0
    blocks, root = local_params(cfg, pp_rank)
    if cfg.parallel.pp == 1:
        blocks = 2 * max(_gathered_block(cfg, i)
                         for i, _ in layer_kinds(cfg.model, range(cfg.model.n_layers)))
    return (blocks + root) * compute_bytes(cfg)


def _gathered_block(cfg: LctrainConfig, layer: int) -> int:
    """Parameters FSDP gathers for block `layer` on one rank: its TP shard, and of a mixture of
    experts' matrices (not split by TP) the rank's E/ep experts (docs/parallelism.md §28)."""
    m, p = cfg.model, cfg.parallel
    sharded, replicated = block_split(m, layer)
    experts = expert_params(m, layer)
    return (sharded - experts) // p.tp + experts // p.ep + replicated
