"""The configuration rules that depend on the device a run trains on: the attention kernel
named for it (train.attention_kernel), and on CUDA what the flash kernels take (dtype, head
size) and how the ranks must start. `lctrain.config.validation` runs them when train.device
names the device; `lctrain train` runs them again once train.device=auto is resolved.
"""

from __future__ import annotations

from lctrain.config.kernel_backends import LINEAR_KERNELS, backends_on, kernel_backend
from lctrain.config.model_families import model_family
from lctrain.config.model_parts import SINKS
from lctrain.config.schema import LctrainConfig
from lctrain.config.suggest import nearest_multiple

FLASH_HEAD_DIM_MAX = 256


def has_window_or_sinks(cfg: LctrainConfig) -> bool:
    """Whether some layer attends through a sliding window shorter than the longest sequence
    the run trains on, or the family has attention sinks: both run lctrain's kernels (the
    window and the sinks' merge are theirs) at every cp."""
    m, longest = cfg.model, max([cfg.train.seq_len, *(s.seq_len for s in cfg.train.stages)])
    windows = (m.layer_window(i) for i in range(m.n_layers))
    return model_family(m.family).has(SINKS) or any(w is not None and w < longest for w in windows)


def uses_lctrain_kernels(cfg: LctrainConfig) -> bool:
    """Whether attention runs lctrain's kernel layer rather than PyTorch's SDPA: context
    parallelism, packed documents, deterministic attention, a kernel chosen by name, sliding
    windows or attention sinks."""
    return (cfg.parallel.cp > 1 or cfg.data.document_masking or cfg.train.deterministic
            or cfg.train.attention_kernel != "auto" or has_window_or_sinks(cfg))


def kernel_device_problems(cfg: LctrainConfig, device: str) -> list[str]:
    """train.attention_kernel (and train.linear_kernel) against the device the run trains on
    (cpu | cuda)."""
    linear = cfg.train.linear_kernel
    if linear != "auto" and LINEAR_KERNELS[linear].device not in ("any", device):
        names = {"cpu": "the CPU", "cuda": "CUDA"}
        return [f"train.linear_kernel={linear} runs on {names[LINEAR_KERNELS[linear].device]} "
                f"only, and this run trains on {names[device]}; use train.linear_kernel=auto "
                "(or torch)" + (" or train.device=cuda" if device == "cpu" else "")]
    kernel = cfg.train.attention_kernel
    if kernel == "auto" or kernel_backend(kernel).device == device:
        return []
    if device == "cuda":
        return [f"train.attention_kernel={kernel} runs on the CPU only, and this run trains on "
                f"CUDA; use train.attention_kernel=auto (or {', '.join(backends_on('cuda'))})"]
    return [f"train.attention_kernel={kernel} runs on CUDA only, and this run trains on the "
            f"CPU; use train.attention_kernel=auto (or {', '.join(backends_on('cpu'))}) or "
            "train.device=cuda"]


def cuda_problems(cfg: LctrainConfig) -> list[str]:
    """Rules for a run on CUDA: the flash kernels' dtypes and head sizes (torch's built-in and
    flash-attn's alike), the kernel's device, and ranks that can use CUDA."""
    m, problems = cfg.model, kernel_device_problems(cfg, "cuda")
    if cfg.launch.start_method == "fork":
        problems.append("launch.start_method=fork with CUDA: a forked rank cannot initialise "
                        "CUDA; set launch.start_method=auto (spawn on CUDA)")
    if not uses_lctrain_kernels(cfg):
        return problems
    why = ("context parallelism, packed documents, deterministic attention, a named "
           "train.attention_kernel, sliding windows and attention sinks run flash attention on "
           "CUDA (torch's built-in or flash-attn)")
    if cfg.train.dtype == "fp32":
        problems.append(f"train.dtype=fp32 on CUDA: {why}, which takes bf16/fp16 only; set "
                        "train.dtype=bf16 (weights and optimizer state stay fp32)")
    if m.head_dim is not None or m.dim % m.n_heads == 0:
        if m.d_head % 8 or m.d_head > FLASH_HEAD_DIM_MAX:
            key = "model.head_dim" if m.head_dim is not None else \
                "head dim model.dim / model.n_heads"
            fix = (f"model.head_dim={nearest_multiple(m.d_head, 8)}" if m.head_dim is not None
                   else f"model.dim={nearest_multiple(m.dim, 8 * m.n_heads)}")
            problems.append(f"{key} = {m.d_head} on CUDA: {why}, which needs a multiple of 8 "
                            f"up to {FLASH_HEAD_DIM_MAX}; try {fix}")
    return problems + _flash_shape_problems(cfg, why)


VARLEN_TOKENS_MAX = 2**31 - 1
"""The most tokens one variable-length flash call takes: its cumulative lengths are int32."""


def _flash_shape_problems(cfg: LctrainConfig, why: str) -> list[str]:
    """The varlen calls' int32 token offsets. (The GQA ratio each rank's kernels see, query
    heads a multiple of KV heads after TP, Ulysses and KV replication, is validation's heads
    rule for every device: `kv_replication` exists only for layouts that keep it.)"""
    t = cfg.train
    if cfg.data.document_masking and t.micro_batch * t.seq_len > VARLEN_TOKENS_MAX:
        return [f"train.micro_batch x train.seq_len = {t.micro_batch * t.seq_len:,} tokens with "
                f"packed documents on CUDA: {why}, whose variable-length calls take at most "
                f"{VARLEN_TOKENS_MAX:,} tokens (int32 offsets); lower train.micro_batch"]
    return []
