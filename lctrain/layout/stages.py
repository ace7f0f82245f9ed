"""Pipeline stages as pure numbers: which layers each stage holds, which pipeline rank runs each
stage, and the idle fraction (bubble) of each schedule (docs/parallelism.md §13).

The model is cut into pp x v contiguous stages (v = parallel.pp_virtual_stages). The embedding
goes with the first stage and the final norm, output layer and loss with the last. Without an
explicit parallel.pp_layers the cut minimises the most expensive stage, with costs in training
FLOPs per token (`lctrain.config.model_size.layer_costs`: a block costs its matmuls plus causal
attention over the whole sequence, the output layer its [D, V] matmul, the embedding a row
lookup; docs/parallelism.md §13).
"""

from __future__ import annotations

from functools import cache

from lctrain.config import LctrainConfig, ModelConfig
from lctrain.config.model_size import unit_costs

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules that run one stage per pipeline rank."""


def stage_count(cfg: LctrainConfig) -> int:
    return cfg.parallel.pp * cfg.parallel.pp_virtual_stages


def split_layers(cfg: LctrainConfig) -> tuple[tuple[int, ...], ...]:
    """Global layer ids of every stage, in pipeline order (parallel.pp_layers, or balanced)."""
    explicit = cfg.parallel.pp_layers
    if explicit:
        return _layer_ids(tuple(explicit))
    m = cfg.model  # (balanced_counts, without the copy to a list: a search asks very often)
    return _layer_ids(_best_split(m.n_layers, stage_count(cfg),
                                  *unit_costs(m, cfg.train.seq_len)))


@cache  # a layout search asks for the same split many times
def _layer_ids(counts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return tuple(tuple(range(start, start + c)) for start, c in zip(starts, counts))


def balanced_counts(m: ModelConfig, seq_len: int, stages: int) -> list[int]:
    """Layers per stage (each at least one) minimising the largest stage cost, the embedding
    counted in the first stage and the output layer in the last; ties go to earlier stages
    holding fewer layers (the first stage also keeps its micro-batches in flight longest)."""
    return list(_best_split(m.n_layers, stages, *unit_costs(m, seq_len)))


@cache
def _best_split(layers: int, stages: int, first_extra: float, block: float,
                last_extra: float) -> tuple[int, ...]:
    # max stage cost of cutting `left` layers into `k` stages where the first is stage `index`
    @cache
    def best(left: int, k: int, index: int) -> tuple[float, tuple[int, ...]]:
        if k == 1:
            cost = left * block + (first_extra if index == 0 else 0) + last_extra
            return cost, (left,)
        options = []
        for take in range(1, left - k + 2):
            cost = take * block + (first_extra if index == 0 else 0)
            rest_cost, rest = best(left - take, k - 1, index + 1)
            options.append((max(cost, rest_cost), (take, *rest)))
        cost, split = min(options)
        return cost, split

    return best(layers, stages, 0)[1]


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in order: looped (r, r + pp, ...) or, for zbv,
    a V (r and 2 pp - 1 - r: the first and the last stage on rank 0)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(virtual)]


def stage_rank(stage: int, pp: int, virtual: int, schedule: str) -> int:
    """The pipeline rank that runs `stage` (the inverse of `rank_stages`)."""
    if schedule == "zbv":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stages_of(cfg: LctrainConfig, pp_rank: int) -> list[int]:
    """`rank_stages` of pipeline rank `pp_rank` under cfg's schedule."""
    p = cfg.parallel
    return rank_stages(pp_rank, p.pp, p.pp_virtual_stages, p.pp_schedule)


def rank_of(cfg: LctrainConfig, stage: int) -> int:
    """`stage_rank` of `stage` under cfg's schedule."""
    p = cfg.parallel
    return stage_rank(stage, p.pp, p.pp_virtual_stages, p.pp_schedule)


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> float:
    """Idle time / step time of a pipeline rank, stages of equal cost, a backward twice a
    forward, split evenly into input and weight gradients (docs/parallelism.md §13)."""
    p, m, v = pp, microbatches, virtual
    if p == 1:
        return 0.0
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule in ("zero_bubble", "zbv"):  # weight gradients fill two thirds of the bubble
        return (p - 1) / (3 * v * m + p - 1)
    raise ValueError(f"unknown schedule {schedule}")
