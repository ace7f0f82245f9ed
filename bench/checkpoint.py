"""Checkpoint benchmarks on the CPU: save / load time and size against model size, and the step
stall of a synchronous save against an asynchronous one. Prints a table.

    python bench/checkpoint.py                    # tiny, 25M and 110M parameters, 2 ranks (FSDP)
    python bench/checkpoint.py --ranks 4 --sizes tiny 25m

Every row runs on gloo ranks, 1 thread each, in a fresh temporary directory: one training step
(so AdamW has its state), then a synchronous save (the stall is the whole write), an
asynchronous save (the stall is staging the tensors in memory; `commit` is when the write in
the background is done), and a load of the synchronous checkpoint into a freshly built model
and optimizer, with the sha256 verification on. Sizes are the checkpoint directory on disk.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lctrain.config import LctrainConfig, ModelConfig  # noqa: E402
from lctrain.data.loader import build_loader  # noqa: E402
from lctrain.parallel.launch import run_ranks  # noqa: E402
from lctrain.parallel.parallelize import build_model  # noqa: E402
from lctrain.parallel.runtime import setup_distributed  # noqa: E402
from lctrain.training.checkpoint import Checkpointer, TrainState  # noqa: E402
from lctrain.training.optim import build_optimizer, build_scheduler  # noqa: E402
from lctrain.training.step import train_step  # noqa: E402

SIZES = {
    "tiny": ModelConfig(),
    "25m": ModelConfig(name="25m", vocab_size=8192, dim=512, n_layers=6, n_heads=8,
                       n_kv_heads=2, ffn_dim=1536),
    "110m": ModelConfig(name="110m", vocab_size=32000, dim=768, n_layers=12, n_heads=12,
                        n_kv_heads=4, ffn_dim=2048),
}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def _build(cfg: LctrainConfig, rt):
    """Model, optimizer and schedule, as training builds them."""
    model = build_model(cfg, rt)
    optimizer = build_optimizer(model, cfg.optim)
    return model, optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.steps)


def _one(cfg: LctrainConfig, root: str) -> dict:
    rt = setup_distributed(cfg)
    model, optimizer, scheduler = _build(cfg, rt)
    loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
    train_step(model, optimizer, scheduler, loader.next_step(), cfg, rt)
    out = {}
    for mode in ("sync", "async"):
        cfg.checkpoint.async_save = mode == "async"
        ckpt = Checkpointer(cfg, rt, Path(root) / mode, "", log=lambda m: None)
        t0 = time.perf_counter()
        ckpt.save(1, model, optimizer, loader, TrainState(1, 0))
        out[f"{mode}_stall"] = time.perf_counter() - t0
        ckpt.wait()
        out[f"{mode}_commit"] = time.perf_counter() - t0
        ckpt.close()
    cfg.checkpoint.load = str(Path(root) / "sync" / "checkpoints" / "step-00000001")
    fresh, fresh_opt, fresh_sched = _build(cfg, rt)
    t0 = time.perf_counter()
    Checkpointer(cfg, rt, Path(root) / "load", "", log=lambda m: None).maybe_resume(
        fresh, fresh_opt, fresh_sched, loader)
    out["load"] = time.perf_counter() - t0
    out["bytes"] = _dir_bytes(Path(cfg.checkpoint.load))
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.ranks} ranks (FSDP over dp), fp32 weights + AdamW state; seconds")
    print(f"{'model':>6} {'params':>12} {'size MiB':>9} {'sync save':>10} {'async stall':>12} "
          f"{'async commit':>13} {'stall ratio':>12} {'load':>7}")
    for name in args.sizes:
        cfg = LctrainConfig()
        cfg.model = SIZES[name]
        cfg.parallel.dp = args.ranks
        cfg.train.seq_len, cfg.train.micro_batch, cfg.train.global_batch = 64, 1, args.ranks
        cfg.logging.progress = False
        with tempfile.TemporaryDirectory() as tmp:
            r = run_ranks(_one, args.ranks, (cfg, tmp), timeout_s=3600)[0]
        print(f"{name:>6} {r['params']:>12,} {r['bytes'] / 2**20:>9.1f} {r['sync_stall']:>10.3f} "
              f"{r['async_stall']:>12.3f} {r['async_commit']:>13.3f} "
              f"{r['sync_stall'] / r['async_stall']:>11.1f}x {r['load']:>7.3f}")


if __name__ == "__main__":
    main()
