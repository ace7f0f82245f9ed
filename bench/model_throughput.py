"""Training-step throughput of lctrain's Llama vs Hugging Face LlamaForCausalLM on CPU.

Both models get the identical architecture (`lctrain.hf.hf_config`), the same weights
(`to_hf_state_dict`), SDPA attention, the same thread count and the same token batch. Before timing,
each sequence length asserts that the two produce the same fp32 logits, so the benchmark provably
times the same computation. One step = forward, cross-entropy (sum over tokens / count), backward,
AdamW step, zero_grad. Timed steps alternate between the models (the one going first alternates
too) so that machine noise hits both equally; the table reports tokens / median step time.

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
from lctrain.models.llama import Llama

PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(name="small", vocab_size=8192, dim=512, n_layers=8, n_heads=8,
                         n_kv_heads=2, ffn_dim=1536),
}
Forward = Callable[[Tensor], Tensor]  # tokens [B, S] -> logits [B, S, V]


def build_models(cfg: ModelConfig, seq_len: int, seed: int) -> dict[str, tuple[nn.Module, Forward]]:
    """lctrain Llama and HF LlamaForCausalLM (SDPA, no KV cache) holding the same weights."""
    ours = Llama(cfg)
    ours.init_weights(seed)
    hf = transformers.LlamaForCausalLM(hf_config(
        dataclasses.replace(cfg, max_position_embeddings=max(seq_len, cfg.max_position_embeddings))))
    hf.set_attn_implementation("sdpa")
    hf.config.use_cache = False  # training: a DynamicCache would be pure overhead
    result = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg.tie_embeddings), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    assert not result.unexpected_keys and set(result.missing_keys) <= tied, result
    return {"lctrain": (ours.train(), ours),
            "HF": (hf.train(), lambda tokens: hf(input_ids=tokens).logits)}


@torch.no_grad()
def check_same_logits(models: dict[str, tuple[nn.Module, Forward]], tokens: Tensor) -> None:
    ours, theirs = (forward(tokens) for _, forward in models.values())
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def train_step(forward: Forward, optimizer: torch.optim.Optimizer, inputs: Tensor, labels: Tensor,
               autocast_dtype: torch.dtype | None) -> float:
    """One full optimizer step; returns its wall time in seconds."""
    start = time.perf_counter()
    autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype
                else contextlib.nullcontext())
    with autocast:
        logits = forward(inputs)  # [B, S, V]
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
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
    check_same_logits(models, inputs)
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
                  for name, (module, _) in models.items()}
    autocast_dtype = torch.bfloat16 if args.dtype == "bf16" else None
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.warmup + args.steps):
        order = list(models) if step % 2 == 0 else list(models)[::-1]
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
    print(f"{'seq_len':>8} | {'lctrain tok/s':>13} | {'HF tok/s':>10} | {'ratio (lctrain/HF)':>18}")
    ratios = []
    for seq_len in args.seq_lens:
        tps = bench_seq_len(cfg, seq_len, args)
        ratios.append(tps["lctrain"] / tps["HF"])
        print(f"{seq_len:>8} | {tps['lctrain']:>13.0f} | {tps['HF']:>10.0f} | {ratios[-1]:>18.3f}",
              flush=True)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geometric-mean ratio lctrain/HF over seq lens {args.seq_lens}: {geomean:.3f} "
          f"(>1: lctrain faster)")


if __name__ == "__main__":
    main()
