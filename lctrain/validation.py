"""validate(cfg, world_size): every problem of a configuration at once, before any process group.

Each message names the override to type: the key, the value it has, and a valid alternative.
Rules that depend on a size are skipped while that size is itself invalid, so one mistake does
not produce a cascade of follow-up messages.
"""

from __future__ import annotations

import math
import os

from lctrain import config as C
from lctrain.config import LctrainConfig


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest_multiple(x: int, m: int) -> int:
    """The multiple of m closest to x (ties go up), never below m."""
    return max(m, (x + m // 2) // m * m)


def choice_problems(key: str, value: object, allowed: tuple[str, ...]) -> list[str]:
    """[] when `value` is allowed, else the message naming the key and the choices."""
    if value in allowed:
        return []
    return [f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them"]


def _positive(cfg: LctrainConfig) -> list[str]:
    keys = {
        "parallel.tp": cfg.parallel.tp, "parallel.cp": cfg.parallel.cp,
        "parallel.pp": cfg.parallel.pp, "parallel.ulysses_degree": cfg.parallel.ulysses_degree,
        "model.vocab_size": cfg.model.vocab_size, "model.dim": cfg.model.dim,
        "model.n_layers": cfg.model.n_layers, "model.n_heads": cfg.model.n_heads,
        "model.n_kv_heads": cfg.model.n_kv_heads, "model.ffn_dim": cfg.model.ffn_dim,
        "train.steps": cfg.train.steps, "train.seq_len": cfg.train.seq_len,
        "train.micro_batch": cfg.train.micro_batch, "train.global_batch": cfg.train.global_batch,
        "logging.log_every": cfg.logging.log_every, "launch.timeout_s": cfg.launch.timeout_s,
        "slurm.nodes": cfg.slurm.nodes, "slurm.gpus_per_node": cfg.slurm.gpus_per_node,
    }
    problems = [f"{k}={v} must be a positive integer; try {k}=1" for k, v in keys.items() if v < 1]
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        problems.append(f"parallel.dp={cfg.parallel.dp} must be positive or -1 (derive from the "
                        "world size); try parallel.dp=-1")
    if cfg.launch.nproc is not None and cfg.launch.nproc < 1:
        problems.append(f"launch.nproc={cfg.launch.nproc} must be positive; try launch.nproc=null "
                        "(= tp*cp*pp*dp)")
    return problems


def _choices(cfg: LctrainConfig) -> list[str]:
    return (
        choice_problems("parallel.attention", cfg.parallel.attention, C.ATTENTION_ALGORITHMS)
        + choice_problems("parallel.load_balance", cfg.parallel.load_balance, C.LOAD_BALANCE)
        + choice_problems("parallel.dp_engine", cfg.parallel.dp_engine, C.DP_ENGINES)
        + choice_problems("train.dtype", cfg.train.dtype, C.DTYPES)
        + choice_problems("train.device", cfg.train.device, C.DEVICES)
        + choice_problems("train.activation_checkpointing", cfg.train.activation_checkpointing,
                  ("none", "selective", "full"))
        + choice_problems("optim.schedule", cfg.optim.schedule, C.SCHEDULES)
        + choice_problems("data.source", cfg.data.source, C.DATA_SOURCES)
        + choice_problems("data.long_docs", cfg.data.long_docs, C.LONG_DOCS)
        + choice_problems("data.doc_len_dist", cfg.data.doc_len_dist, C.DOC_LEN_DISTS)
        + choice_problems("checkpoint.resume", cfg.checkpoint.resume, C.RESUME_MODES)
        + choice_problems("train.on_nan", cfg.train.on_nan, C.ON_NAN)
        + choice_problems("launch.backend", cfg.launch.backend, ("auto", "gloo", "nccl"))
        + choice_problems("launch.start_method", cfg.launch.start_method, C.START_METHODS)
        + choice_problems("logging.wandb_mode", cfg.logging.wandb_mode, ("online", "offline", "disabled"))
        + choice_problems("plan.format", cfg.plan.format, ("text", "json"))
        + choice_problems("model.rope_type", cfg.model.rope_type, ("default", "linear", "llama3", "yarn"))
    )


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
    m, p = cfg.model, cfg.parallel
    problems = []
    if m.dim % m.n_heads:
        problems.append(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; try "
                        f"model.dim={nearest_multiple(m.dim, m.n_heads)}")
    elif (m.dim // m.n_heads) % 2:
        problems.append(f"head dim model.dim / model.n_heads = {m.dim // m.n_heads} must be even "
                        f"for RoPE; try model.dim={nearest_multiple(m.dim, 2 * m.n_heads)}")
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
    u = C.ulysses_degree(p)
    if u > 1 and m.n_heads % p.tp == 0 and (m.n_heads // p.tp) % u:
        key = "parallel.cp" if p.attention == "ulysses" else "parallel.ulysses_degree"
        local = m.n_heads // p.tp
        problems.append(
            f"{key}={u} with parallel.attention={p.attention} needs the heads per TP rank "
            f"(model.n_heads / parallel.tp = {local}) divisible by the Ulysses degree {u}; try "
            f"{key} in {[d for d in divisors(local) if d > 1] or [1]} or parallel.attention=ring")
    return problems


def _context(cfg: LctrainConfig) -> list[str]:
    p, s = cfg.parallel, cfg.train.seq_len
    problems = []
    if p.ulysses_degree != 1 and p.attention != "usp":
        problems.append(f"parallel.ulysses_degree={p.ulysses_degree} is only used with "
                        f"parallel.attention=usp (got {p.attention}); set parallel.ulysses_degree=1 "
                        "or parallel.attention=usp")
    if p.attention == "usp" and p.cp % p.ulysses_degree:
        problems.append(f"parallel.ulysses_degree={p.ulysses_degree} does not divide parallel.cp="
                        f"{p.cp} (ring degree = cp / ulysses_degree); try ulysses_degree in "
                        f"{divisors(p.cp)}")
    needs, why = 1, []
    if p.cp > 1:
        chunks = 2 * p.cp if p.load_balance == "zigzag" else p.cp
        needs = chunks
        why.append(f"parallel.cp={p.cp} with load_balance={p.load_balance} splits it into "
                   f"{chunks} chunks")
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
    if p.pp > 1 and accum < p.pp:
        return [f"parallel.pp={p.pp} needs at least {p.pp} micro-batches per step to fill the "
                f"pipeline; train.global_batch / (micro_batch x dp) = {accum}; try "
                f"train.global_batch={p.pp * per_step}"]
    return []


def _layers(cfg: LctrainConfig) -> list[str]:
    m, p = cfg.model, cfg.parallel
    if m.n_layers % p.pp:
        return [f"model.n_layers={m.n_layers} is not divisible by parallel.pp={p.pp} (every stage "
                f"holds the same number of layers); try parallel.pp in {divisors(m.n_layers)}"]
    return []


def _scalars(cfg: LctrainConfig) -> list[str]:
    o, ck = cfg.optim, cfg.checkpoint
    problems = []
    if o.lr <= 0:
        problems.append(f"optim.lr={o.lr} must be > 0; try optim.lr=3e-4")
    elif not 0 <= o.min_lr <= o.lr:
        problems.append(f"optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]; try "
                        f"optim.min_lr={o.lr / 10:g}")
    for key, v in (("optim.warmup_steps", o.warmup_steps), ("optim.weight_decay", o.weight_decay),
                   ("optim.grad_clip", o.grad_clip), ("checkpoint.every", ck.every),
                   ("checkpoint.keep", ck.keep)):
        if v < 0:
            problems.append(f"{key}={v} must be >= 0; try {key}=0")
    if ck.load is not None and not os.path.isdir(ck.load):
        problems.append(f"checkpoint.load={ck.load} is not a directory; give a checkpoint "
                        "directory such as <run dir>/checkpoints/step-00000100")
    if ck.load is not None and ck.resume == "auto":
        problems.append(f"checkpoint.load={ck.load} and checkpoint.resume=auto both choose the "
                        "checkpoint; set checkpoint.resume=none to load that one")
    if ck.load_model_only and ck.load is None and ck.resume == "none":
        problems.append("checkpoint.load_model_only=true needs checkpoint.load=<checkpoint dir>")
    m = cfg.model
    if m.rope_type != "default" and m.rope_factor < 1:
        problems.append(f"model.rope_factor={m.rope_factor} must be >= 1 for rope_type="
                        f"{m.rope_type}; try model.rope_factor=8")
    if m.rope_type == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed "
                        f"model.rope_low_freq_factor={m.rope_low_freq_factor}; try 4.0 and 1.0")
    for key, v in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= v < 1:
            problems.append(f"{key}={v} must lie in [0, 1); try {key}=0.9")
    if cfg.model.init_from is not None:
        if not os.path.isdir(cfg.model.init_from):
            problems.append(f"model.init_from={cfg.model.init_from} is not a directory; give a "
                            "Hugging Face model directory (config.json + *.safetensors)")
        else:
            from lctrain.hf import check_hf_dir

            problems += check_hf_dir(cfg.model.init_from, cfg.model)
    return problems


def _data(cfg: LctrainConfig) -> list[str]:
    """The data source, the generated documents and the evals."""
    from lctrain.data.loader import source_problems
    from lctrain.data.tasks import MIN_VOCAB, TASKS

    d, ev, v = cfg.data, cfg.eval, cfg.model.vocab_size
    problems = source_problems(cfg)
    used = {e.source for e in d.mixture} if d.source == "mixture" else {d.source}
    tasks = (used & set(TASKS)) | (set(ev.tasks) if ev.every else set())
    if used & set(C.BUILTIN_SOURCES) and (d.doc_len_min < 2 or d.doc_len_max < d.doc_len_min):
        problems.append(f"data.doc_len_min={d.doc_len_min}, data.doc_len_max={d.doc_len_max} need "
                        "2 <= doc_len_min <= doc_len_max; try data.doc_len_min=32 "
                        "data.doc_len_max=256")
    if (used & set(C.BUILTIN_SOURCES) or tasks) and not 1 <= d.branching < v:
        problems.append(f"data.branching={d.branching} must lie in [1, model.vocab_size); try "
                        "data.branching=4")
    if tasks and v < MIN_VOCAB:
        problems.append(f"the {', '.join(sorted(tasks))} task(s) need model.vocab_size >= "
                        f"{MIN_VOCAB}; got {v}")
    if tasks and d.answer_len < 1:
        problems.append(f"data.answer_len={d.answer_len} must be >= 1; try data.answer_len=1")
    if "recall" in tasks and not 1 <= d.recall_pairs <= v // 4:
        problems.append(f"data.recall_pairs={d.recall_pairs} must lie in [1, model.vocab_size / 4 "
                        f"= {v // 4}] (distinct keys); try data.recall_pairs=4")
    if ev.every < 0:
        problems.append(f"eval.every={ev.every} must be >= 0 (0 = no evals); try eval.every=0")
    if not ev.every:
        return problems
    problems += [f"eval.tasks contains {t!r}; pick from {', '.join(C.EVAL_TASKS)}"
                 for t in ev.tasks if t not in C.EVAL_TASKS]
    if not ev.tasks:
        problems.append("eval.tasks is empty; try eval.tasks=[passkey]")
    if ev.samples < 1:
        problems.append(f"eval.samples={ev.samples} must be >= 1; try eval.samples=8")
    problems += [f"eval.depths contains {x}; depths are fractions in [0, 1]"
                 for x in ev.depths if not 0 <= x <= 1]
    if not ev.depths:
        problems.append("eval.depths is empty; try eval.depths=[0,0.5,1]")
    need = 2 * d.recall_pairs * (d.answer_len + 2) if "recall" in ev.tasks else 2 * (
        d.answer_len + 1)
    for n in ev.lengths or [cfg.train.seq_len]:
        if not need <= n <= cfg.train.seq_len:
            problems.append(f"eval.lengths contains {n}; each context length must lie in "
                            f"[{need} (needle and query of {', '.join(ev.tasks)}), train.seq_len="
                            f"{cfg.train.seq_len}]")
    return problems


def validate(cfg: LctrainConfig, world_size: int) -> list[str]:
    """Every problem of `cfg` for `world_size` ranks (empty list = valid)."""
    problems = _positive(cfg) + _choices(cfg)
    if world_size < 1:
        problems.append(f"world size {world_size} must be positive")
    if problems:  # later rules divide by these sizes or branch on these names
        return problems + _scalars(cfg) if world_size >= 1 else problems
    world = _world(cfg, world_size)
    problems += (world + _heads(cfg) + _context(cfg) + _layers(cfg) + _scalars(cfg)
                 + _data(cfg))
    if not world:
        problems += _batch(cfg, world_size)
    return problems


def warnings_for(cfg: LctrainConfig) -> list[str]:
    """Settings that are valid but do nothing; printed, never fatal."""
    p = cfg.parallel
    out = []
    if p.sp and p.tp == 1:
        out.append("parallel.sp=true has no effect with parallel.tp=1 (SP splits activations "
                   "inside the TP group)")
    if p.cp == 1 and (p.attention != "ring" or p.ulysses_degree != 1):
        out.append(f"parallel.attention={p.attention} is ignored with parallel.cp=1")
    return out
