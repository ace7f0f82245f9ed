"""Values that follow from a validated config and a world size: dp when -1, gradient
accumulation, the Ulysses and Ring degrees and KV replication. Never written back into the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache

from lctrain.config.cp_algorithms import cp_algorithm
from lctrain.config.load_balances import auto_load_balance
from lctrain.config.schema import LctrainConfig, ParallelConfig


@dataclass(frozen=True)
class Derived:
    """Quantities that follow from the config and a world size (never written back)."""

    world_size: int
    dp: int
    cp_ulysses: int
    cp_ring: int
    grad_accum: int
    kv_replication: int
    """Each KV head is repeated this many times before the Ulysses all-to-all (1 = none)."""
    local_seq_len: int
    """Tokens of each sequence held by one cp rank (before SP splits it further over tp)."""
    tokens_per_step: int
    """Tokens consumed by one optimizer step over all ranks."""


def derive(cfg: LctrainConfig, world_size: int) -> Derived:
    """Derived values of a config that `validate` accepted for this world size."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    return _derive(world_size, p.dp, p.tp, p.cp, p.pp, ulysses_degree(p), t.global_batch,
                   t.micro_batch, t.seq_len, m.n_heads, m.n_kv_heads)


@cache  # pure in its arguments; a layout search asks for the same ones many times
def _derive(world_size: int, dp: int, tp: int, cp: int, pp: int, cp_ulysses: int,
            global_batch: int, micro_batch: int, seq_len: int, n_heads: int,
            n_kv_heads: int) -> Derived:
    dp = dp if dp != -1 else world_size // (tp * cp * pp)
    return Derived(
        world_size=world_size,
        dp=dp,
        cp_ulysses=cp_ulysses,
        cp_ring=cp // cp_ulysses,
        grad_accum=global_batch // (micro_batch * dp),
        kv_replication=kv_replication(n_heads, n_kv_heads, tp, cp_ulysses) or 1,
        local_seq_len=seq_len // cp,
        tokens_per_step=global_batch * seq_len,
    )


def data_parallel_engine_of(cfg: LctrainConfig, world_size: int) -> str | None:
    """The engine that holds the weights over dp x cp: parallel.dp_engine, or None when no
    group reduces gradients (one rank of dp x cp), except that FSDP's CPU offload
    (parallel.offload_state=optimizer+params) and the DeepSpeed engine run at dp x cp = 1 too
    (they are what keeps the state on the host)."""
    p = cfg.parallel
    if p.dp_engine == "deepspeed" or (p.dp_engine == "fsdp"
                                      and p.offload_state == "optimizer+params"):
        return p.dp_engine
    dp = p.dp if p.dp != -1 else world_size // (p.tp * p.cp * p.pp)
    return p.dp_engine if dp * p.cp > 1 else None


def reduces_each_micro_step(cfg: LctrainConfig) -> bool:
    """Whether gradients are reduced in every accumulation micro-step, not only the last: under
    FSDP's CPU offload they then go to the host each time instead of accumulating unsharded
    on the device."""
    return cfg.parallel.offload_state == "optimizer+params"


def plans_gpu_nodes(cfg: LctrainConfig) -> bool:
    """Whether the run `lctrain plan` plans trains on GPUs: GPU nodes (slurm.gpus_per_node > 0)
    and train.device not cpu (its step time uses plan.*, its trace the CUDA path)."""
    return cfg.slurm.gpus_per_node > 0 and cfg.train.device != "cpu"


def local_world_size(cfg: LctrainConfig) -> int:
    """launch.nproc, else tp*cp*pp*dp with dp=-1 counting as 1."""
    if cfg.launch.nproc is not None:
        return cfg.launch.nproc
    p = cfg.parallel
    return p.tp * p.cp * p.pp * max(p.dp, 1)


def slurm_ranks_per_node(cfg: LctrainConfig) -> int:
    """Ranks each node of a Slurm job runs: slurm.gpus_per_node, or on a CPU partition
    (gpus_per_node=0) launch.nproc / slurm.nodes (0 when that does not divide evenly)."""
    s = cfg.slurm
    if s.gpus_per_node > 0:
        return s.gpus_per_node
    total = local_world_size(cfg)
    return total // s.nodes if total % s.nodes == 0 else 0


def slurm_world(cfg: LctrainConfig) -> int:
    """Ranks of the Slurm job slurm.* describes."""
    return cfg.slurm.nodes * slurm_ranks_per_node(cfg)


def load_balance_of(cfg: LctrainConfig) -> str:
    """parallel.load_balance with `auto` resolved: documents when packed documents are masked
    (data.document_masking: each row balanced by its own documents), zigzag otherwise
    (docs/parallelism.md §24)."""
    if cfg.parallel.load_balance != "auto":
        return cfg.parallel.load_balance
    return auto_load_balance(cfg.data.document_masking)


def ulysses_degree(p: ParallelConfig) -> int:
    """Ulysses (all-to-all) degree inside the cp group: the algorithm's degree rule
    (`CPAlgorithm.degree`); 1 without context parallelism."""
    if p.cp == 1:
        return 1
    return cp_algorithm(p.attention).degree(p.cp, p.ulysses_degree)


@cache
def kv_replication(n_heads: int, n_kv_heads: int, tp: int, cp_ulysses: int) -> int | None:
    """Smallest r so that r * (local kv heads) splits over Ulysses and still groups the q heads.

    Returns None when no such r exists (the layout must be rejected).
    """
    if n_kv_heads <= 0 or tp <= 0 or cp_ulysses <= 0 or n_kv_heads % tp or n_heads % tp:
        return None
    local_q, local_kv = n_heads // tp, n_kv_heads // tp
    for r in range(1, local_q // local_kv + 1):
        kv = local_kv * r
        if kv % cp_ulysses == 0 and local_q % kv == 0 and (local_q // cp_ulysses) % (kv // cp_ulysses) == 0:
            return r
    return None


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of train.stages: its steps (first..last, 1-based, inclusive) and the config it
    trains with (train.seq_len, global_batch and micro_batch its own; no stages)."""

    index: int
    first: int
    last: int
    cfg: LctrainConfig


def stage_problems(cfg: LctrainConfig) -> list[str]:
    """What keeps train.stages from being a valid schedule (the stages' own layouts aside)."""
    t = cfg.train
    if not t.stages:
        return []
    problems = []
    total = sum(s.steps for s in t.stages)
    if total != t.steps:
        problems.append(f"train.stages' steps add up to {total}, but train.steps={t.steps}; set "
                        f"train.steps={total}")
    if t.stages[-1].seq_len != t.seq_len:
        problems.append(f"train.stages ends at seq_len={t.stages[-1].seq_len}, but train.seq_len="
                        f"{t.seq_len}; the last stage trains at train.seq_len (set train.seq_len="
                        f"{t.stages[-1].seq_len})")
    for i, s in enumerate(t.stages):
        for key, value in (("global_batch", t.global_batch), ("micro_batch", t.micro_batch)):
            if (value * t.seq_len) % s.seq_len:
                problems.append(f"train.stages[{i}] (seq_len={s.seq_len}): train.{key}={value} x "
                                f"train.seq_len={t.seq_len} tokens are not a whole number of "
                                f"{s.seq_len}-token sequences; use stage lengths that divide "
                                f"{value * t.seq_len}")
    return problems


def stage_banner(cfg: LctrainConfig, stage: Stage) -> list[str]:
    """What a staged run (`cfg`, with train.stages) says as `stage` starts: its steps, length
    and batch, and the eval lengths it skips (longer than its sequences); nothing without
    stages."""
    if len(cfg.train.stages) < 2:
        return []
    t = stage.cfg.train
    lines = [f"lctrain: stage {stage.index + 1} of {len(cfg.train.stages)}: steps "
             f"{stage.first}-{stage.last} at train.seq_len={t.seq_len}, {t.global_batch} "
             "sequences per step"]
    skipped = [n for n in cfg.eval.lengths if n > t.seq_len]
    if skipped and cfg.eval.every:
        lines.append(f"lctrain: eval.lengths {', '.join(map(str, skipped))} skipped in stage "
                     f"{stage.index + 1}: longer than its sequences of {t.seq_len} tokens "
                     "(scored from the stage that trains at that length on)")
    return lines


def context_stages(cfg: LctrainConfig) -> list[Stage]:
    """train.stages as configs (one stage, `cfg` itself, without them); `stage_problems` must
    hold. A stage scores only the eval.lengths that fit it (its seq_len when none does)."""
    t = cfg.train
    if not t.stages:
        return [Stage(0, 1, t.steps, cfg)]
    out, first = [], 1
    for i, s in enumerate(t.stages):
        train = dataclasses.replace(t, stages=[], seq_len=s.seq_len,
                                    global_batch=t.global_batch * t.seq_len // s.seq_len,
                                    micro_batch=t.micro_batch * t.seq_len // s.seq_len)
        stage = dataclasses.replace(cfg, train=train, eval=dataclasses.replace(
            cfg.eval, lengths=[n for n in cfg.eval.lengths if n <= s.seq_len]))
        out.append(Stage(i, first, first + s.steps - 1, stage))
        first += s.steps
    return out


def compute_bytes(cfg: LctrainConfig) -> int:
    """Bytes of one element in the compute dtype (train.dtype): 2 for bf16, else 4."""
    return 2 if cfg.train.dtype == "bf16" else 4


def dtype_bytes(cfg: LctrainConfig, world_size: int) -> tuple[int, int, bool]:
    """(a, r, casts) of docs/parallelism.md §11: bytes per element of what the matmuls and
    attention compute (2 under bf16 autocast), bytes per element of the residual stream (2 only
    when FSDP computes with bf16 weights: the embedding then outputs bf16; autocast on fp32
    weights keeps it fp32), and whether each matmul keeps a bf16 copy of its fp32 weight
    (autocast without FSDP's bf16 weights)."""
    bf16 = cfg.train.dtype == "bf16"
    fsdp_bf16 = bf16 and data_parallel_engine_of(cfg, world_size) == "fsdp"
    return (2 if bf16 else 4), (2 if fsdp_bf16 else 4), bf16 and not fsdp_bf16
