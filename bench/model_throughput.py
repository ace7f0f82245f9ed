"""Training-step throughput of lctrain's Llama, eager and compiled, vs Hugging Face
LlamaForCausalLM on CPU.

All models get the identical architecture (`lctrain.models.hf.hf_config`), the same weights
(`to_hf_state_dict`), SDPA attention, the same thread count and the same token batch. Compiled is
lctrain's model as `train.compile=true` builds it (each block and the loss through
torch.compile: `lctrain.parallel.parallelize.apply_compile`). Before timing, each sequence length
asserts that all produce the same fp32 loss, so the benchmark provably times the same
computation. One step = forward, cross-entropy (sum over tokens / count), backward, AdamW step,
zero_grad. Timed steps rotate the order of the models so that machine noise hits all equally;
the table reports tokens / median step time (compilation happens in the untimed warmup steps).

    python bench/model_throughput.py                                  # tiny, fp32, 1 thread
    python bench/model_throughput.py --preset small --seq-lens 256 1024 --steps 5 --dtype bf16
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never touch the network; everything is built from config

import argparse
import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

from lctrain.config import ModelConfig
from lctrain.models.hf import hf_config, to_hf_state_dict
from lctrain.models.registry import new_model
from lctrain.parallel.parallelize import apply_compile

PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", vocab_size=8192, dim=512, n_layers=8, n_heads=8,
                         n_kv_heads=2, ffn_dim=1536),
}
Forward = Callable[[Tensor, Tensor], Tensor]  # tokens, labels [B, S] -> summed token loss


def build_models(cfg: ModelConfig, seq_len: int, seed: int) -> dict[str, tuple[nn.Module, Forward]]:
    """lctrain Llama (eager and compiled) and HF LlamaForCausalLM (SDPA, no KV cache) holding
    the same weights."""
    ours = new_model(cfg)
    ours.init_weights(seed)
    compiled = new_model(cfg)
    compiled.load_state_dict(ours.state_dict())
    apply_compile(compiled, tp=1)
    hf = transformers.LlamaForCausalLM(hf_config(
        dataclasses.replace(cfg, max_position_embeddings=max(seq_len, cfg.max_position_embeddings))))
    hf.set_attn_implementation("sdpa")
    hf.config.use_cache = False  # training: a DynamicCache would be pure overhead
    result = hf.load_state_dict(
        to_hf_state_dict(ours.state_dict(), cfg), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    assert not result.unexpected_keys and set(result.missing_keys) <= tied, result

    def hf_loss(tokens: Tensor, labels: Tensor) -> Tensor:
        logits = hf(input_ids=tokens).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")

    return {"lctrain": (ours.train(), lambda tokens, labels: ours(tokens, labels=labels)),
            "lctrain compiled": (compiled.train(),
                                 lambda tokens, labels: compiled(tokens, labels=labels)),
            "HF": (hf.train(), hf_loss)}


def check_same_loss(models: dict[str, tuple[nn.Module, Forward]], inputs: Tensor,
                    labels: Tensor) -> None:
    losses = {name: forward(inputs, labels).detach() for name, (_, forward) in models.items()}
    for name, loss in losses.items():
        torch.testing.assert_close(loss, losses["HF"], atol=1e-4, rtol=1e-5, msg=name)


def train_step(forward: Forward, optimizer: torch.optim.Optimizer, inputs: Tensor, labels: Tensor,
               autocast_dtype: torch.dtype | None) -> float:
    """One full optimizer step; returns its wall time in seconds."""
    start = time.perf_counter()
    autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext())
    with autocast:
        loss = forward(inputs, labels)
    (loss / labels.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench_seq_len(cfg: ModelConfig, seq_len: int, args: argparse.Namespace) -> dict[str, float]:
    """Tokens per second of each model at `seq_len` (median over interleaved timed steps)."""
    models = build_models(cfg, seq_len, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, seq_len + 1), generator=gen)
    inputs, labels = batch[:, :-1], batch[:, 1:]  # [B, S] each
    check_same_loss(models, inputs, labels)
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
                  for name, (module, _) in models.items()}
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for step in range(args.warmup + args.steps):
        order = names[step % len(names):] + names[:step % len(names)]
        for name in order:
            elapsed = train_step(models[name][1], optimizers[name], inputs, labels, autocast_dtype)
            if step >= args.warmup:
                times[name].append(elapsed)
    tokens = args.batch * seq_len
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--steps", type=int, default=10, help="timed steps per model and seq len")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model and seq len")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for both")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16 = torch.autocast('cpu', bfloat16) around both forwards")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    problems = [f"--{k.replace('_', '-')} must be >= 1; got {v}"
                for k, v in [("steps", args.steps), ("threads", args.threads),
                             ("batch", args.batch), ("seq_lens", min(args.seq_lens))] if v < 1]
    if args.warmup < 0:
        problems.append(f"--warmup must be >= 0; got {args.warmup}")
    if problems:
        p.error("; ".join(problems))
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]
    print(f"preset={cfg.name} (dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} "
          f"q/kv heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}) dtype={args.dtype} "
          f"threads={torch.get_num_threads()} batch={args.batch} steps={args.steps} "
          f"warmup={args.warmup} | torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'seq_len':>8} | {'lctrain tok/s':>13} | {'compiled tok/s':>14} | {'HF tok/s':>10} | "
          f"{'lctrain/HF':>10} | {'compiled/HF':>11}")
    ratios: dict[str, list[float]] = {"lctrain": [], "lctrain compiled": []}
    for seq_len in args.seq_lens:
        tps = bench_seq_len(cfg, seq_len, args)
        for name, values in ratios.items():
            values.append(tps[name] / tps["HF"])
        print(f"{seq_len:>8} | {tps['lctrain']:>13.0f} | {tps['lctrain compiled']:>14.0f} | "
              f"{tps['HF']:>10.0f} | {ratios['lctrain'][-1]:>10.3f} | "
              f"{ratios['lctrain compiled'][-1]:>11.3f}", flush=True)
    for name, values in ratios.items():
        geomean = math.exp(sum(map(math.log, values)) / len(values))
        print(f"geometric-mean ratio {name}/HF over seq lens {args.seq_lens}: {geomean:.3f} "
              f"(>1: faster than HF)")


if __name__ == "__main__":
    main()
