"""The configuration rules of what a run measures besides its training loss: the validation
data (held out of data.path, or eval.val_data) and the eval grid (tasks, depths, lengths).
Part of `lctrain.config.validation`; the tasks' own minimum lengths are checked by
`lctrain.data.sources`.
"""

from __future__ import annotations

from lctrain.config.ruler_tasks import TEXT_HAYSTACK, ruler_tasks
from lctrain.config.schema import LINEAR, LctrainConfig

NEEDLE_KEYS = 16
"""Distinct keys the needle task has (lctrain.data.needle.KEYS): eval.needle_keys' bound."""
AUTO_BAND, SHORT_AUTO_BAND, SHORT_SEQUENCE = 1024, 64, 2048
"""eval.position_band=null: 1024-token first band, or 64 below a 2048-token sequence."""


def position_bands(cfg: LctrainConfig) -> list[tuple[int, int]]:
    """The validation loss's position bands [lo, hi): the first eval.position_band wide, each
    next one twice the one before, the last one ending at train.seq_len; one band [0, seq_len)
    when eval.position_band=0."""
    seq_len, first = cfg.train.seq_len, cfg.eval.position_band
    if first is None:
        first = AUTO_BAND if seq_len >= SHORT_SEQUENCE else SHORT_AUTO_BAND
    if first == 0 or first >= seq_len:
        return [(0, seq_len)]
    edges = [0, first]
    while edges[-1] < seq_len:
        edges.append(min(2 * edges[-1], seq_len))
    return list(zip(edges[:-1], edges[1:]))


def has_validation(cfg: LctrainConfig) -> bool:
    """Whether a validation loss is configured (eval.val_data or data.val_fraction)."""
    return cfg.eval.val_data is not None or cfg.data.val_fraction > 0


def validation_data_problems(cfg: LctrainConfig) -> list[str]:
    d, ev, problems = cfg.data, cfg.eval, []
    if not d.val_fraction < 1:
        problems.append(f"data.val_fraction={d.val_fraction} must lie in [0, 1); try "
                        "data.val_fraction=0.01")
    if d.val_fraction > 0 and d.source != "tokens":
        problems.append(f"data.val_fraction={d.val_fraction} holds out documents of data.path, "
                        f"which needs data.source=tokens (got {d.source}); use eval.val_data="
                        "<preprocessed dir> for other sources")
    if d.val_fraction > 0 and ev.val_data is not None:
        problems.append(f"data.val_fraction={d.val_fraction} and eval.val_data={ev.val_data} both "
                        "choose the validation data; set one of them")
    if ev.position_band and ev.position_band >= cfg.train.seq_len:
        problems.append(f"eval.position_band={ev.position_band} leaves one band of train.seq_len="
                        f"{cfg.train.seq_len} tokens; try eval.position_band="
                        f"{max(1, cfg.train.seq_len // 4)}, or 0 for val_loss alone")
    return problems


def eval_problems(cfg: LctrainConfig) -> list[str]:
    """The eval grid (the tasks' own minimum lengths are checked by lctrain.data.sources)."""
    ev, problems = cfg.eval, validation_data_problems(cfg)
    if not ev.every:
        return problems
    if not ev.tasks:
        if not has_validation(cfg):
            problems.append("eval.tasks is empty and no validation data is set; try "
                            "eval.tasks=[passkey] or data.val_fraction=0.01")
        return problems  # the grid below is the tasks'
    if "needle" in ev.tasks:
        if not has_validation(cfg):
            problems.append("eval.tasks has needle, whose haystack is held-out text: set "
                            "data.val_fraction=0.01 (documents of data.path) or "
                            "eval.val_data=DIR (a preprocessed directory)")
        if cfg.data.tokenizer is None:
            problems.append("eval.tasks has needle, which writes its needle and question with "
                            "the model's tokenizer: set data.tokenizer (model.init_from's "
                            "tokenizer.json is used when it has one)")
        if ev.needle_keys > NEEDLE_KEYS:
            problems.append(f"eval.needle_keys={ev.needle_keys}: at most {NEEDLE_KEYS} keys")
    problems += _ruler_problems(cfg)
    if ev.samples < 1:
        problems.append(f"eval.samples={ev.samples} must be >= 1; try eval.samples=8")
    problems += [f"eval.depths contains {x}; depths are fractions in [0, 1]"
                 for x in ev.depths if not 0 <= x <= 1]
    if not ev.depths:
        problems.append("eval.depths is empty; try eval.depths=[0,0.5,1]")
    problems += [f"eval.lengths contains {n}; each context length must lie in [1, train.seq_len="
                 f"{cfg.train.seq_len}]" for n in ev.lengths if not 1 <= n <= cfg.train.seq_len]
    return problems


def generation_problems(cfg: LctrainConfig) -> list[str]:
    """The layouts and models greedy generation (`lctrain.training.generate`) does not run yet,
    by name."""
    p, problems = cfg.parallel, []
    if p.tp > 1 and p.sp:
        problems.append(f"parallel.tp={p.tp} with parallel.sp=true: generation decodes one token "
                        "at a time, which sequence parallelism cannot split; set "
                        "parallel.sp=false (or parallel.tp=1) to generate")
    if p.pp > 1:
        problems.append(f"parallel.pp={p.pp}: generation does not run pipeline stages yet; set "
                        "parallel.pp=1 to generate")
    if LINEAR in (cfg.model.layer_types or ()):
        problems.append("linear_attention layers (model.layer_types): generation does not cache "
                        "their recurrent state yet")
    return problems


def _ruler_problems(cfg: LctrainConfig) -> list[str]:
    """The RULER-style tasks: the model's tokenizer, validation text for the text haystacks, a
    layout generation runs on."""
    tasks = ruler_tasks(cfg.eval.tasks)
    if not tasks:
        return []
    problems = [f"eval.tasks has {', '.join(tasks)}, scored on generation: {p}"
                for p in generation_problems(cfg)]
    if cfg.data.tokenizer is None:
        problems.append(f"eval.tasks has {', '.join(tasks)}, whose prompts are written and whose "
                        "answers are read with the model's tokenizer: set data.tokenizer "
                        "(model.init_from's tokenizer.json is used when it has one)")
    text = [t for t in tasks if t in TEXT_HAYSTACK]
    if text and not has_validation(cfg):
        problems.append(f"eval.tasks has {', '.join(text)}, whose haystack is held-out text: set "
                        "data.val_fraction=0.01 (documents of data.path) or eval.val_data=DIR, "
                        "or score the other tasks")
    return problems
