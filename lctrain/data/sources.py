"""Data sources: which one a config names (synthetic, a task, preprocessed token shards or a
mixture), building it, and checking it against the model before launch.

A source has window(i) for every global sample i, fingerprint() (what resuming must match) and
dropped (documents it skips).
"""

from __future__ import annotations

import os

from lctrain.config import LctrainConfig
from lctrain.data.packing import Mixture, PackedTokens
from lctrain.data.shards import TokenStore
from lctrain.data.synthetic import SyntheticLM
from lctrain.data.tasks import MIN_VOCAB, TASKS

BUILTIN = ("synthetic", *TASKS)
"""Sources generated on the fly (anything else names a preprocessed directory)."""


def build_source(cfg: LctrainConfig):
    """The configured source: window(i) for every global sample i, and fingerprint()."""
    d = cfg.data
    if d.source == "mixture":
        return Mixture([_one_source(cfg, e.source) for e in d.mixture],
                       [e.weight for e in d.mixture])
    return _one_source(cfg, d.path if d.source == "tokens" else d.source)


def _one_source(cfg: LctrainConfig, name: str):
    args = (cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed)
    if name == "synthetic":
        return SyntheticLM(*args)
    if name in TASKS:
        return TASKS[name](*args)
    return PackedTokens(TokenStore(name), cfg.train.seq_len, cfg.train.seed, cfg.data.long_docs)


def _source_problems(cfg: LctrainConfig) -> list[str]:
    """data.source / data.path / data.mixture against the model (cheap: reads only each
    dataset's meta.json and document index)."""
    d, problems = cfg.data, []
    if d.source == "mixture":
        if not d.mixture:
            return ["data.source=mixture needs data.mixture, e.g. "
                    "data.mixture='[{source: passkey, weight: 1}, {source: recall, weight: 1}]'"]
        names = [(f"data.mixture[{i}].source", e.source) for i, e in enumerate(d.mixture)]
        problems += [f"data.mixture[{i}].weight={e.weight} must be > 0; try 1.0"
                     for i, e in enumerate(d.mixture) if not e.weight > 0]
    elif d.mixture:
        return [f"data.mixture is set but data.source={d.source}; set data.source=mixture to use "
                "it, or data.mixture=[] to drop it"]
    elif d.source == "tokens":
        if d.path is None:
            return ["data.source=tokens needs data.path=<directory written by lctrain preprocess>"]
        names = [("data.path", d.path)]
    else:
        names = [("data.source", d.source)]
    for key, name in names:
        if name in BUILTIN:
            continue
        if not os.path.isdir(name):
            problems.append(f"{key}={name} is neither a built-in source "
                            f"({', '.join(BUILTIN)}) nor a directory")
            continue
        try:
            store = PackedTokens(TokenStore(name), cfg.train.seq_len, cfg.train.seed, d.long_docs)
        except ValueError as e:
            problems.append(f"{key}: {e}")
            continue
        if store.store.vocab_size > cfg.model.vocab_size:
            problems.append(f"{key}={name} was tokenized with {store.store.vocab_size} tokens, "
                            f"more than model.vocab_size={cfg.model.vocab_size}; set "
                            f"model.vocab_size={store.store.vocab_size} or more")
    return problems


def data_problems(cfg: LctrainConfig) -> list[str]:
    """Every problem of the data a config names, for its model: the source on disk, the
    generated documents' and tasks' needs, and the eval contexts the tasks need."""
    d, ev, v = cfg.data, cfg.eval, cfg.model.vocab_size
    problems = _source_problems(cfg)
    used = {e.source for e in d.mixture} if d.source == "mixture" else {d.source}
    tasks = (used & set(TASKS)) | (set(ev.tasks) if ev.every else set())
    if used & set(BUILTIN) and (d.doc_len_min < 2 or d.doc_len_max < d.doc_len_min):
        problems.append(f"data.doc_len_min={d.doc_len_min}, data.doc_len_max={d.doc_len_max} need "
                        "2 <= doc_len_min <= doc_len_max; try data.doc_len_min=32 "
                        "data.doc_len_max=256")
    if (used & set(BUILTIN) or tasks) and not 1 <= d.branching < v:
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
    scored = [t for t in ev.tasks if t in TASKS] if ev.every else []
    if scored:
        need = max(TASKS[t].context_needed(d) for t in scored)
        problems += [f"eval.lengths contains {n}; the {', '.join(scored)} task(s) need contexts "
                     f"of at least {need} tokens (needle and query)"
                     for n in ev.lengths or [cfg.train.seq_len] if n < need]
    return problems
