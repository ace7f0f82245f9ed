"""RoPE: the rotary embedding's cos/sin tables and their application, and the inverse
frequencies for context extension, numerically as in Hugging Face transformers.

rope_type: default (theta only) | linear (positions / factor) | llama3 (Llama 3.1 wavelength-
dependent scaling) | yarn (NTK-by-parts interpolation plus an attention temperature applied to
cos/sin). Returns (inv_freq [head_dim/2] float32, attention_scaling).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lctrain.config import ModelConfig


def rope_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    dim = cfg.rotary_dim  # the head's dims RoPE rotates (all but under partial rotary)
    base, factor = cfg.rope_theta, cfg.rope_factor
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base ** exponents)
    if cfg.rope_type == "default":
        return inv_freq, 1.0
    if cfg.rope_type == "linear":
        return inv_freq / factor, 1.0
    if cfg.rope_type == "llama3":
        return _llama3(inv_freq, cfg), 1.0
    assert cfg.rope_type == "yarn", f"unknown rope_type {cfg.rope_type!r}"
    return _yarn(dim, cfg)


def _llama3(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, old = cfg.rope_factor, cfg.rope_original_max_position
    low_wavelen = old / cfg.rope_low_freq_factor
    high_wavelen = old / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long waves: / factor
    smooth = (old / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    base, factor, old = cfg.rope_theta, cfg.rope_factor, cfg.rope_original_max_position
    attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:  # the ramp's ends on whole dimensions (GPT-OSS keeps them fractional)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, computed in float32 like HF, cast to the input dtype.

    Frequencies come from `lctrain.models.rope` (theta and the optional context-extension
    scaling).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_frequencies(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self) -> None:
        """Compute the frequencies again (a model built on the meta device has none)."""
        self.inv_freq = rope_frequencies(self.cfg)[0].to(self.inv_freq.device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions [B or 1, S] -> cos, sin [B or 1, S, 1, d]
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        scale = self.attention_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x rotated by the tables, in its first cos.shape[-1] dims (model.rotary_fraction < 1:
    the others pass unchanged)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
