"""Memory under pipeline parallelism, from the schedules' order of passes: the micro-batches each
stage of a pipeline rank keeps in flight at each moment (GPipe, 1F1B, interleaved, zero bubble,
ZBV, as torch's schedules run them), which stages hold accumulated gradients by then, the
activations of one micro-batch per stage, and the receive buffers and sends the rank holds
(docs/parallelism.md §13). Pure arithmetic on a config.
"""

from __future__ import annotations

from functools import cache

from lctrain.config import LctrainConfig, derive
from lctrain.config.derived import dtype_bytes
from lctrain.config.model_size import layer_kinds
from lctrain.layout.stages import rank_of, rank_stages, split_layers, stage_count, stages_of
from lctrain.planning.activations import (
    activation_formula,
    head_activation_formula,
    rope_table_bytes,
)
from lctrain.planning.state import stage_params


@cache  # pure in its arguments; a layout search asks for the same ones many times
def in_flight_moments(schedule: str, pp: int, microbatches: int, virtual: int,
                      pp_rank: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches whose activations each stage of pipeline rank `pp_rank` keeps (in
    `rank_stages` order) each time, from its warm-up's end on, the rank has just run a forward
    (and under the interleaved schedules each time it runs a backward of the drain, where the
    sends it holds grow while its activations shrink): its peak is one of them. Activations live from a micro-batch's forward to its backward, to
    its weight gradient W under the zero-bubble schedules (torch's input-gradient step keeps the
    graph for W: `stage_backward_input`), in the orders torch 2.13's schedules build."""
    p, m, v, r = pp, microbatches, virtual, pp_rank
    if p == 1:  # no pipeline: one micro-batch at a time through the whole model
        return ((1,) * len(rank_stages(0, 1, v, schedule)),)
    if schedule == "gpipe":  # every forward before the first backward (docs/parallelism.md §13)
        return ((m,),)
    if schedule == "1f1b":  # p - r warm-up forwards, then a backward after each forward (§13)
        return ((min(m, p - r),),)
    if schedule == "zbv":  # 2p: at the first forward of stage 2p-1-r, then at each of stage r
        return ((2 * p - r - 1, r + 1), (2 * p - r, r))
    # interleaved: w = (v-1) q + 2 (p-1-r) warm-up chunk forwards, q micro-batches per round,
    # then a forward and a backward per op: w + 1 at each moment; zero bubble: (p-1-r) and each
    # W r ops behind its backward: (v-1) q + p. The k-th forward runs chunk (k // q) mod v, the
    # k-th backward chunk v-1 - (k // q) mod v (docs/parallelism.md §13).
    q, warmup, on_chunk = _interleaved(schedule, p, m, v, r)
    lag = r if schedule == "zero_bubble" else 0
    return tuple(tuple(on_chunk(min(k + 1, m * v), j)
                       - on_chunk(min(max(0, k - warmup - lag), m * v), v - 1 - j)
                       for j in range(v)) for k in _moments(warmup, m * v))


def _interleaved(schedule: str, p: int, m: int, v: int, r: int):
    """(q, w, on_chunk) of an interleaved schedule at pipeline rank r: q micro-batches per
    round, w warm-up chunk forwards, and on_chunk(n, j), of the rank's first n chunk ops those
    on chunk j."""
    q = m // max(1, m // p)
    warmup = min((v - 1) * q + (2 if schedule == "interleaved_1f1b" else 1) * (p - 1 - r), m * v)

    def on_chunk(n: int, j: int) -> int:
        cycles, rest = divmod(n, q * v)
        return cycles * q + min(q, max(0, rest - j * q))

    return q, warmup, on_chunk


def _moments(warmup: int, chunks: int) -> range:
    """The op indices k of an interleaved schedule's moments: after its warm-up, each forward
    (k < chunks: the k-th chunk forward has run, then its backward follows), then each backward
    of the drain (k >= chunks: forwards are done, backward k - warmup is next)."""
    return range(min(warmup, chunks - 1), chunks + warmup)


@cache
def passes_at_moments(schedule: str, pp: int, microbatches: int, virtual: int,
                      pp_rank: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] | None:
    """For each moment of `in_flight_moments` (in its order), the forwards and the input-
    gradient passes (B) each stage of pipeline rank `pp_rank` has run by then, for the
    interleaved schedules (interleaved_1f1b, zero_bubble), whose sends all stay until the step
    ends; None for the others (their sends are waited for soon; ZBV's two moments come from its
    peak alone)."""
    if pp == 1 or schedule not in ("interleaved_1f1b", "zero_bubble"):
        return None
    p, m, v, r = pp, microbatches, virtual, pp_rank
    _, warmup, on_chunk = _interleaved(schedule, p, m, v, r)
    return tuple((tuple(on_chunk(min(k + 1, m * v), j) for j in range(v)),
                  tuple(on_chunk(min(max(0, k - warmup), m * v), v - 1 - j) for j in range(v)))
                 for k in _moments(warmup, m * v))


def backward_stages(schedule: str, pp: int, microbatches: int, virtual: int,
                    pp_rank: int) -> list[int | None]:
    """At each moment of `in_flight_moments`, the position (in `rank_stages` order) of the
    stage whose backward the rank runs next, for the interleaved schedules (the b-th backward
    runs chunk (b // q) mod v, its stage v - 1 less that); None where it is not known (the
    other schedules), which counts every stage's working set."""
    p, m, v, r = pp, microbatches, virtual, pp_rank
    if p == 1 or schedule not in ("interleaved_1f1b", "zero_bubble"):
        return [None] * len(in_flight_moments(schedule, pp, microbatches, virtual, pp_rank))
    q, warmup, _ = _interleaved(schedule, p, m, v, r)
    return [v - 1 - (max(0, k - warmup) // q) % v for k in _moments(warmup, m * v)]


def accumulating_share(cfg: LctrainConfig, world_size: int, pp_rank: int) -> list[float]:
    """At each moment of `in_flight_moments`, the share of the rank's parameters (by stage)
    whose stage has run a backward pass in the step by then, and so holds gradients accumulated
    between micro-steps (`accumulated_grad_bytes`): under the interleaved schedules a rank's
    later stages run their first backward before its earlier ones; 1 for the others."""
    p = cfg.parallel
    args = (p.pp_schedule, p.pp, derive(cfg, world_size).grad_accum, p.pp_virtual_stages,
            pp_rank)
    passes = passes_at_moments(*args)
    if passes is None:
        return [1.0] * len(in_flight_moments(*args))
    sizes = [stage_params(cfg, s) for s in stages_of(cfg, pp_rank)]
    return [sum(n for n, b in zip(sizes, bwd) if b) / sum(sizes) for _, bwd in passes]


def peak_in_flight(moments: tuple[tuple[int, ...], ...],
                   stage_bytes: list[float]) -> tuple[int, ...]:
    """The moment of `in_flight_moments` that keeps the most bytes, one micro-batch keeping
    `stage_bytes` on each stage (the first such moment)."""
    return max(moments, key=lambda counts: sum(c * b for c, b in zip(counts, stage_bytes)))


def stage_activation_bytes(cfg: LctrainConfig, world_size: int, batch: int, stage: int) -> float:
    """Bytes one micro-batch keeps for the backward on pipeline stage `stage`: its blocks, and the
    loss head (`head_activation_formula`) on the last stage, the RoPE tables alone on the others
    (every stage computes its own); less the stage input when it arrives in a receive buffer
    (`pipeline_buffer_bytes` counts those) and the first block keeps that very tensor on the
    device: its norm's input, or the input a checkpointed block keeps (docs/parallelism.md §13)."""
    stages, t = split_layers(cfg), cfg.train
    total = sum(n * activation_formula(cfg, world_size, batch, i)
                for i, n in layer_kinds(cfg.model, stages[stage]))
    if stage == len(stages) - 1:
        total += head_activation_formula(cfg, world_size, batch)
    elif cfg.parallel.pp > 1:
        total += rope_table_bytes(cfg, world_size, batch)
    if _receives(cfg, stage, -1) and not t.offload_activations:
        total -= _stage_io_bytes(cfg, world_size, batch)
    return total


def pipeline_buffer_bytes(cfg: LctrainConfig, world_size: int, batch: int, pp_rank: int) -> float:
    """The receive buffers torch's PipelineStage allocates on its first step and keeps, one per
    micro-batch of the step (`_setup_forward_recv_info`, `_create_grad_recv_info`): for each
    stage of the rank whose previous stage runs on another rank, the activations
    [B, S/(cp*tp) with SP else S/cp, D] in the residual dtype; for each whose next stage does,
    their gradients, alike (docs/parallelism.md §13)."""
    m = derive(cfg, world_size).grad_accum
    links = sum(_receives(cfg, s, -1) + _receives(cfg, s, 1) for s in stages_of(cfg, pp_rank))
    return links * m * _stage_io_bytes(cfg, world_size, batch)


def pipeline_send_bytes(cfg: LctrainConfig, world_size: int, batch: int, pp_rank: int
                        ) -> list[float]:
    """What the rank's sends and stage outputs hold beyond the blocks' kept bytes, at each
    moment of `in_flight_moments`. A stage keeps its output until that micro-batch's backward,
    and a send keeps its tensor until it is waited for, as NCCL does. torch's interleaved
    schedules (interleaved_1f1b, zero_bubble) wait for every send at the end of the step, so
    each output sent forward and each input gradient sent back stays until then: one for every
    forward and B pass the rank has run by that moment (`passes_at_moments`) on a stage whose
    neighbour runs on another rank. 1F1B and GPipe wait for each send soon, and ZBV's peak
    comes before its backward passes: the outputs in flight of each stage whose next stage runs
    elsewhere, and one input gradient being sent back per link (docs/parallelism.md §13)."""
    p = cfg.parallel
    stages = stages_of(cfg, pp_rank)
    forward = [_receives(cfg, s, 1) for s in stages]  # the next stage on another rank
    backward = [_receives(cfg, s, -1) for s in stages]  # the previous one
    m = derive(cfg, world_size).grad_accum
    args = (p.pp_schedule, p.pp, m, p.pp_virtual_stages, pp_rank)
    passes = passes_at_moments(*args)
    if passes is None:
        held = [sum(n for n, sends in zip(counts, forward) if sends) + sum(backward)
                for counts in in_flight_moments(*args)]
    else:
        held = [sum(f * sends for f, sends in zip(fwd, forward))
                + sum(b * sends for b, sends in zip(bwd, backward)) for fwd, bwd in passes]
    io = _stage_io_bytes(cfg, world_size, batch)
    return [n * io for n in held]


def _receives(cfg: LctrainConfig, stage: int, step: int) -> bool:
    """Whether `stage` receives from its neighbour `stage + step` (-1: activations, 1:
    gradients): the neighbour exists and runs on another pipeline rank."""
    neighbour = stage + step
    if not 0 <= neighbour < stage_count(cfg):
        return False
    return rank_of(cfg, neighbour) != rank_of(cfg, stage)


def _stage_io_bytes(cfg: LctrainConfig, world_size: int, batch: int) -> float:
    """Bytes of one micro-batch's hidden state between stages, [B, S/(cp*s), D] (s = tp with SP)
    in the residual dtype."""
    p = cfg.parallel
    s = p.tp if (p.sp and p.tp > 1) else 1
    r = dtype_bytes(cfg, world_size)[1]
    return batch * cfg.train.seq_len // p.cp // s * cfg.model.dim * r
