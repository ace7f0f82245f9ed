"""The RMSNorm every block, head norm and final norm uses: Hugging Face's arithmetic, computed
tile by tile of rows so that its float32 working tensors stay small at any sequence length
(`NORM_TILE_ELEMENTS`), and sequence parallel under TP (each rank normalises its own rows).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from lctrain.config.model_families import NORM_TILE_ELEMENTS
from lctrain.models.init import ZEROS


def _row_tiles(rows: int, dim: int):
    """Slices of `rows` rows of `dim` elements, `NORM_TILE_ELEMENTS` elements each at most."""
    step = max(1, NORM_TILE_ELEMENTS // dim)
    return (slice(start, start + step) for start in range(0, rows, step))


class _RMSNormRows(torch.autograd.Function):
    """RMSNorm over the last dimension, Hugging Face's arithmetic (normalise in float32, scale
    by w in the input dtype, or by 1 + w in float32), row tile by row tile
    (`NORM_TILE_ELEMENTS`), so its float32 working tensors are a tile each whatever the
    sequence length: the same expression over the whole input holds up to two float32 copies
    of it in the forward and seven in autograd's backward (64 GiB for an 8B model's 600K
    tokens). It keeps for the backward its input, w and each row's float32 rsqrt, and the
    backward recomputes the normalised rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: bool) -> Tensor:
        dim = x.shape[-1]
        xs = x.reshape(-1, dim)
        out = torch.empty(xs.shape, dtype=x.dtype if offset else
                          torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(xs.shape[0], 1, dtype=torch.float32, device=x.device)
        for tile in _row_tiles(xs.shape[0], dim):
            xf = xs[tile].float()
            rstd[tile] = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = xf * rstd[tile]
            out[tile] = (y * (1.0 + weight.float())).to(x.dtype) if offset else \
                weight * y.to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out.view(*x.shape[:-1], dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        xs, gs = x.reshape(-1, dim), grad.reshape(-1, dim)
        scale = weight.float() + 1.0 if ctx.offset else weight.float()
        gx = torch.empty_like(xs)
        gw = torch.zeros(dim, dtype=torch.float32, device=x.device)
        for tile in _row_tiles(xs.shape[0], dim):
            y, g = xs[tile].float() * rstd[tile], gs[tile].float()
            # w's gradient: the output's, times what w scaled (in the input dtype without offset)
            gw += (g * (y if ctx.offset else y.to(x.dtype).float())).sum(0)
            gy = g * scale
            # d/dx of x * rsqrt(mean(x^2) + eps): rsqrt * (gy - y * mean(gy * y))
            gx[tile] = (rstd[tile] * (gy - y * (gy * y).mean(-1, keepdim=True))).to(x.dtype)
        return gx.view_as(x), gw.to(weight.dtype), None, None


class RMSNorm(nn.Module):
    """RMSNorm scaled by its weight w, or by 1 + w with `offset` (Gemma; w starts at zero)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (as HF Llama does), scale in the input dtype (Gemma: scale in
        # float32 too, as HF Gemma does). Under autocast the output is in the compute dtype:
        # the projections that read it then share one copy instead of each casting its own.
        if isinstance(x, DTensor):  # sequence parallel: each rank normalises its own rows
            mesh_dims = self.weight.device_mesh.ndim  # w's gradient: this rank's rows' part
            weight = self.weight.to_local(grad_placements=[Partial()] * mesh_dims)
            out = _RMSNormRows.apply(x.to_local(), weight, self.eps, self.offset)
            out = DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
        else:
            out = _RMSNormRows.apply(x, self.weight, self.eps, self.offset)
        if torch.is_autocast_enabled(x.device.type):
            out = out.to(torch.get_autocast_dtype(x.device.type))
        return out

    def init_rules(self) -> dict[str, float | None]:
        return {"weight": ZEROS if self.offset else None}  # a scale of one either way
