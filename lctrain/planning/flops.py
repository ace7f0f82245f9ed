"""Model FLOPs of a training step and the peak FLOP/s they are compared with, for the model FLOPs
utilisation (MFU) the training loop logs (docs/parallelism.md §14). Pure arithmetic on a config
and a table: no process, device or tensor.

The FLOPs are those of `lctrain.config.model_size.layer_costs`, the same per-token costs that
balance the pipeline stages (one home for the formula): per token, 3 x the forward's (the
backward computes two matmuls per forward matmul), the forward being 2 FLOPs per matmul weight
of the blocks and of the output layer plus causal attention, 2 S D per block (QK^T and PV over
S/2 keys on average), plus three terms that are not matmuls and below 0.1% for a real model (the
norm weights, the softmax ~5 V and the embedding row lookup). Recomputation under activation
checkpointing is not counted: model FLOPs (MFU), not hardware FLOPs (HFU).
"""

from __future__ import annotations

from lctrain.config import LctrainConfig
from lctrain.config.model_size import layer_costs


def train_flops_per_token(cfg: LctrainConfig) -> float:
    """Forward + backward FLOPs of the whole model per token of train.seq_len-long samples."""
    embedding, blocks, output = layer_costs(cfg.model, cfg.train.seq_len)
    return embedding + sum(blocks) + output


def train_flops_per_step(cfg: LctrainConfig, tokens_per_step: int) -> float:
    """Model FLOPs of one optimizer step over all ranks (`tokens_per_step`: global batch x
    train.seq_len, `Derived.tokens_per_step`)."""
    return train_flops_per_token(cfg) * tokens_per_step


DATASHEET_TFLOPS: tuple[tuple[str, float, float, float], ...] = (
    # (words of torch.cuda.get_device_name, bf16, tf32, fp32): dense, without sparsity
    ("GB200", 2500, 1250, 80),
    ("B200", 2250, 1125, 75),
    ("H100 PCIe", 756, 378, 51),
    ("H100 NVL", 835, 418, 60),
    ("H200 NVL", 835, 418, 60),
    ("H100", 989, 495, 67),  # SXM (HBM3), and H800
    ("H200", 989, 495, 67),  # SXM, and GH200
    ("A100", 312, 156, 19.5),  # SXM and PCIe
)
"""Datasheet peak TFLOP/s per GPU, dense: the first row whose words all appear in the device
name (case-insensitive) applies."""

PRECISIONS = ("bf16", "tf32", "fp32")


def datasheet_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense datasheet peak of the GPU named `device_name` for matmuls in `precision`
    (bf16 | tf32 | fp32); None for a GPU not in `DATASHEET_TFLOPS` (never a guess)."""
    name = device_name.upper()
    for words, *peaks in DATASHEET_TFLOPS:
        if all(w in name for w in words.upper().split()):
            return float(peaks[PRECISIONS.index(precision)])
    return None


def mfu(flops_per_step: float, step_time: float, world_size: int,
        peak_tflops_per_rank: float | None) -> float | None:
    """Model FLOPs utilisation: FLOPs per step / (step time x ranks x peak FLOP/s per rank);
    None without a peak."""
    if peak_tflops_per_rank is None:
        return None
    return flops_per_step / (step_time * world_size * peak_tflops_per_rank * 1e12)
