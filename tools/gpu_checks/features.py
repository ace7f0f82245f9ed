"""Wave 4 on the GPU, the paths no GPU has run yet, first: the documents split with travelling K/V,
halo window layers and attention sinks under context parallelism (2 ranks sharing the GPU,
against float64), and a few training steps of a tiny Gemma 3 (window layers at cp = 1),
GPT-OSS (sinks, biased experts) and Qwen3-MoE (experts through torch's grouped matmul, the
weights cast to bf16 without FSDP) in bf16 on one GPU against the same steps in fp32 on the CPU.
"""

from __future__ import annotations

from pathlib import Path

from gpu_checks.context import Context, device_dtype, largest_relative_difference, tiny_cfg
from gpu_checks.cp import cp_case_error, worst_over_ranks
from lctrain.config import LctrainConfig
from lctrain.training import loop

FEATURE_CASES = [  # (algorithm, window, sinks) on 2 ranks, load_balance=documents
    ("ring", False, False), ("allgather", False, False), ("ring", True, False),
    ("ring", False, True), ("allgather", True, True)]

FAMILIES = {  # a tiny model of each, widths multiples of 8 (torch's grouped matmul)
    "gemma3_text": {"sliding_window": 64, "rope_local_theta": 10000.0,
                    "query_pre_attn_scalar": 32, "tie_embeddings": True,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {"n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 64,
                "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3_moe": {"n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 64,
                  "norm_topk_prob": True},
}


def _feature_rank(algorithm: str, window: bool, sinks: bool, dry_run: bool) -> float:
    """One rank of a documents-split case on the shared device; returns its worst error."""
    return cp_case_error(algorithm, 1, dry_run, "documents", window, sinks)


def check_documents_windows_sinks(ctx: Context) -> dict:
    """cp2 with the documents split (travelling K/V), window layers (the halo) and sinks."""
    rows = []
    for algorithm, window, sinks in FEATURE_CASES:
        worst = worst_over_ranks(ctx, _feature_rank, 2, (algorithm, window, sinks, ctx.dry_run))
        rows.append({"algorithm": algorithm, "window": window, "sinks": sinks,
                     "error_over_tolerance": round(worst, 3)})
    ok = all(r["error_over_tolerance"] <= 1 for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": "documents split, worst error / tolerance: " + ", ".join(
                f"{r['algorithm']}{'+window' * r['window']}{'+sinks' * r['sinks']} "
                f"{r['error_over_tolerance']:.2f}" for r in rows)}


def _family_cfg(family: str, steps: int, device: str, dtype: str) -> LctrainConfig:
    cfg = tiny_cfg(steps, device, dtype)
    for key, value in {"family": family, **FAMILIES[family]}.items():
        setattr(cfg.model, key, value)
    return cfg


def check_families_step(ctx: Context, run_root: Path) -> dict:
    """A few steps of each wave-4 family in bf16 on one GPU against fp32 on the CPU."""
    steps = 2 if ctx.dry_run else 5
    tolerance = 1e-5 if ctx.dry_run else 0.03
    rows = []
    for family in FAMILIES:
        cpu = loop.train(_family_cfg(family, steps, "cpu", "fp32"), run_root / family / "cpu")
        dev = loop.train(_family_cfg(family, steps, ctx.device.type, device_dtype(ctx)),
                         run_root / family / "device")
        rows.append({"family": family, "diff": largest_relative_difference(cpu, dev),
                     "losses_device": [round(h["loss"], 4) for h in dev]})
    ok = all(r["diff"] <= tolerance for r in rows)
    return {"status": "PASS" if ok else "FAIL", "cases": rows,
            "detail": f"{steps} steps, largest relative loss difference (tolerance "
                      f"{tolerance}): " + ", ".join(f"{r['family']} {r['diff']:.4f}"
                                                    for r in rows)}
