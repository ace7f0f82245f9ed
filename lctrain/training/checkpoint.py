"""Checkpoints: everything a run needs to continue exactly, saved atomically (optionally in the
background), verified on load, and loadable under any other valid layout.

One checkpoint is one directory, `<checkpoint.dir>/step-00000040/`:

    .metadata, __R_0.distcp   torch.distributed.checkpoint (DCP): model weights and AdamW state,
                              keyed by parameter name with global shapes, so any tp / cp / pp /
                              dp layout and the fsdp and ddp engines can load them (DCP reshards)
    deepspeed/                instead, under parallel.dp_engine=deepspeed: the engine's own files
                              (weights, ZeRO optimizer partitions); any ZeRO stage and dp x cp
                              resumes them, and any engine loads their weights (load_model_only)
    train_state.json          step, tokens seen, data-loader state, the layout it was saved under
    rng-0000R.json            each rank's RNG states (restored only under the same layout)
    config.yaml               the resolved configuration (secrets redacted)
    manifest.json             written last: every file with its size and sha256

It is written as `.step-00000040.partial` and renamed into place after rank 0 has written the
manifest, so a visible checkpoint is complete; a crash, a full disk or a failed rank leaves at
most a partial directory, which is never loaded and is removed by the next run. `load` checks
every file against the manifest (each rank hashes a share), and with checkpoint.resume=auto a
damaged checkpoint is skipped with a warning for the previous complete one.

Nothing is unpickled: tensors load with weights_only, DCP's metadata through an unpickler that
admits only DCP's own metadata classes, everything else is JSON. The schedule is not saved: it
is a function of the step (lctrain.training.optim.lr_at), so it resumes exactly in any layout.

This module saves and resumes (`Checkpointer`, collective); the files' names, the manifest
check, the safe metadata reader and the RNG states are lctrain.training.checkpoint_format's,
re-exported here.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lctrain.parallel import deepspeed_engine
from lctrain.rundir import CONFIG, RunDir
from lctrain.rundir.checkpoint_dirs import (
    MANIFEST,
    STATE,
    complete_checkpoints,
    damaged_files,
    sha256_file,
    step_dir,
)
from lctrain.rundir.files import describe_os_error, errnos_in, write_advice, write_synced
from lctrain.training.checkpoint_format import (
    SafeReader,
    full_weights,
    rng_state,
    set_rng_state,
    tensor_state,
    write_json,
)
from lctrain.training.optim import resume_scheduler

__all__ = [  # with checkpoint_format's and rundir.checkpoint_dirs' names, which tools and bench import here
    "MANIFEST", "STATE", "CheckpointError", "Checkpointer", "SafeReader", "TrainState",
    "complete_checkpoints", "damaged_files", "full_weights", "rng_state", "set_rng_state",
    "step_dir", "tensor_state",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and what to do."""


@dataclass
class TrainState:
    """Progress that is not a tensor."""

    step: int = 0
    tokens: int = 0


def _describe(error: BaseException, rank: int) -> str:
    """One line per failed rank: DCP's CheckpointException carries every rank's exception; an
    OSError says which file, why, and its errno."""
    if isinstance(error, CheckpointException):
        return "; ".join(_describe(e, r) for r, (e, _) in sorted(error.failures.items()))
    if isinstance(error, OSError) and error.errno is not None:
        where = f"{error.filename}: " if error.filename else ""
        return f"rank {rank}: {where}{describe_os_error(error)}"
    return f"rank {rank}: {type(error).__name__}: {error}"


class Checkpointer:
    """Decides when to save (`should_save`), saves (`save`, optionally in the background) and
    resumes (`maybe_resume`). Collective: every rank calls every method in the same order."""

    def __init__(self, cfg, rt, run_dir: Path, config_yaml: str, log=print):
        c = cfg.checkpoint
        self.cfg, self.rt, self.config_yaml, self.log = cfg, rt, config_yaml, log
        self.root = RunDir(run_dir).checkpoints(c.dir)
        self.layout = {"world_size": rt.world_size, "shape": list(rt.topology.shape),
                       "dp_engine": cfg.parallel.dp_engine}
        if cfg.parallel.dp_engine == "deepspeed":
            self.layout["zero_stage"] = cfg.deepspeed.zero_stage
        # checkpoint collectives get their own group: a background save must never interleave
        # with the training step's collectives on the default group; it keeps launch.timeout_s
        self.pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(
            seconds=cfg.launch.timeout_s)) if rt.world_size > 1 else None
        self._executor = ThreadPoolExecutor(1, "lctrain-ckpt") if c.async_save else None
        self.continue_data = False
        """Set for a stage after the first of train.stages: the data-loader state of the
        previous stage's last checkpoint continues at the same token (another seq_len)."""
        self._pending: Future | None = None
        if rt.rank == 0 and self.root.is_dir():
            for stale in self.root.glob(".step-*.partial"):
                log(f"lctrain: removing {stale}, a checkpoint an earlier run did not finish")
                shutil.rmtree(stale, ignore_errors=True)
        self._barrier()

    def _barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def _gather(self, value: object) -> list:
        if self.pg is None:
            return [value]
        out: list = [None] * self.rt.world_size
        dist.all_gather_object(out, value, group=self.pg)
        return out

    def should_save(self, step: int) -> bool:
        every = self.cfg.checkpoint.every
        return every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer, loader, state: TrainState,
             wait: bool = False) -> None:
        """Checkpoint after `step` optimizer steps; returns once the tensors are staged (async)
        or written and committed (sync, or wait=True)."""
        self.wait()  # the previous checkpoint commits first (and raises its error, if any)
        tmp = self.root / f".step-{step:08d}.partial"
        error = None
        if self.rt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a read-only or full checkpoint.dir: every rank stops
                error = _describe(e, 0)
        errors = [e for e in self._gather(error) if e]  # also the barrier before writing
        if errors:
            self._fail(tmp, step, RuntimeError("; ".join(errors)))
        extra = {"step": step, "tokens": state.tokens, "loader": loader.state_dict(),
                 "layout": self.layout, "format": 1}
        if deepspeed_engine.is_engine(model):  # its own files, written synchronously
            try:
                deepspeed_engine.save(model, tmp)
            except Exception as e:  # noqa: BLE001
                self._fail(tmp, step, e)
            self._commit(None, tmp, step, extra, rng_state())
            return
        tensors, _ = tensor_state(model, optimizer)
        writer = dcp.FileSystemWriter(tmp)
        if self._executor is not None and not wait:
            staged = dcp.async_save(tensors, storage_writer=writer, process_group=self.pg)
            self._pending = self._executor.submit(self._commit, staged, tmp, step, extra,
                                                  rng_state())
            return
        try:
            dcp.save(tensors, storage_writer=writer, process_group=self.pg)
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            self._fail(tmp, step, e)
        self._commit(None, tmp, step, extra, rng_state())

    def wait(self) -> None:
        """Block until a background save has committed; raise its error."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _commit(self, staged: Future | None, tmp: Path, step: int, extra: dict,
                rng: dict) -> None:
        rank = self.rt.rank
        error, hashes = None, {}
        try:
            if staged is not None:
                staged.result()
            rng_file = tmp / f"rng-{rank:05d}.json"
            write_json(rng_file, rng)
            for file in [*tmp.glob(f"__{rank}_*"), rng_file]:
                hashes[file.name] = {"size": file.stat().st_size, "sha256": sha256_file(file)}
        except (Exception, CheckpointException) as e:  # noqa: BLE001 (reported on every rank)
            error = _describe(e, rank)
        gathered = self._gather((error, hashes))
        errors = [e for e, _ in gathered if e]
        if not errors and rank == 0:
            try:
                self._publish(tmp, step, extra, {k: v for _, h in gathered for k, v in h.items()})
            except Exception as e:  # noqa: BLE001
                errors.append(_describe(e, rank))
        errors = [e for es in self._gather(errors) for e in es]
        if errors:
            self._fail(tmp, step, RuntimeError("; ".join(dict.fromkeys(errors))))

    def _publish(self, tmp: Path, step: int, extra: dict, files: dict) -> None:
        """Rank 0: the remaining files, the manifest last, then the rename that makes it real."""
        write_json(tmp / STATE, extra)
        write_synced(tmp / CONFIG, self.config_yaml.encode())
        engine_files = sorted(str(f.relative_to(tmp)) for f in (tmp / deepspeed_engine.TAG).rglob(
            "*") if f.is_file())
        for name in [n for n in (".metadata", STATE, CONFIG) if (tmp / n).is_file()] + \
                engine_files:
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        write_json(tmp / MANIFEST, {"step": step, "files": files})
        final = step_dir(self.root, step)
        aside = self.root / f".{final.name}.replaced.partial"  # removed by the next run if left
        if final.exists():  # a checkpoint of the same step from an earlier attempt
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        try:
            os.replace(tmp, final)
        except OSError:
            if aside.exists():  # put the earlier one back: a failed commit replaces nothing
                os.replace(aside, final)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        keep = self.cfg.checkpoint.keep
        for old in complete_checkpoints(self.root)[keep:] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        self.log(f"lctrain: checkpoint {final}")

    def _fail(self, tmp: Path, step: int, error: BaseException) -> None:
        if isinstance(error, (CheckpointException, OSError)):
            error = RuntimeError(_describe(error, self.rt.rank))
        if self.rt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = complete_checkpoints(self.root)
        kept = (f"the previous checkpoint {previous[0]} is intact (checkpoint.resume=auto "
                "continues from it)" if previous else "no earlier checkpoint exists")
        raise CheckpointError(
            f"checkpoint of step {step} could not be written to {self.root} ({error}); {kept}. "
            f"{write_advice(errnos_in(str(error)), self.root, 'checkpoint.dir')}") from error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
                self.pg = None

    # ---- loading --------------------------------------------------------------------------

    def _candidates(self) -> tuple[list[Path], bool]:
        c = self.cfg.checkpoint
        if c.load is not None:
            return [Path(c.load)], True
        if c.resume != "auto":
            return [], False
        box = [complete_checkpoints(self.root) if self.rt.rank == 0 else None]
        if self.pg is not None:
            dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0], False

    def _problems(self, path: Path) -> list[str]:
        if not (path / MANIFEST).is_file():
            return [f"{path} is not a complete lctrain checkpoint (no {MANIFEST})"]
        local = damaged_files(path, self.rt.rank, self.rt.world_size, self.cfg.checkpoint.verify)
        return sorted({p for ps in self._gather(local) for p in ps})

    def maybe_resume(self, model: nn.Module, optimizer, scheduler, loader) -> TrainState:
        """Load checkpoint.load, or the newest complete checkpoint (checkpoint.resume=auto);
        a damaged one is skipped for the one before it. Returns where training continues."""
        candidates, explicit = self._candidates()
        for path in candidates:
            problems = self._problems(path)
            if not problems:
                return self._load(path, model, optimizer, scheduler, loader)
            if explicit:
                raise CheckpointError(f"checkpoint.load={path} cannot be used: "
                                      f"{'; '.join(problems)}")
            self.log(f"lctrain: warning: skipping damaged checkpoint {path}: {problems[0]}"
                     + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        if candidates:
            raise CheckpointError(f"every checkpoint in {self.root} is damaged (see the warnings "
                                  "above); set checkpoint.resume=none to start over")
        if self.cfg.checkpoint.resume == "auto":
            self.log(f"lctrain: no checkpoint in {self.root}; starting at step 0")
        return TrainState()

    def load_weights(self, path: Path, model: nn.Module) -> int:
        """The weights of the checkpoint `path` (any layout, any engine) into `model`, checked
        first (a damaged or incomplete one is a CheckpointError naming it); returns the step it
        was saved at."""
        problems = self._problems(path)
        if problems:
            raise CheckpointError(f"checkpoint.load={path} cannot be used: {'; '.join(problems)}")
        self._load_weights(path, model)
        return json.loads((path / STATE).read_text())["step"]

    def _load(self, path: Path, model, optimizer, scheduler, loader) -> TrainState:
        saved = json.loads((path / STATE).read_text())
        if self.cfg.checkpoint.load_model_only:
            self._load_weights(path, model)
            self.log(f"lctrain: loaded the model weights of {path} (checkpoint.load_model_only)")
            return TrainState()
        saved_by_deepspeed = (path / deepspeed_engine.TAG).is_dir()
        if saved_by_deepspeed != deepspeed_engine.is_engine(model):
            raise CheckpointError(
                f"{path} was saved by the {saved['layout']['dp_engine']} engine, whose optimizer "
                f"state parallel.dp_engine={self.cfg.parallel.dp_engine} cannot resume; set "
                "checkpoint.load_model_only=true to start from its weights with a fresh "
                "optimizer, or train on with the engine that saved it")
        if saved_by_deepspeed:
            if saved["layout"].get("zero_stage") != self.layout["zero_stage"]:
                raise CheckpointError(
                    f"{path} holds ZeRO-{saved['layout'].get('zero_stage')} optimizer state, "
                    f"which deepspeed.zero_stage={self.layout['zero_stage']} cannot resume; set "
                    f"deepspeed.zero_stage={saved['layout'].get('zero_stage')}, or "
                    "checkpoint.load_model_only=true for its weights with a fresh optimizer")
            deepspeed_engine.load(model, path)
        else:
            tensors, optim_sd = tensor_state(model, optimizer)
            dcp.load(tensors, storage_reader=SafeReader(path), process_group=self.pg)
            set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                           optim_state_dict={**optim_sd, "state": tensors["optim"]})
        resume_scheduler(scheduler, saved["step"])
        try:
            note = loader.load_state_dict(saved["loader"], continue_data=self.continue_data
                                          or self.cfg.checkpoint.load is not None)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
        if note:
            self.log(f"lctrain: {note}")
        same = saved["layout"] == self.layout
        if same:
            set_rng_state(json.loads((path / f"rng-{self.rt.rank:05d}.json").read_text()))
        self.log(f"lctrain: resumed from {path} at step {saved['step']}"
                 + ("" if same else f" (saved under layout {saved['layout']}, resharded; RNG "
                    "states not restored)"))
        return TrainState(step=saved["step"], tokens=saved["tokens"])

    def _load_weights(self, path: Path, model) -> None:
        """The weights of any engine's checkpoint into `model` under any engine."""
        engine, saved_by_deepspeed = deepspeed_engine.is_engine(model), (
            path / deepspeed_engine.TAG).is_dir()
        if engine:  # whole weights from either format, partitioned as this engine's
            whole = (deepspeed_engine.full_weights(path) if saved_by_deepspeed
                     else full_weights(path, self.cfg))
            deepspeed_engine.load_full_weights(model, whole, self.cfg.deepspeed.zero_stage)
        elif saved_by_deepspeed:  # ZeRO shards consolidated, then laid out as this model's
            set_model_state_dict(model, deepspeed_engine.full_weights(path),
                                 options=StateDictOptions(full_state_dict=True))
        else:
            weights = {"model": get_model_state_dict(model)}
            dcp.load(weights, storage_reader=SafeReader(path), process_group=self.pg)
            set_model_state_dict(model, weights["model"])

