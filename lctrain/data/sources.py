"""Data sources: which one a config names (synthetic, a task, preprocessed token shards or a
mixture), the validation source (eval.val_data, or documents held out by data.val_fraction),
building them, and checking them against the model before launch, its tokenizer included.

A source has window(i) for every global sample i, fingerprint() (what resuming must match) and
dropped (documents it skips).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from lctrain.config import LctrainConfig
from lctrain.data.ingest import TokenizerMismatch, load_tokenizer
from lctrain.data.packing import Mixture, PackedTokens
from lctrain.data.shards import TokenStore, read_meta
from lctrain.data.splits import held_out
from lctrain.data.synthetic import SyntheticLM, document_length
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


HISTOGRAM_DRAWS = 4096
"""Documents a generated source draws for its length histogram."""


def length_histogram(cfg: LctrainConfig) -> list[list[int]]:
    """The training documents' lengths as [max_len, documents, tokens] rows (plan.documents):
    data.source=tokens reads meta.json's (preprocess counts them); a generated source draws
    HISTOGRAM_DRAWS of its documents (EOS included) into power-of-two buckets; [] for a
    mixture."""
    d = cfg.data
    if d.source == "tokens":
        return [list(row) for row in read_meta(d.path).get("summary", {}).get("by_length", [])]
    if d.source not in BUILTIN:
        return []
    rng = np.random.default_rng(cfg.train.seed)
    lengths = np.array([document_length(rng, d) + 1 for _ in range(HISTOGRAM_DRAWS)])
    uppers = 1 << np.ceil(np.log2(lengths)).astype(np.int64)
    return [[int(u), int((uppers == u).sum()), int(lengths[uppers == u].sum())]
            for u in np.unique(uppers)]


def _one_source(cfg: LctrainConfig, name: str):
    args = (cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed)
    if name == "synthetic":
        return SyntheticLM(*args)
    if name in TASKS:
        return TASKS[name](*args)
    return _packed(cfg, name, "train")


def _packed(cfg: LctrainConfig, path: str, part: str, training: bool = True) -> PackedTokens:
    """A token dataset, or its training or validation part when data.val_fraction holds out
    documents of data.path (the split is seeded by train.seed); training data chosen by length
    and packed as data.length_mix and data.packing say."""
    store = TokenStore(path)
    t, d = cfg.train, cfg.data
    # the training data only: validation scores the corpus as it is
    shaping = {} if not training or part == "validation" else {
        "length_mix": [(b.max_len, b.weight) for b in d.length_mix], "packing": d.packing}
    if d.val_fraction > 0 and d.source == "tokens" and path == d.path:
        train_docs, val_docs = held_out(store, d.val_fraction, t.seed)
        docs = val_docs if part == "validation" else train_docs
        return PackedTokens(store, t.seq_len, t.seed, d.long_docs, documents=docs, part=part,
                            **shaping)
    return PackedTokens(store, t.seq_len, t.seed, d.long_docs, **shaping)


def build_val_source(cfg: LctrainConfig) -> PackedTokens | None:
    """The validation source: eval.val_data, the documents data.val_fraction holds out of
    data.path, or None."""
    if cfg.eval.val_data is not None:
        return _packed(cfg, cfg.eval.val_data, "all", training=False)
    if cfg.data.val_fraction > 0:
        return _packed(cfg, cfg.data.path, "validation")
    return None


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
    if cfg.eval.val_data is not None:
        names.append(("eval.val_data", cfg.eval.val_data))
    for key, name in names:
        if name in BUILTIN:
            continue
        if not os.path.isdir(name):
            problems.append(f"{key}={name} is neither a built-in source "
                            f"({', '.join(BUILTIN)}) nor a directory")
            continue
        try:
            parts = [_packed(cfg, name, "train", training=key == "data.path")]
            if key == "data.path" and d.val_fraction > 0:
                parts.append(_packed(cfg, name, "validation"))
        except ValueError as e:
            problems.append(f"{key}: {e}")
            continue
        if parts[0].store.vocab_size > cfg.model.vocab_size:
            problems.append(f"{key}={name} was tokenized with {parts[0].store.vocab_size} tokens, "
                            f"more than model.vocab_size={cfg.model.vocab_size}; set "
                            f"model.vocab_size={parts[0].store.vocab_size} or more")
        problems += _tokenizer_problems(cfg, key, name)
    return problems


def _tokenizer_problems(cfg: LctrainConfig, key: str, path: str) -> list[str]:
    """Shards made with another tokenizer than model.init_from's: refused, naming both."""
    init = cfg.model.init_from
    if init is None or not (Path(init) / "tokenizer.json").is_file():
        return []
    meta = read_meta(path)
    shards = meta.get("tokenizer", {})
    try:
        model = load_tokenizer(dataclasses.replace(cfg.data, tokenizer=init,
                                                   add_bos=meta.get("add_bos", True),
                                                   add_eos=meta.get("add_eos", True)))
    except TokenizerMismatch as e:  # e.g. the shards have a BOS token the model's lacks
        return [f"{key}={path} does not fit model.init_from={init}'s tokenizer: {e}"]
    except ValueError as e:
        return [f"model.init_from={init}: its tokenizer cannot be read to check {key} ({e})"]
    same_vocab = (shards.get("vocab_sha256") == model.vocab_sha256 if "vocab_sha256" in shards
                  else shards.get("sha256") == model.sha256)
    specials = [(name, meta.get(f"{name}_id"), getattr(model, f"{name}_id"))
                for name in ("bos", "eos")]
    differ = [f"{n.upper()} {a} vs {b}" for n, a, b in specials if None not in (a, b) and a != b]
    if same_vocab and not differ:
        return []
    what = "another vocabulary" if not same_vocab else ", ".join(differ)
    return [f"{key}={path} was tokenized with {shards.get('spec')!r} ({meta.get('vocab_size')} "
            f"tokens), which is not model.init_from={init}'s tokenizer ({model.vocab_size} "
            f"tokens): {what}. Preprocess the corpus again with data.tokenizer={init}"]


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
