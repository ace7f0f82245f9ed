"""`plan.search`: every valid layout of a model for a world size, ranked by predicted tokens/s.

For each (tp, sp, cp, attention, Ulysses degree, linear layers' CP, pp, schedule, dp, engine)
that passes the layout rules (`layout_problems`), the checkpointing mode and tiling with the
most predicted tokens/s among those that fit `plan.gpu_memory_gib` (the plan's itemised total with its
allocator allowance, on the pipeline rank with the most) is kept; layouts where none fits are
dropped. Without checkpointing or tiling nothing is recomputed, so when that fits no other
variant is tried.
What is searched and what is not is in docs/parallelism.md §17. Pure arithmetic on configs, no
device: thousands of candidates per second per core, the layouts shared among forked workers
(one per core) when there are many.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
from dataclasses import dataclass

from lctrain.config import LctrainConfig, ParallelConfig, derive
from lctrain.config.cp_algorithms import CP_ALGORITHMS, cp_algorithm
from lctrain.config.schema import LINEAR
from lctrain.config.validation import layout_problems, offload_problems
from lctrain.planning.estimate import rank_memory
from lctrain.planning.hardware import Hardware
from lctrain.planning.timing import StepTime, predict_step_time

SCHEDULES = (("1f1b", 1), ("gpipe", 1), *(("interleaved_1f1b", v) for v in (1, 2, 4)),
             *(("zero_bubble", v) for v in (1, 2, 4)), ("zbv", 2))
"""(parallel.pp_schedule, parallel.pp_virtual_stages) tried at pp > 1: the looped schedules
at 1, 2 and 4 stages per rank."""
ENGINES = (("fsdp", None), ("ddp", None), ("deepspeed", 1), ("deepspeed", 2), ("deepspeed", 3))
"""(parallel.dp_engine, deepspeed.zero_stage) tried (DeepSpeed without offload)."""
SEARCHED_KEYS = frozenset({
    *(f"parallel.{k}" for k in ("tp", "sp", "cp", "attention", "ulysses_degree", "linear_cp",
                                "pp", "pp_schedule", "pp_virtual_stages", "pp_layers", "dp",
                                "dp_engine", "offload_state", "ep")),
    "deepspeed.zero_stage",
    *(f"train.{k}" for k in ("activation_checkpointing", "offload_activations", "loss_chunk",
                             "mlp_chunk"))})
"""The keys a candidate's overrides set: what `search(fixed=...)` can hold fixed."""
ENUMERATED = ("parallel.tp", "parallel.cp", "parallel.attention", "parallel.ulysses_degree",
              "parallel.linear_cp", "parallel.pp", "parallel.pp_schedule", "parallel.pp_virtual_stages",
              "parallel.dp", "parallel.dp_engine", "deepspeed.zero_stage")
"""The searched keys whose every value the enumeration tries: a fixed one filters the layouts;
the others (parallel.sp, parallel.pp_layers and the train.* keys), fixed, are set instead."""
CHECKPOINTING = (("none", False), ("selective", False), ("full", False), ("full", True))
"""(train.activation_checkpointing, train.offload_activations) tried: the block inputs full
checkpointing keeps may go to the host."""
OFFLOAD_STATE = ("none", "optimizer", "optimizer+params")
"""parallel.offload_state tried, for the engines that can (`offload_problems`)."""
TILE_CHUNKS = 8
TILE_MAX_TOKENS = 4096
"""With tiling on, train.loss_chunk and train.mlp_chunk cut a rank's sequence into TILE_CHUNKS
chunks, of at most TILE_MAX_TOKENS tokens (a chunk's [tokens, V/tp] logits of a 128K vocabulary
are then a few GB)."""


@dataclass(frozen=True)
class Candidate:
    overrides: dict[str, object]
    """The command-line overrides (key -> value) that select this layout."""
    step: StepTime
    memory_gib: float
    """The itemised total of the pipeline rank with the most, allocator allowance included."""

    def command_line(self, cfg: LctrainConfig | None = None) -> str:
        """The overrides as command-line arguments; given `cfg`, only those that change it
        (parallel.dp always: the searched world fixes it)."""
        def changes(key: str, value: object) -> bool:
            section, name = key.split(".")
            return key == "parallel.dp" or getattr(getattr(cfg, section), name) != value

        return " ".join(f"{k}={as_override(v)}" for k, v in self.overrides.items()
                        if cfg is None or changes(k, v))


@dataclass(frozen=True)
class SearchResult:
    world_size: int
    ranked: list[Candidate]
    """Fitting candidates, most predicted tokens/s first (less memory first on a tie)."""
    layouts: int
    """Layouts (before checkpointing and tiling) that pass the layout rules."""
    evaluated: int
    """Configurations (layouts x checkpointing x tiling) whose memory was predicted."""
    too_big: int
    """Valid layouts that fit in no checkpointing mode or tiling."""


def as_override(v: object) -> str:
    """`v` as a command-line override's value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(v)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def attentions(cp: int) -> list[tuple[str, int]]:
    """(parallel.attention, parallel.ulysses_degree) for `cp` ranks: every registered algorithm
    at the degrees its entry searches (`CPAlgorithm.searched_degrees`: USP at every Ulysses
    degree strictly between 1 and cp, the others at 1); at cp = 1 the default alone."""
    if cp == 1:
        return [(ParallelConfig().attention, 1)]
    return [(a.name, u) for a in CP_ALGORITHMS.entries() for u in a.searched_degrees(cp)]


def linear_cps(cfg: LctrainConfig, cp: int) -> tuple[str, ...]:
    """parallel.linear_cp for `cp` ranks: both ways (state passing, the head split) for a model
    with linear-attention layers at cp > 1, else the default alone."""
    if cp > 1 and LINEAR in (cfg.model.layer_types or ()):
        return ("state", "heads")
    return (ParallelConfig().linear_cp,)


def layouts(cfg: LctrainConfig, world_size: int, ranks_per_node: int):
    """parallel.* and deepspeed.* overrides of every layout of `world_size` ranks with tp
    inside a node (`ranks_per_node`; 0: one node) and SP whenever tp > 1 (without it TP sends
    the same bytes and computes the same, and keeps more activations: it never ranks
    higher); the linear layers' context parallelism both ways (`linear_cps`)."""
    node = ranks_per_node or world_size
    for tp in divisors(world_size):
        if tp > node or cfg.model.n_heads % tp:
            continue
        for cp in divisors(world_size // tp):
            for pp in divisors(world_size // (tp * cp)):
                if pp > cfg.model.n_layers:
                    continue
                dp = world_size // (tp * cp * pp)
                schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
                for sp, (attention, u), linear_cp, (schedule, v), (engine, stage) in \
                        itertools.product((tp > 1,), attentions(cp), linear_cps(cfg, cp),
                                          schedules, ENGINES):
                    parallel = {"tp": tp, "sp": sp, "cp": cp, "attention": attention,
                                "ulysses_degree": u, "linear_cp": linear_cp, "pp": pp,
                                "pp_schedule": schedule,
                                "pp_virtual_stages": v, "pp_layers": None, "dp": dp,
                                "dp_engine": engine}
                    for ep in expert_degrees(cfg, dp * cp * tp, engine):
                        yield {**parallel, "ep": ep}, ({} if stage is None
                                                       else {"zero_stage": stage})


def expert_degrees(cfg: LctrainConfig, shards: int, engine: str) -> list[int]:
    """parallel.ep values of a layout with `shards` = dp x cp x tp ranks: 1, and for a mixture
    of experts under FSDP or DDP every divisor of both the ranks and the experts."""
    experts = cfg.model.n_experts
    if not experts or engine == "deepspeed":
        return [1]
    return [ep for ep in divisors(shards) if experts % ep == 0]


def _with(cfg: LctrainConfig, parallel: dict, deepspeed: dict, train: dict) -> LctrainConfig:
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, **parallel),
        deepspeed=dataclasses.replace(cfg.deepspeed, **deepspeed),
        train=dataclasses.replace(cfg.train, **train))


def memory_gib(cfg: LctrainConfig, world_size: int) -> float:
    """The itemised device total of the pipeline rank with the most, GiB (`fits`' second)."""
    return fits(cfg, world_size)[1]


def fits(cfg: LctrainConfig, world_size: int) -> tuple[bool, float]:
    """(whether every pipeline rank fits plan.gpu_memory_gib and its node's ranks
    plan.host_memory_gib, the largest device total in GiB)."""
    device, host_fits = 0.0, True
    for r in range(cfg.parallel.pp):
        itemised = rank_memory(cfg, world_size, r)["itemised"]
        device = max(device, itemised["total_gib"])
        host_fits = host_fits and itemised["host"]["verdict"] == "FITS"
    return host_fits and device <= cfg.plan.gpu_memory_gib, device


@dataclass
class _Part:
    """What one worker finds among its share of the layouts: (enumeration index, candidate)
    pairs and the counts of SearchResult."""
    ranked: list[tuple[int, Candidate]] = dataclasses.field(default_factory=list)
    layouts: int = 0
    evaluated: int = 0
    too_big: int = 0


def _allowed(parallel: dict, deepspeed: dict, fixed: dict[str, object]) -> bool:
    """Whether a layout has the value of every fixed key the enumeration varies."""
    values = {f"parallel.{k}": v for k, v in parallel.items()} | {
        f"deepspeed.{k}": v for k, v in deepspeed.items()}
    return all(values[k] == v for k, v in fixed.items() if k in ENUMERATED and k in values)


def _section(fixed: dict[str, object], section: str) -> dict[str, object]:
    """The fixed keys of `section` that are set rather than enumerated, by field name."""
    return {k.split(".", 1)[1]: v for k, v in fixed.items()
            if k.startswith(f"{section}.") and k not in ENUMERATED}


def _search_part(cfg: LctrainConfig, world_size: int, hw: Hardware,
                 share: list[tuple[int, dict, dict]], fixed: dict[str, object]) -> _Part:
    """The best fitting variant of each valid layout in `share` ((index, parallel.*,
    deepspeed.*) overrides), the `fixed` keys held at their values."""
    part = _Part()
    plain = {"activation_checkpointing": "none", "offload_activations": False, "loss_chunk": 0,
             "mlp_chunk": 0}
    set_parallel, set_train = _section(fixed, "parallel"), _section(fixed, "train")
    if set_train.get("offload_activations"):  # the layout's rules: only with full checkpointing
        plain["activation_checkpointing"] = "full"
    offload_states = [set_parallel.pop("offload_state")] if "offload_state" in set_parallel \
        else OFFLOAD_STATE
    for index, parallel, deepspeed in share:
        parallel = {**parallel, **set_parallel}
        layout_cfg = _with(cfg, {**parallel, "offload_state": "none"}, deepspeed,
                           {**plain, **set_train})
        if layout_problems(layout_cfg, world_size):
            continue
        part.layouts += 1
        chunk = max(1, min(TILE_MAX_TOKENS,
                           derive(layout_cfg, world_size).local_seq_len // TILE_CHUNKS))
        tiled = {"loss_chunk": chunk, "mlp_chunk": chunk}
        # the layout rules read the chunks, not the checkpointing mode: one check for each
        tiles = [0] + ([chunk] if not layout_problems(
            dataclasses.replace(layout_cfg, train=dataclasses.replace(
                layout_cfg.train, **{**tiled, **set_train})), world_size) else [])
        states = [o for o in offload_states if not offload_problems(_with(
            layout_cfg, {"offload_state": o}, {}, {}))]
        best = None
        # a variant with more state on the host only adds time: it is sized only where the
        # same checkpointing and tiling with less on the host did not fit
        unfit = list(itertools.product(CHECKPOINTING, tiles))
        for state in states:
            tried, unfit, sized, fitted = unfit, [], set(), set()
            for (mode, to_host), tile in tried:
                train = {"activation_checkpointing": mode, "offload_activations": to_host,
                         "loss_chunk": tile, "mlp_chunk": tile, **set_train}
                if (train["offload_activations"] and train["activation_checkpointing"] != "full"
                        or tuple(train.values()) in sized):
                    continue  # ruled out, or made the same, by what the command line fixed
                if to_host and (mode, tile) in fitted:
                    continue  # the block inputs fit on the device: the host only adds copies
                sized.add(tuple(train.values()))
                candidate_cfg = _with(layout_cfg, {"offload_state": state}, {}, train)
                part.evaluated += 1
                ok, gib = fits(candidate_cfg, world_size)
                if not ok:
                    unfit.append(((mode, to_host), tile))
                    continue
                fitted.add((mode, tile))
                step = predict_step_time(candidate_cfg, world_size, hw)
                if best is None or step.total_s < best.step.total_s:
                    overrides = {f"parallel.{k}": v for k, v in parallel.items()}
                    overrides["parallel.offload_state"] = state
                    overrides |= {f"deepspeed.{k}": v for k, v in deepspeed.items()}
                    overrides |= {f"train.{k}": v for k, v in train.items()}
                    best = Candidate(overrides, step, gib)
                if mode == "none" and not tile and not to_host:  # nothing recomputed
                    unfit = []  # nor offloaded (less offloaded first): no variant is faster
                    break
        if best is None:
            part.too_big += 1
        else:
            part.ranked.append((index, best))
    return part


PARALLEL_FROM = 256
"""Layouts to enumerate before the search shares them among forked workers (one per CPU core
this process may use, at most 8): below it a worker's start costs more than it saves."""


def search(cfg: LctrainConfig, world_size: int, hw: Hardware,
           fixed: dict[str, object] | None = None) -> SearchResult:
    """Every layout of `world_size` ranks for `cfg`'s model, batch and sequence, ranked (ties in
    predicted step time and memory keep the enumeration order); `fixed` (key -> value, keys of
    SEARCHED_KEYS) holds those keys at their values."""
    fixed = fixed or {}
    share = [(i, parallel, deepspeed) for i, (parallel, deepspeed)
             in enumerate(layouts(cfg, world_size, hw.ranks_per_node))
             if _allowed(parallel, deepspeed, fixed)]
    workers = min(8, len(os.sched_getaffinity(0)))
    if workers > 1 and len(share) >= PARALLEL_FROM:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.starmap(_search_part, [(cfg, world_size, hw, share[w::workers], fixed)
                                                for w in range(workers)])
    else:
        parts = [_search_part(cfg, world_size, hw, share, fixed)]
    found = sorted((pair for part in parts for pair in part.ranked),
                   key=lambda pair: (pair[1].step.total_s, pair[1].memory_gib, pair[0]))
    return SearchResult(world_size, [c for _, c in found], sum(p.layouts for p in parts),
                        sum(p.evaluated for p in parts), sum(p.too_big for p in parts))


def layout_label(o: dict[str, object]) -> str:
    """A search candidate's overrides in one short line (tp, cp and its algorithm, the linear
    layers' head split where chosen, pp and its schedule, dp, ep and the engine,
    checkpointing, tiling, what lives on the host)."""
    cp = (f"cp{o['parallel.cp']} {o['parallel.attention']}"
          + (f"(u{o['parallel.ulysses_degree']})"
             if cp_algorithm(o["parallel.attention"]).heads_over == "ulysses_degree" else "")
          + (" linear:heads" if o.get("parallel.linear_cp") == "heads" else "")
          if o["parallel.cp"] > 1 else "cp1")
    pp = (f"pp{o['parallel.pp']} {o['parallel.pp_schedule']}"
          + (f"x{o['parallel.pp_virtual_stages']}" if o["parallel.pp_virtual_stages"] > 1
             else "") if o["parallel.pp"] > 1 else "pp1")
    engine = o["parallel.dp_engine"] + (f"-z{o['deepspeed.zero_stage']}"
                                        if "deepspeed.zero_stage" in o else "")
    ep = f" ep{o['parallel.ep']}" if o.get("parallel.ep", 1) > 1 else ""
    return (f"tp{o['parallel.tp']}{'+sp' if o['parallel.sp'] else ''} {cp} {pp} "
            f"dp{o['parallel.dp']}{ep} {engine} ac={o['train.activation_checkpointing']}"
            + (" tiled" if o["train.loss_chunk"] else "")
            + (" act->host" if o["train.offload_activations"] else "")
            + (f" host:{o['parallel.offload_state']}"
               if o["parallel.offload_state"] != "none" else ""))
