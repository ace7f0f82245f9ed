"""The rules of a configuration: `validate(cfg, world_size)` returns every problem at once, before
any process group exists.

Each message names the override to type: the key, the value it has, and a valid alternative.
Field-level rules (allowed values, ranges) come from the schema's field metadata; the rules here
relate fields to each other and to the world size. Rules that depend on a size are skipped while
that size is itself invalid, so one mistake does not produce a cascade of follow-up messages.
Checks of what a config points at on disk (datasets, Hugging Face directories) belong to the
layers that own those formats (`lctrain.data.sources`, `lctrain.models.hf`); `lctrain.commands`
runs them all before launch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

from lctrain.config.cp_algorithms import CP_ALGORITHMS, cp_algorithm
from lctrain.config.deepspeed import conflicts
from lctrain.config.derived import context_stages, load_balance_of, stage_problems, ulysses_degree
from lctrain.config.device_rules import cuda_problems, kernel_device_problems
from lctrain.config.eval_rules import eval_problems, has_validation
from lctrain.config.load_balances import auto_load_balance, split_of
from lctrain.config.model_rules import expert_problems, linear_problems, window_problems
from lctrain.config.schema import LctrainConfig, ModelConfig, ParallelConfig
from lctrain.config.suggest import divisors, nearest_multiple


def _field_checks(node, prefix: str):
    """(problem, blocking) for every field of the dataclass `node` that breaks its metadata;
    blocking problems (a bad name or size) make the cross-field rules meaningless."""
    for f in dataclasses.fields(node):
        key, value = prefix + f.name, getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _field_checks(value, key + ".")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):  # train.stages, data.length_mix, data.mixture
                yield from _field_checks(item, f"{key}[{i}].")
        elif isinstance(value, list) and "min" in f.metadata:  # eval.lengths
            yield from ((f"{key} contains {v}, which must be a positive integer; drop it", True)
                        for v in value if v < f.metadata["min"])
        elif "choices" in f.metadata:
            allowed = f.metadata["choices"]
            if isinstance(value, list):
                yield from ((f"{key} contains {v!r}; pick from {', '.join(allowed)}", True)
                            for v in value if v not in allowed)
            elif value not in allowed:
                yield f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them", True
        elif "min" in f.metadata and value is not None and value < f.metadata["min"]:
            low, hint = f.metadata["min"], f.metadata["hint"]
            fix = hint or f"{key}={low}"
            if low >= 1:
                yield f"{key}={value} must be a positive integer; try {fix}", True
            else:
                yield f"{key}={value} must be >= {low}; try {fix}", False


def field_problems(node, prefix: str = "", blocking_only: bool = False) -> list[str]:
    """Problems of single fields (choices and ranges) of `node` and its sections."""
    return [p for p, blocking in _field_checks(node, prefix) if blocking or not blocking_only]


def _dp(cfg: LctrainConfig) -> list[str]:
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        return [f"parallel.dp={cfg.parallel.dp} must be positive or -1 (derive from the world "
                "size); try parallel.dp=-1"]
    return []


def _world(cfg: LctrainConfig, world_size: int) -> list[str]:
    p = cfg.parallel
    model_par = p.tp * p.cp * p.pp
    shape = f"parallel.tp={p.tp} x cp={p.cp} x pp={p.pp}"
    if p.dp == -1:
        if world_size % model_par:
            return [f"world size {world_size} is not divisible by {shape} = {model_par}; run "
                    f"{nearest_multiple(world_size, model_par)} processes (launch.nproc or "
                    "slurm.nodes x slurm.gpus_per_node) or change the parallel sizes"]
        return []
    if model_par * p.dp != world_size:
        fix = (f"set parallel.dp=-1 (derives dp={world_size // model_par})"
               if world_size % model_par == 0 else f"run {model_par * p.dp} processes")
        return [f"world size {world_size} != {shape} x dp={p.dp} = {model_par * p.dp}; {fix}"]
    return []


def _heads(cfg: LctrainConfig) -> list[str]:
    """Head and width divisibility: RoPE pairs, GQA groups, TP shards, the Ulysses degree."""
    m, p = cfg.model, cfg.parallel
    problems = []
    if m.head_dim is None and m.dim % m.n_heads:
        problems.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; try "
                        f"model.dim={nearest_multiple(m.dim, m.n_heads)} or set model.head_dim")
    elif m.head_dim is None and m.d_head % 2:
        problems.append(f"head dim model.dim / model.n_heads = {m.d_head} must be even "
                        f"for RoPE; try model.dim={nearest_multiple(m.dim, 2 * m.n_heads)}")
    elif m.d_head % 2:
        problems.append(f"model.head_dim={m.head_dim} must be even for RoPE; try "
                        f"model.head_dim={m.head_dim + 1}")
    if m.n_heads % m.n_kv_heads:
        problems.append(f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads="
                        f"{m.n_kv_heads} (GQA groups); try n_kv_heads in {divisors(m.n_heads)}")
    if m.n_kv_heads > m.n_heads:
        problems.append(f"model.n_kv_heads={m.n_kv_heads} exceeds model.n_heads={m.n_heads}")
    if m.n_heads % p.tp:
        problems.append(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={p.tp}; try "
                        f"parallel.tp in {divisors(m.n_heads)}")
    elif m.n_kv_heads % p.tp:
        problems.append(f"model.n_kv_heads={m.n_kv_heads} is not divisible by parallel.tp={p.tp} "
                        f"(each TP rank holds whole KV heads); try parallel.tp in "
                        f"{divisors(m.n_kv_heads)}")
    for key, size in (("model.vocab_size", m.vocab_size), ("model.ffn_dim", m.ffn_dim)):
        if size % p.tp:
            problems.append(f"{key}={size} is not divisible by parallel.tp={p.tp}; try "
                            f"{key}={nearest_multiple(size, p.tp)}")
    u = ulysses_degree(p)
    if u > 1 and m.n_heads % p.tp == 0 and (m.n_heads // p.tp) % u:  # docs/parallelism.md §5
        key = cp_algorithm(p.attention).degree_key
        local = m.n_heads // p.tp
        whole = " or ".join(a.name for a in CP_ALGORITHMS.entries() if a.heads_over == "none")
        problems.append(
            f"{key}={u} with parallel.attention={p.attention} needs the heads per TP rank "
            f"(model.n_heads / parallel.tp = {local}) divisible by the Ulysses degree {u}; try "
            f"{key} in {[d for d in divisors(local) if d > 1] or [1]} or "
            f"parallel.attention={whole}")
    return problems


def _context(cfg: LctrainConfig) -> list[str]:
    """The cp split of the sequence (docs/parallelism.md §3) and parallel.ulysses_degree (read
    by the algorithms whose Ulysses degree it sets: USP)."""
    p, s = cfg.parallel, cfg.train.seq_len
    problems = []
    readers = " or ".join(a.name for a in CP_ALGORITHMS.entries()
                          if a.heads_over == "ulysses_degree")
    reads_degree = cp_algorithm(p.attention).heads_over == "ulysses_degree"
    if p.ulysses_degree != 1 and not reads_degree:
        problems.append(f"parallel.ulysses_degree={p.ulysses_degree} is only used with "
                        f"parallel.attention={readers} (got {p.attention}); set "
                        f"parallel.ulysses_degree=1 or parallel.attention={readers}")
    if reads_degree and p.cp % p.ulysses_degree:
        problems.append(f"parallel.ulysses_degree={p.ulysses_degree} does not divide parallel.cp="
                        f"{p.cp} (ring degree = cp / ulysses_degree); try ulysses_degree in "
                        f"{divisors(p.cp)}")
    balance = load_balance_of(cfg)
    split, fixed = split_of(balance), auto_load_balance(False)
    if split.per_row and not cfg.data.document_masking:
        problems.append(f"parallel.load_balance={balance} splits each sequence by its documents "
                        f"and needs data.document_masking=true; set it, or use "
                        f"parallel.load_balance={fixed}")
    units = p.cp // ulysses_degree(p) if p.cp % ulysses_degree(p) == 0 else 1
    if s < split.min_seq_len(units):
        problems.append(f"parallel.load_balance={balance} over {units} balance units (the ring "
                        f"degree) needs train.seq_len >= 2 x {units}^2 = {2 * units * units} "
                        f"(docs/parallelism.md §24); got {s}: raise train.seq_len or use "
                        f"parallel.load_balance={fixed}")
    needs, why = 1, []
    if p.cp > 1:
        chunks = split.chunks(p.cp)
        needs = chunks
        named = balance if p.load_balance == balance else f"auto ({balance})"
        why.append(f"parallel.cp={p.cp} with load_balance={named} splits it into "
                   f"{chunks} {'equal parts' if split.per_row else 'chunks'}")
    if p.sp and p.tp > 1:
        needs = math.lcm(needs, p.cp * p.tp)
        why.append(f"parallel.sp=true splits each cp shard over parallel.tp={p.tp}")
    if s % needs:
        problems.append(f"train.seq_len={s} must be a multiple of {needs} ({'; '.join(why)}); "
                        f"try train.seq_len={nearest_multiple(s, needs)}")
    return problems


def _batch(cfg: LctrainConfig, world_size: int) -> list[str]:
    p, t = cfg.parallel, cfg.train
    dp = p.dp if p.dp != -1 else world_size // (p.tp * p.cp * p.pp)
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        return [f"train.global_batch={t.global_batch} is not divisible by train.micro_batch="
                f"{t.micro_batch} x dp={dp} = {per_step}; try train.global_batch="
                f"{nearest_multiple(t.global_batch, per_step)}"]
    accum = t.global_batch // per_step
    if cfg.eval.every and has_validation(cfg) and cfg.eval.val_sequences % per_step:
        return [f"eval.val_sequences={cfg.eval.val_sequences} is not divisible by "
                f"train.micro_batch={t.micro_batch} x dp={dp} = {per_step}; try "
                f"eval.val_sequences={nearest_multiple(cfg.eval.val_sequences, per_step)}"]
    problems = _engine(cfg, dp)
    if p.pp > 1:
        problems += _pipeline_micro_batches(p, accum, per_step)
    return problems


def _engine(cfg: LctrainConfig, dp: int) -> list[str]:
    """What each data-parallel engine can reduce (only when a dp x cp group reduces at all)."""
    p, problems = cfg.parallel, []
    if p.dp_engine == "deepspeed":
        problems += _deepspeed(cfg, cfg.train.global_batch // (cfg.train.micro_batch * dp))
    if dp * p.cp == 1:
        return problems
    if p.dp_engine == "ddp" and p.tp > 1:
        problems.append(f"parallel.dp_engine=ddp with parallel.tp={p.tp}: DDP cannot reduce the "
                        "tensor-parallel (DTensor) weights; set parallel.dp_engine=fsdp")
    if p.pp > 1 and p.pp_schedule in ("zero_bubble", "zbv"):
        problems.append(f"parallel.pp_schedule={p.pp_schedule} with dp x cp = {dp * p.cp}: torch's "
                        "zero-bubble schedules compute weight gradients after the point where "
                        f"{p.dp_engine.upper()} reduces them, and the reduced gradients come out "
                        "wrong (measured with torch 2.13, FSDP and DDP alike); use "
                        "parallel.pp_schedule=interleaved_1f1b, or zero bubble with "
                        "parallel.dp=1 and parallel.cp=1")
    return problems


def _deepspeed(cfg: LctrainConfig, grad_accum: int) -> list[str]:
    """The DeepSpeed engine: ZeRO's options, and the layouts it runs with lctrain."""
    p, ds, problems = cfg.parallel, cfg.deepspeed, []
    if ds.zero_stage > 3:
        problems.append(f"deepspeed.zero_stage={ds.zero_stage} must be 1, 2 or 3")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        problems.append(f"deepspeed.offload_param={ds.offload_param} offloads ZeRO-3's "
                        f"partitioned weights (got deepspeed.zero_stage={ds.zero_stage}); set "
                        "deepspeed.zero_stage=3 or deepspeed.offload_param=none")
    for size, what in ((p.tp, "tp"), (p.pp, "pp")):
        if size > 1:
            problems.append(f"parallel.dp_engine=deepspeed with parallel.{what}={size}: "
                            "DeepSpeed's engine cannot shard lctrain's tensor-parallel (DTensor) "
                            "weights or run its pipeline stages; set parallel.dp_engine=fsdp "
                            f"(FSDP composes with {what}) or parallel.{what}=1")
    return problems + conflicts(cfg, grad_accum)


def offload_problems(cfg: LctrainConfig) -> list[str]:
    """parallel.offload_state: what each engine can keep on the host (docs/parallelism.md
    §22)."""
    p = cfg.parallel
    if p.offload_state == "none":
        return []
    if p.dp_engine == "deepspeed":
        return [f"parallel.offload_state={p.offload_state} with parallel.dp_engine=deepspeed: "
                "DeepSpeed offloads through its own keys; set parallel.offload_state=none and "
                "deepspeed.offload_optimizer=cpu (and deepspeed.offload_param=cpu with "
                "deepspeed.zero_stage=3)"]
    if p.offload_state != "optimizer+params":
        return []
    problems = []
    if p.dp_engine != "fsdp":
        problems.append(f"parallel.offload_state=optimizer+params with parallel.dp_engine="
                        f"{p.dp_engine}: only FSDP keeps its weights in host memory (DDP holds "
                        "them whole on the device); set parallel.dp_engine=fsdp or "
                        "parallel.offload_state=optimizer")
    if p.pp > 1:
        problems.append(f"parallel.offload_state=optimizer+params with parallel.pp={p.pp}: "
                        "torch's pipeline stages defer FSDP's gradient reduction to the last "
                        "micro-batch, which keeps unsharded gradients on the device; set "
                        "parallel.offload_state=optimizer or parallel.pp=1")
    return problems


def _pipeline_micro_batches(p, accum: int, per_step: int) -> list[str]:
    """The schedules' needs in micro-batches per step (the accumulation micro-batches)."""
    have = (f"train.global_batch / (micro_batch x dp) = {accum} micro-batches per step; try "
            f"train.global_batch=")
    if p.pp_schedule == "1f1b" and accum < p.pp:
        return [f"parallel.pp_schedule=1f1b at parallel.pp={p.pp} needs at least {p.pp} "
                f"micro-batches per step; {have}{p.pp * per_step}"]
    if p.pp_schedule == "zbv" and accum < 2 * p.pp:
        return [f"parallel.pp_schedule=zbv at parallel.pp={p.pp} needs at least {2 * p.pp} "
                f"micro-batches per step (one per stage); {have}{2 * p.pp * per_step}"]
    rounds = max(1, accum // p.pp)
    if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and accum % rounds:
        return [f"parallel.pp_schedule={p.pp_schedule} runs micro-batches in rounds of "
                f"parallel.pp={p.pp}: {accum} is neither below {p.pp} nor a multiple of "
                f"{rounds} rounds; {have}{rounds * p.pp * per_step}"]
    return []


def _pipeline(cfg: LctrainConfig) -> list[str]:
    """Stages: how many, which layers, and the stages per rank each schedule runs."""
    m, p = cfg.model, cfg.parallel
    v, problems = p.pp_virtual_stages, []
    if p.pp == 1:
        return []
    stages = p.pp * v
    if p.pp_schedule in ("gpipe", "1f1b") and v != 1:
        problems.append(f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank, not "
                        f"parallel.pp_virtual_stages={v}; set parallel.pp_schedule="
                        "interleaved_1f1b or parallel.pp_virtual_stages=1")
    if p.pp_schedule == "zbv" and v != 2:
        problems.append(f"parallel.pp_schedule=zbv runs two stages per rank (a V); set "
                        f"parallel.pp_virtual_stages=2 (got {v})")
    if p.pp_schedule in ("zero_bubble", "zbv") and \
            cfg.train.activation_checkpointing == "selective":
        problems.append(f"parallel.pp_schedule={p.pp_schedule} with train.activation_"
                        "checkpointing=selective: the zero-bubble schedules run each block's "
                        "backward in two passes (input gradients, then weight gradients), and "
                        "torch's selective checkpointing allows one backward per block; use "
                        "train.activation_checkpointing=full (recomputed in each pass) or none, "
                        "or parallel.pp_schedule=interleaved_1f1b")
    if p.pp_layers is not None:
        if len(p.pp_layers) != stages or any(n < 1 for n in p.pp_layers) or \
                sum(p.pp_layers) != m.n_layers:
            problems.append(f"parallel.pp_layers={list(p.pp_layers)} must give {stages} stages "
                            f"(parallel.pp={p.pp} x pp_virtual_stages={v}) at least one layer "
                            f"each, {m.n_layers} layers in all (model.n_layers); try "
                            f"parallel.pp_layers=null (balanced by cost)")
    elif m.n_layers < stages:
        problems.append(f"model.n_layers={m.n_layers} cannot fill {stages} stages (parallel.pp="
                        f"{p.pp} x pp_virtual_stages={v}) with a layer each; try parallel.pp="
                        f"{max(1, m.n_layers // v)} or fewer virtual stages")
    return problems


def _scalars(cfg: LctrainConfig) -> list[str]:
    """Values bounded by other values, and the checkpoint and model sources."""
    o, ck, m = cfg.optim, cfg.checkpoint, cfg.model
    problems = []
    if o.lr <= 0:
        problems.append(f"optim.lr={o.lr} must be > 0; try optim.lr=3e-4")
    elif not 0 <= o.min_lr <= o.lr:
        problems.append(f"optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]; try "
                        f"optim.min_lr={o.lr / 10:g}")
    for key, v in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= v < 1:
            problems.append(f"{key}={v} must lie in [0, 1); try {key}=0.9")
    if ck.load is not None and not os.path.isdir(ck.load):
        problems.append(f"checkpoint.load={ck.load} is not a directory; give a checkpoint "
                        "directory such as <run dir>/checkpoints/step-00000100")
    if ck.load is not None and ck.resume == "auto":
        problems.append(f"checkpoint.load={ck.load} and checkpoint.resume=auto both choose the "
                        "checkpoint; set checkpoint.resume=none to load that one")
    if ck.load_model_only and ck.load is None and ck.resume == "none":
        problems.append("checkpoint.load_model_only=true needs checkpoint.load=<checkpoint dir>")
    if m.rope_type != "default" and m.rope_factor < 1:
        problems.append(f"model.rope_factor={m.rope_factor} must be >= 1 for rope_type="
                        f"{m.rope_type}; try model.rope_factor=8")
    if m.rope_type == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                        f"model.rope_low_freq_factor={m.rope_low_freq_factor}; try 4.0 and 1.0")
    t = cfg.train
    if t.offload_activations and t.activation_checkpointing != "full":
        problems.append(f"train.offload_activations=true offloads the block inputs that full "
                        f"checkpointing keeps (got train.activation_checkpointing="
                        f"{t.activation_checkpointing}); set train.activation_checkpointing=full")
    problems += init_from_problems(m)
    return problems


def init_from_problems(m: ModelConfig) -> list[str]:
    """A model.init_from that is not a directory (the model's every other field comes from it,
    so nothing else about the model can be judged without it)."""
    if m.init_from is None or os.path.isdir(m.init_from):
        return []
    return [f"model.init_from={m.init_from} is not a directory; give a Hugging Face model "
            "directory (config.json + *.safetensors)"]


TENSORBOARD_INSTALL = "pip install 'lctrain[tensorboard]'"


def _logging(cfg: LctrainConfig) -> list[str]:
    """The logging outputs: a peak that is a rate, and the optional tensorboard package
    present when asked for (found without importing it)."""
    lg, problems = cfg.logging, []
    if lg.peak_tflops is not None and not lg.peak_tflops > 0:
        problems.append(f"logging.peak_tflops={lg.peak_tflops} must be > 0 (TFLOP/s of one "
                        "rank); try logging.peak_tflops=989 (H100 bf16, dense) or null")
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(f"logging.tensorboard=true but tensorboard is not installed; run "
                        f"{TENSORBOARD_INSTALL}, or set logging.tensorboard=false")
    return problems


def _length_mix(cfg: LctrainConfig) -> list[str]:
    """data.length_mix: buckets of growing max_len, the last one open, positive weights, and
    only for token shards (as data.packing=best_fit)."""
    d, problems = cfg.data, []
    if (d.length_mix or d.packing != "stream") and d.source != "tokens":
        problems.append(f"data.length_mix and data.packing=best_fit choose and pack documents of "
                        f"token shards; data.source={d.source} has none: set data.source=tokens "
                        "or data.length_mix=[] data.packing=stream")
    if not d.length_mix:
        return problems
    bounds = [b.max_len for b in d.length_mix]
    problems += [f"data.length_mix[{i}].weight={b.weight} must be > 0; try 1.0"
                 for i, b in enumerate(d.length_mix) if not b.weight > 0]
    if bounds[-1] is not None:
        problems.append(f"data.length_mix's last bucket ends at max_len={bounds[-1]}; make it "
                        "open (max_len: null) so that every document has a bucket")
    finite = bounds[:-1]
    if None in finite or any(b < 1 for b in finite) or finite != sorted(set(finite)):
        problems.append(f"data.length_mix max_len values {bounds} must be positive and "
                        "increasing, with null only last")
    return problems


def _stages(cfg: LctrainConfig, world_size: int) -> list[str]:
    """train.stages: the schedule, then every stage's own layout, named by its stage."""
    problems = stage_problems(cfg)
    if problems or not cfg.train.stages:
        return problems
    for stage in context_stages(cfg)[:-1]:  # the last one is cfg's own layout
        seq = stage.cfg.train.seq_len
        problems += [f"train.stages[{stage.index}] (seq_len={seq}): {p}"
                     for p in validate(stage.cfg, world_size)]
    return problems


def validate(cfg: LctrainConfig, world_size: int) -> list[str]:
    """Every problem of `cfg` for `world_size` ranks (empty list = valid)."""
    problems = field_problems(cfg, blocking_only=True) + _dp(cfg)
    if world_size < 1:
        problems.append(f"world size {world_size} must be positive")
    later = ([p for p in field_problems(cfg) if p not in problems] + _scalars(cfg)
             + _logging(cfg) + _length_mix(cfg))
    if problems:  # the rules below divide by these sizes or branch on these names
        return problems + later if world_size >= 1 else problems
    problems = layout_problems(cfg, world_size, later)
    return problems + ([] if problems else _stages(cfg, world_size))


def layout_problems(cfg: LctrainConfig, world_size: int, later: list[str] | None = None
                    ) -> list[str]:
    """The rules between fields (world size, heads, context, pipeline, batch, CUDA) of a config
    whose fields each hold an allowed value (`validate` checks them first; a layout search that
    only changes sizes and names to allowed values calls this alone)."""
    if later is None:
        later = _scalars(cfg) + _logging(cfg) + _length_mix(cfg)
    world = _world(cfg, world_size)
    problems = (world + _heads(cfg) + window_problems(cfg) + linear_problems(cfg)
                + expert_problems(cfg, world_size)
                + _context(cfg) + _pipeline(cfg) + later
                + eval_problems(cfg) + offload_problems(cfg))
    if cfg.train.device == "cuda":  # train.device=auto is resolved where the run starts
        problems += cuda_problems(cfg)
    elif cfg.train.device == "cpu":
        problems += kernel_device_problems(cfg, "cpu")
    if not world:
        problems += _batch(cfg, world_size)
    return problems


_DEFAULT = ParallelConfig()
"""The parallel.* defaults (what a cp = 1 layout ignores unless changed)."""


def warnings_for(cfg: LctrainConfig) -> list[str]:
    """Settings that are valid but do nothing; printed, never fatal."""
    p = cfg.parallel
    out = []
    if p.sp and p.tp == 1:
        out.append("parallel.sp=true has no effect with parallel.tp=1 (SP splits activations "
                   "inside the TP group)")
    if p.pp == 1 and (p.pp_schedule != "1f1b" or p.pp_virtual_stages != 1
                      or p.pp_layers is not None):
        out.append("parallel.pp_schedule, pp_virtual_stages and pp_layers are ignored with "
                   "parallel.pp=1")
    if p.cp == 1 and (p.attention != _DEFAULT.attention
                      or p.ulysses_degree != _DEFAULT.ulysses_degree):
        out.append(f"parallel.attention={p.attention} is ignored with parallel.cp=1")
    if has_validation(cfg) and not cfg.eval.every:
        out.append("validation data is set but eval.every=0: no validation loss is computed "
                   "(data.val_fraction still keeps its documents out of training)")
    return out
