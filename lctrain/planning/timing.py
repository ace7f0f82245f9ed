"""Predicted time of one optimizer step: compute from the model FLOPs (and what activation
checkpointing recomputes) over a FLOP rate, traffic per group over the bandwidth of where the
group's ranks sit plus a latency per collective call, ring attention's P2P hidden behind the
attention it overlaps, fixed costs per block and per step, and the pipeline bubble
(docs/parallelism.md §15). Pure arithmetic on a config and a `Hardware`: no process or device.

`Hardware` (`lctrain.planning.hardware`) comes from plan.* or from the calibration file
`lctrain plan --calibrate` writes.

Every term reads one `StepShape`: the config, the world size and what follows from them (the
derived sizes, the topology, the busiest rank's blocks), worked out once per prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lctrain.config import Derived, LctrainConfig, derive
from lctrain.config.cp_algorithms import CP_ALGORITHMS
from lctrain.config.derived import data_parallel_engine_of
from lctrain.config.model_size import (
    FLOPS_PER_WEIGHT,
    MLP_MATRICES,
    TRAIN_OVER_FORWARD,
    attention_flops,
    layer_costs,
    state_passing_extra_flops,
)
from lctrain.layout.stages import bubble_fraction, split_layers, stages_of
from lctrain.layout.topology import Topology
from lctrain.planning.cp_costs import cp_costs
from lctrain.planning.documents import packed_documents
from lctrain.planning.flops import train_flops_per_step
from lctrain.planning.hardware import Hardware
from lctrain.planning.state import local_params
from lctrain.planning.traffic import (
    cp_step_bytes,
    cp_step_groups,
    cp_transfers,
    data_parallel_bytes,
    ep_step_bytes,
    host_copy_bytes,
    layer_windows,
    linear_layers,
    linear_transfers,
    step_traffic_bytes,
)

# ---- the step being predicted ------------------------------------------------------------------


@dataclass(frozen=True)
class StepShape:
    """One layout's step as every term reads it, worked out once."""

    cfg: LctrainConfig
    world_size: int
    derived: Derived
    topology: Topology
    blocks: int
    """Transformer blocks of the pipeline rank with the most (all of them at pp = 1)."""

    @classmethod
    def of(cls, cfg: LctrainConfig, world_size: int) -> StepShape:
        stages = split_layers(cfg)
        blocks = max(sum(len(stages[s]) for s in stages_of(cfg, r))
                     for r in range(cfg.parallel.pp))
        return cls(cfg, world_size, derive(cfg, world_size),
                   Topology.from_config(cfg, world_size), blocks)

    @property
    def micro_batches(self) -> int:
        """Micro-batches one rank runs per step."""
        return self.derived.grad_accum

    @property
    def shards(self) -> int:
        """Ranks that split the weights' gradients: dp x cp."""
        return self.derived.dp * self.cfg.parallel.cp


# ---- compute -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComputeSeconds:
    """One rank's share of the step's FLOPs, by kernel class, each at its efficiency."""

    matmul_s: float
    attention_s: float
    recompute_s: float
    """Forward FLOPs run a second time (checkpointing, the tiled loss and MLP)."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.recompute_s


def compute_seconds(step: StepShape, hw: Hardware) -> ComputeSeconds:
    """The model FLOPs of one rank's share of the step, and the forward FLOPs run again: by
    checkpointing (`full`: the blocks' forward; `selective` at cp > 1: the attention's forward;
    at cp = 1 it recomputes only elementwise work), by the tiled loss (the output layer) and the
    tiled MLP (its matmuls), and the linear layers' first pass under state passing
    (`state_passing_extra_flops`, forward and backward). The attention's share follows the corpus's documents
    (`packed_documents`: their own triangles, on the slowest cp rank)."""
    cfg, t, m = step.cfg, step.cfg.train, step.cfg.model
    embedding, blocks, output = layer_costs(m, t.seq_len)
    # (a linear-attention layer's recurrence is chunk matmuls: counted with the matmuls)
    attention = attention_flops(m, t.seq_len) * sum(
        not m.is_linear_layer(i) for i in range(m.n_layers))
    matmul = embedding + sum(blocks) + output - attention
    # packed documents (plan.documents): the kernels run each document's own triangle, and the
    # step waits for the cp rank with the most of it (§24)
    docs = packed_documents(cfg)
    attention *= docs.attention_fraction * docs.balance
    matmul_rate = hw.flops_per_s(hw.matmul_efficiency)
    attention_rate = hw.flops_per_s(hw.attention_efficiency)
    again = 0.0  # forward FLOPs per token recomputed, in seconds per token
    if t.activation_checkpointing == "full":
        again = ((sum(blocks) - attention) / matmul_rate
                 + attention / attention_rate) / TRAIN_OVER_FORWARD
    elif t.activation_checkpointing == "selective" and cfg.parallel.cp > 1:
        again = attention / TRAIN_OVER_FORWARD / attention_rate
    tiled = (output / TRAIN_OVER_FORWARD if t.loss_chunk else 0) + (
        FLOPS_PER_WEIGHT * MLP_MATRICES * m.dim * m.ffn_dim * m.n_layers if t.mlp_chunk else 0)
    first_pass = 0.0  # the linear layers' under state passing (§31)
    if cfg.parallel.cp > 1 and cfg.parallel.linear_cp == "state":
        first_pass = state_passing_extra_flops(m) * sum(
            m.is_linear_layer(i) for i in range(m.n_layers))
    again += (tiled + first_pass) / matmul_rate
    tokens = step.derived.tokens_per_step / step.world_size
    return ComputeSeconds(matmul_s=matmul * tokens / matmul_rate,
                          attention_s=attention * tokens / attention_rate,
                          recompute_s=again * tokens)


# ---- communication -----------------------------------------------------------------------------

TP_CALLS = {True: (4, 4, 3), False: (2, 2, 1)}
"""Tensor parallelism's collective calls per block and micro-batch, (forward, backward,
recomputed), with and without sequence parallelism (docs/parallelism.md §2, §15). With SP the
forward all-gathers before attention and before the MLP and reduce-scatters after each, and the
backward runs the mirror images; without it one all-reduce after each, and one per each in the
backward. Recomputing under torch's non-reentrant checkpoint stops once the last tensor the
backward saved is rebuilt, so the block's last collective is not run again."""
PP_CALLS_PER_STAGE = 4
"""The pipeline's calls per micro-batch and stage a rank holds: a send and a receive each way."""


def group_bandwidth_gbps(topology: Topology, group: str, hw: Hardware) -> float:
    """Intra-node bandwidth when every instance of the group has all its ranks on one node
    (rank // ranks_per_node), else inter-node."""
    n = hw.ranks_per_node
    if n <= 0:
        return hw.intra_node_gbps
    intra = all(len({r // n for r in members}) == 1 for members in topology.groups(group))
    return hw.intra_node_gbps if intra else hw.inter_node_gbps


def cp_group_bytes(step: StepShape) -> dict[str, float]:
    """Bytes one rank sends per step in the context-parallel attention, by the group each
    transfer names (`cp_step_groups`: "cp_ring" ring P2P, "cp_ulysses" all-to-all, "cp"
    all-gather KV): `cp_step_bytes` (recompute included) of the pipeline rank with the most."""
    cfg, world = step.cfg, step.world_size
    groups = cp_step_groups(cfg, world)
    out: dict[str, float] = {}
    for r in range(cfg.parallel.pp):
        mine: dict[str, float] = {}
        for name, nbytes in cp_step_bytes(cfg, world, r).items():
            mine[groups[name]] = mine.get(groups[name], 0.0) + nbytes
        out = max(out, mine, key=lambda x: sum(x.values()))
    return out


def dp_bytes(step: StepShape) -> float:
    """Bytes one rank sends per step over dp x cp: the logged formula where lctrain has one
    (`step_traffic_bytes`); under pipelining FSDP's weights gathered once per step (kept across
    micro-batches); DeepSpeed as the engine it resembles (ZeRO-3: FSDP's gathers in every
    micro-step; ZeRO-1/2: DDP's all-reduce volume as reduce-scatter + all-gather)."""
    cfg, p = step.cfg, step.cfg.parallel
    logged = step_traffic_bytes(cfg, step.world_size)
    if step.shards == 1 or "dp" in logged:
        return logged.get("dp", 0.0)
    engine = p.dp_engine
    if engine == "deepspeed":
        engine = "fsdp" if cfg.deepspeed.zero_stage == 3 else "ddp"
    gathers = 1 if p.pp > 1 else step.micro_batches
    return max(data_parallel_bytes(cfg, step.world_size, r, gathers, engine)
               for r in range(p.pp))


def step_bytes(step: StepShape) -> dict[str, float]:
    """Bytes one rank sends per step, by group ("dp" for the dp x cp group)."""
    nbytes = {**step_traffic_bytes(step.cfg, step.world_size), **cp_group_bytes(step)}
    nbytes.pop("dp", None)
    if step.shards > 1:
        nbytes["dp"] = dp_bytes(step)
    if step.cfg.parallel.ep > 1:  # the experts' all-to-alls, at uniform routing
        nbytes["ep"] = ep_step_bytes(step.cfg, step.world_size)
    return {group: b for group, b in nbytes.items() if b > 0}


def collective_calls(step: StepShape) -> dict[str, float]:
    """Collective calls one rank makes per step, by group, besides FSDP's and DDP's (whose calls
    the calibrated fixed costs hold): per block and micro-batch, TP's (`TP_CALLS`) and the
    attention's (`Transfer.calls`, the forward's again when checkpointing recomputes it); per
    micro-batch, the pipeline's (`PP_CALLS_PER_STAGE` per stage the rank holds)."""
    cfg, p = step.cfg, step.cfg.parallel
    again = cfg.train.activation_checkpointing != "none"
    per_block: dict[str, float] = {}
    if p.tp > 1:
        forward, backward, recomputed = TP_CALLS[p.sp]
        per_block["tp"] = forward + backward + (recomputed if again else 0)
    layers = range(cfg.model.n_layers)
    kinds = [(cp_transfers(cfg, step.world_size, window), count)
             for window, count in layer_windows(cfg, layers).items()]
    if linear_layers(cfg, layers):
        kinds.append((linear_transfers(cfg), linear_layers(cfg, layers)))
    for transfers, count in kinds:  # calls of an average block
        for x in transfers:
            times = 2 if again and x.direction == "fwd" else 1
            per_block[x.group] = (per_block.get(x.group, 0)
                                  + times * x.calls * count / cfg.model.n_layers)
    out = {g: n * step.blocks * step.micro_batches for g, n in per_block.items()}
    if p.ep > 1:  # per MoE layer: the row counts, dispatch and combine, forward and backward
        moe = len(cfg.model.moe_layer_ids)
        out["ep"] = moe * step.micro_batches * (3 * (2 if again else 1) + 2)
    if p.pp > 1:
        out["pp"] = PP_CALLS_PER_STAGE * len(stages_of(cfg, 0)) * step.micro_batches
    return out


def comm_seconds(step: StepShape, hw: Hardware) -> dict[str, float]:
    """Per group: its bytes over its bandwidth, plus its calls x the latency."""
    calls = collective_calls(step)
    # the ep ranks are consecutive ranks of dp x cp: its bandwidth bounds theirs
    mesh_group = {"dp": "dp_cp", "ep": "dp_cp"}
    return {group: nbytes / (group_bandwidth_gbps(
                step.topology, mesh_group.get(group, group), hw) * 1e9)
            + calls.get(group, 0) * hw.latency_s
            for group, nbytes in step_bytes(step).items()}


def exposed_seconds(comm: dict[str, float], attention_s: float, ring: int) -> float:
    """Communication not hidden behind compute: all of it but the ring's P2P, whose R - 1
    transfers each run behind the attention of one of the R blocks."""
    ring_s = comm.get("cp_ring", 0.0)
    return sum(comm.values()) - ring_s + max(0.0, ring_s - attention_s * (ring - 1) / ring)


# ---- fixed costs -------------------------------------------------------------------------------


def _never(_step: StepShape) -> float:
    return 0.0


def _attention_feature(name: str) -> Callable[[StepShape], float]:
    """Times per block the layout pays algorithm `name`'s fixed cost, as the layout's own
    algorithm's registry entry counts them (`TimingTerms.fixed_costs`)."""
    def times(step: StepShape) -> float:
        p, d = step.cfg.parallel, step.derived
        if p.cp == 1:
            return 0.0
        return cp_costs(p.attention).timing.fixed_costs(d.cp_ring, d.cp_ulysses).get(name, 0)
    return times


@dataclass(frozen=True)
class CalibratedLayout:
    """A layout whose fixed costs `lctrain plan --calibrate` measures: a reference ("single",
    "base"), or one feature beside the reference its extra is measured against."""

    name: str
    parallel: dict
    """The parallel.* overrides of its calibration run."""
    train: dict = field(default_factory=dict)
    """The train.* overrides of its calibration run."""
    reference: str | None = "base"
    """The layout its extra is measured against: "base" (2 FSDP ranks), "single" for what
    is the rank's own work, the same beside any engine (the checkpointing modes), or another
    calibrated layout it adds to ("pp" for each further pipeline stage per rank). None: it is
    a reference."""
    times: Callable[[StepShape], float] = _never
    """How many times per block a layout pays its extra (0: it does not use the feature)."""
    depths: tuple[int, int] = (2, 4)
    """The model depths of its two timed runs (the difference is blocks, the rest is per
    micro-batch): enough layers for every stage of its pipeline."""


CALIBRATED_LAYOUTS: tuple[CalibratedLayout, ...] = (
    CalibratedLayout("single", {}, reference=None),
    CalibratedLayout("base", {"dp": 2}, reference=None),
    CalibratedLayout("tp", {"tp": 2, "sp": True, "dp": 1},
                     times=lambda s: float(s.cfg.parallel.tp > 1)),
    *(CalibratedLayout(a.name, {"cp": 2, "attention": a.name, "dp": 1},
                       times=_attention_feature(a.name))
      for a in CP_ALGORITHMS.entries() if cp_costs(a.name).timing.calibrated),
    CalibratedLayout("pp", {"pp": 2, "dp": 1}, times=lambda s: float(s.cfg.parallel.pp > 1)),
    CalibratedLayout("pp_stages", {"pp": 2, "dp": 1, "pp_schedule": "interleaved_1f1b",
                                   "pp_virtual_stages": 2}, reference="pp", depths=(4, 8),
                     times=lambda s: float(s.cfg.parallel.pp_virtual_stages - 1)
                     if s.cfg.parallel.pp > 1 else 0.0),
    CalibratedLayout("ddp", {"dp": 2, "dp_engine": "ddp"},
                     times=lambda s: float(s.cfg.parallel.dp_engine == "ddp" and s.shards > 1)),
    *(CalibratedLayout(mode, {}, {"activation_checkpointing": mode}, reference="single",
                       times=lambda s, mode=mode: float(
                           s.cfg.train.activation_checkpointing == mode))
      for mode in ("selective", "full")),
)
"""The layouts `lctrain plan --calibrate` trains and times, in its order: one process, 2-rank
FSDP, then one feature each on 2 ranks (each context-parallel algorithm whose registry entry
says `calibrated`; a second pipeline stage per rank on top of the pipeline's), the
checkpointing modes on one process."""


def calibrated_layout(name: str) -> CalibratedLayout:
    return next(c for c in CALIBRATED_LAYOUTS if c.name == name)


def fixed_seconds(step: StepShape, hw: Hardware) -> float:
    """The step's fixed costs on the busiest rank: per block and micro-batch, the reference's
    ("base", "single" for one process) plus the extra of each feature the layout uses times how
    often it pays it, times the rank's blocks; per micro-batch besides the blocks (the
    embedding, the loss head, the loader, the optimizer step's share), the reference's plus the
    same extras; both times the rank's micro-batches."""
    if not hw.fixed_costs:
        return 0.0
    base = "base" if step.world_size > 1 else "single"
    block, rest = hw.fixed_costs[base]
    for feature in CALIBRATED_LAYOUTS:
        times = feature.times(step)
        if times and feature.name in hw.fixed_costs:
            own = hw.fixed_costs[feature.name]
            ref = hw.fixed_costs[{"single": "single", "base": base}.get(feature.reference,
                                                                         feature.reference)]
            block += times * (own[0] - ref[0])
            rest += times * (own[1] - ref[1])
    return (max(0.0, block) * step.blocks + max(0.0, rest)) * step.micro_batches


# ---- state in host memory ----------------------------------------------------------------------


def offload_seconds(step: StepShape, hw: Hardware) -> float:
    """Seconds the busiest rank spends on what it keeps in host memory (docs/parallelism.md
    §22): its host<->device copies (`host_copy_bytes`, both directions) at the PCIe bandwidth,
    not hidden behind compute, and the host AdamW step over the parameters whose state is on
    the host (parallel.offload_state), at the host's rate."""
    cfg = step.cfg
    copies = max(sum(host_copy_bytes(cfg, step.world_size, r).values())
                 for r in range(cfg.parallel.pp))
    seconds = copies / (hw.pcie_gbps * 1e9) if hw.pcie_gbps else 0.0
    if cfg.parallel.offload_state != "none" and hw.host_adam_gparams_per_s:
        params = max(sum(local_params(cfg, r)) for r in range(cfg.parallel.pp))
        n = step.shards if data_parallel_engine_of(cfg, step.world_size) == "fsdp" else 1
        seconds += params / n / (hw.host_adam_gparams_per_s * 1e9)
    return seconds


# ---- the step ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank."""

    compute_s: float
    """Model FLOPs of the step, and the forward FLOPs checkpointing recomputes, over the rank's
    rate (matmul and attention at their efficiencies)."""
    recompute_s: float
    """The part of compute_s that activation checkpointing adds."""
    comm_s: dict[str, float]
    """Per group: bytes the rank sends / the group's bandwidth (intra- or inter-node), plus its
    collective calls x the latency."""
    exposed_comm_s: float
    """Communication not hidden behind compute: all but ring P2P, plus what of it outlasts
    the attention it overlaps."""
    overhead_s: float
    """Fixed costs per block and micro-batch, and per micro-batch (`Hardware.fixed_costs`)."""
    bubble_s: float
    """Pipeline idle time (pp > 1): bubble_fraction of the step."""
    offload_s: float
    """Host<->device copies and the host optimizer step (`offload_seconds`)."""
    total_s: float
    tokens_per_s_per_rank: float
    mfu: float
    """Model FLOPs / (total_s x ranks x device_tflops)."""


def core_share(world_size: int, hw: Hardware) -> float:
    """How many times slower each rank runs when the ranks share fewer cores than there are of
    them (compute, gloo's copies and the fixed costs alike): ranks / cores, else 1."""
    return world_size / hw.cores if hw.cores and world_size > hw.cores else 1.0


def predict_step_time(cfg: LctrainConfig, world_size: int, hw: Hardware) -> StepTime:
    """The step-time model of docs/parallelism.md §15."""
    step, p = StepShape.of(cfg, world_size), cfg.parallel
    share = core_share(world_size, hw)
    compute = compute_seconds(step, hw)
    comm = {group: share * s for group, s in comm_seconds(step, hw).items()}
    exposed = exposed_seconds(comm, share * compute.attention_s, step.topology.cp_ring)
    overhead = share * fixed_seconds(step, hw)
    busy = share * compute.total_s + exposed + overhead
    fraction = bubble_fraction(p.pp_schedule, p.pp, step.micro_batches, p.pp_virtual_stages)
    bubble = busy * fraction / (1 - fraction)
    offload = share * offload_seconds(step, hw)
    total = busy + bubble + offload
    tokens = step.derived.tokens_per_step
    return StepTime(compute_s=share * compute.total_s, recompute_s=share * compute.recompute_s,
                    comm_s=comm, exposed_comm_s=exposed, overhead_s=overhead, bubble_s=bubble,
                    offload_s=offload, total_s=total, tokens_per_s_per_rank=tokens / total / world_size,
                    mfu=train_flops_per_step(cfg, tokens)
                    / (total * world_size * hw.flops_per_s(1.0)))


def step_time_summary(cfg: LctrainConfig, world_size: int, hw: Hardware) -> dict:
    """`predict_step_time` as plain data for `lctrain plan`: its terms, tokens/s per rank and in
    all, MFU, and where the hardware numbers came from."""
    step = predict_step_time(cfg, world_size, hw)
    return {"hardware": hw.source, "total_s": step.total_s, "compute_s": step.compute_s,
            "recompute_s": step.recompute_s, "comm_s": step.comm_s,
            "exposed_comm_s": step.exposed_comm_s, "fixed_costs_s": step.overhead_s,
            "bubble_s": step.bubble_s, "offload_s": step.offload_s,
            "tokens_per_s_per_rank": step.tokens_per_s_per_rank,
            "tokens_per_s": step.tokens_per_s_per_rank * world_size, "mfu": step.mfu}
