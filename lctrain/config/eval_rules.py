"""The configuration rules of what a run measures besides its training loss: the validation
data (held out of data.path, or eval.val_data) and the eval grid (tasks, depths, lengths).
Part of `lctrain.config.validation`; the tasks' own minimum lengths are checked by
`lctrain.data.sources`.
"""

from __future__ import annotations

from lctrain.config.schema import LctrainConfig


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
    if ev.samples < 1:
        problems.append(f"eval.samples={ev.samples} must be >= 1; try eval.samples=8")
    problems += [f"eval.depths contains {x}; depths are fractions in [0, 1]"
                 for x in ev.depths if not 0 <= x <= 1]
    if not ev.depths:
        problems.append("eval.depths is empty; try eval.depths=[0,0.5,1]")
    problems += [f"eval.lengths contains {n}; each context length must lie in [1, train.seq_len="
                 f"{cfg.train.seq_len}]" for n in ev.lengths if not 1 <= n <= cfg.train.seq_len]
    return problems
