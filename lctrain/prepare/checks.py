"""Everything checked before a command acts, with no process started: the configuration's own
rules (`lctrain.config.validation`), the data it names (`lctrain.data.sources`), the Hugging
Face directory it starts from (`lctrain.models.hf`) and, for the DeepSpeed engine, deepspeed
itself (`lctrain.parallel.deepspeed_engine`)."""

from __future__ import annotations

import dataclasses
import os

from lctrain.config import LctrainConfig
from lctrain.config.derived import context_stages, stage_problems
from lctrain.config.eval_rules import has_validation
from lctrain.config.ruler_tasks import ruler_tasks
from lctrain.config.validation import field_problems, validate
from lctrain.data.needle import needle_problems
from lctrain.data.ruler import ruler_problems
from lctrain.data.sources import data_problems, length_histogram
from lctrain.models.hf import check_hf_dir
from lctrain.parallel import deepspeed_engine, launch


def preflight(cfg: LctrainConfig, world_size: int) -> list[str]:
    """Every problem of `cfg` for `world_size` ranks, its data and its starting weights
    included (empty = ready to launch)."""
    problems = validate(cfg, world_size)
    if field_problems(cfg, blocking_only=True):  # the data rules read these sizes and names
        return problems
    problems += input_problems(cfg)
    if cfg.parallel.dp_engine == "deepspeed":
        problems += deepspeed_engine.environment_problems(cfg)
    return problems


def search_preflight(cfg: LctrainConfig) -> list[str]:
    """`preflight` for a layout search: everything but the layout rules (which each searched
    layout passes on its own): the fields, the data and the starting weights."""
    return field_problems(cfg) or input_problems(cfg)


def input_problems(cfg: LctrainConfig) -> list[str]:
    """The data `cfg` names, the Hugging Face directory it starts from, and the contexts the
    needle and RULER-style evals need in the model's tokens."""
    problems = data_problems(cfg)
    e = cfg.eval
    length_checks = [check for check, wanted in (
        (needle_problems, "needle" in e.tasks and has_validation(cfg)),
        (ruler_problems, bool(ruler_tasks(e.tasks)))) if wanted]
    if (e.every and length_checks and not problems and not field_problems(cfg)
            and cfg.data.tokenizer is not None):
        stages = context_stages(cfg) if not stage_problems(cfg) else []
        for stage in stages:  # each stage scores the lengths that fit it
            named = f"train.stages[{stage.index}]: " if len(stages) > 1 else ""
            problems += [named + p for check in length_checks for p in check(stage.cfg)]
    init = cfg.model.init_from
    if init is not None and os.path.isdir(init):
        problems += check_hf_dir(init, cfg.model)
    return problems


def with_corpus(cfg: LctrainConfig) -> LctrainConfig:
    """`cfg` with plan.documents read from its data when it is null and packed documents are
    masked (the plan's load-balance and traffic predictions, docs/parallelism.md §24); call
    after the data passed `input_problems`."""
    if cfg.plan.documents is not None or not cfg.data.document_masking:
        return cfg
    return dataclasses.replace(cfg, plan=dataclasses.replace(
        cfg.plan, documents=length_histogram(cfg)))


def uses_cuda(cfg: LctrainConfig) -> bool:
    """Whether this run trains on CUDA (train.device=auto: when a GPU is visible)."""
    return cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                          and launch.cuda_devices() > 0)
