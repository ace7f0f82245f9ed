"""The CUDA attention backends behind lctrain's kernel layer, both with flash-attention's (out, lse)
contract (docs/parallelism.md §21):

- `torch`: PyTorch's own flash-attention ops, `aten._flash_attention_forward` / `_backward`, in
  every CUDA build of torch 2.6 to 2.13 (no extra package). Dense calls take [B, S, H, d] and
  return lse [B, H, S]; variable-length calls take [total, H, d] with int32 cumulative sequence
  lengths and return lse [H, total_q]. GQA is native (H_kv divides H). The backward takes the
  final, merged out and lse.
- `flash_attn`: the flash-attn package (>= 2.7, the optional `gpu` extra), same layouts.

Both report rows that see no key with lse = +inf; lctrain's merge expects -inf (mapped here).
Deterministic backward: flash-attn takes a flag; torch's op reads torch's deterministic-algorithms
switch, which is set around each backward call only (never left on for the rest of the step).
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch
from torch import Tensor

from lctrain import device
from lctrain.config.kernel_backends import FLASH_INSTALL


@cache
def flash_attn_installed() -> bool:
    """Whether the optional flash-attn package can be imported (checked once)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_interface():
    """flash-attn's kernel module (the optional `gpu` extra), or a clear error."""
    try:
        from flash_attn import flash_attn_interface  # lazy: optional extra, CUDA only
    except ImportError as e:
        raise RuntimeError("train.attention_kernel=flash_attn needs flash-attn >= 2.7: "
                           f"{FLASH_INSTALL}; or use train.attention_kernel=torch") from e
    return flash_attn_interface


def no_key_lse(lse: Tensor) -> Tensor:
    """flash attention's lse for rows that saw no key is +inf; lctrain's merge expects -inf."""
    return torch.where(lse == float("inf"), float("-inf"), lse)


@cache
def _no_dropout_state(device: torch.device) -> tuple[Tensor, Tensor]:
    """The (rng_state, unused) pair torch's flash backward takes; read only with dropout, so
    made once per device rather than at every backward call."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


# ---- torch: aten._flash_attention_forward / _backward ---------------------------------------

def _window(band: tuple[int, int] | None) -> tuple[int, int]:
    """A band call's (window_size_left, window_size_right); (-1, -1) without one."""
    return (-1, -1) if band is None else band


def torch_forward(q, k, v, causal, scale, options, band=None):
    """Dense: q [B, Sq, H, d], k/v [B, Sk, H_kv, d] -> out like q, lse [B, H, Sq] float32."""
    left, right = _window(band)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale,
        window_size_left=left, window_size_right=right)
    return out, no_key_lse(lse)


def torch_backward(dout, q, k, v, out, lse, causal, scale, options, band=None):
    dout, out = dout.contiguous(), out.contiguous()
    left, right = _window(band)
    with device.deterministic_algorithms(options.deterministic):
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0,
            causal, *_no_dropout_state(q.device), scale=scale, window_size_left=left,
            window_size_right=right)
    return dq, dk, dv


def torch_varlen_forward(q, k, v, group, cu_q, cu_k, scale, options):
    """Packed: q [total_q, H, d], k/v [total_k, H_kv, d], cu_* int32 [n + 1] -> out like q,
    lse [H, total_q] float32."""
    left, right = _window(group.band)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, group.max_q, group.max_k, 0.0, group.causal, False, scale=scale,
        window_size_left=left, window_size_right=right)
    return out, no_key_lse(lse)


def torch_varlen_backward(dout, q, k, v, out, lse, group, cu_q, cu_k, scale, options):
    left, right = _window(group.band)
    with device.deterministic_algorithms(options.deterministic):
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, group.max_q, group.max_k, 0.0,
            group.causal, *_no_dropout_state(q.device), scale=scale, window_size_left=left,
            window_size_right=right)
    return dq, dk, dv


# ---- flash_attn: the flash-attn package ------------------------------------------------------

def flash_forward(q, k, v, causal, scale, options, band=None):
    left, right = _window(band)
    out, lse, *_ = flash_attn_interface()._flash_attn_forward(
        q, k, v, 0.0, scale, causal=causal, window_size_left=left, window_size_right=right,
        softcap=0.0, alibi_slopes=None, return_softmax=False)
    return out, no_key_lse(lse)


def flash_backward(dout, q, k, v, out, lse, causal, scale, options, band=None):
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    flash_attn_interface()._flash_attn_backward(
        dout, q, k, v, out, lse.contiguous(), dq, dk, dv, 0.0, scale, causal, *_window(band),
        0.0, None, options.deterministic)
    return dq, dk, dv


def flash_varlen_forward(q, k, v, group, cu_q, cu_k, scale, options):
    left, right = _window(group.band)
    out, lse, *_ = flash_attn_interface()._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, group.max_q, group.max_k, 0.0, scale, causal=group.causal,
        window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None,
        return_softmax=False)
    return out, no_key_lse(lse)


def flash_varlen_backward(dout, q, k, v, out, lse, group, cu_q, cu_k, scale, options):
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    flash_attn_interface()._flash_attn_varlen_backward(
        dout, q, k, v, out, lse.contiguous(), dq, dk, dv, cu_q, cu_k, group.max_q, group.max_k,
        0.0, scale, group.causal, *_window(group.band), 0.0, None, options.deterministic)
    return dq, dk, dv


def torch_forward_ops() -> set:
    """The op the torch backend's forward dispatches."""
    return {torch.ops.aten._flash_attention_forward.default}


def flash_forward_ops() -> set:
    """The ops flash-attn's forward dispatches (none when it is not installed)."""
    if not flash_attn_installed():
        return set()
    flash_attn_interface()  # registers flash-attn's custom ops (flash-attn >= 2.7)
    names = ("_flash_attn_forward", "_flash_attn_varlen_forward")
    return {getattr(torch.ops.flash_attn, n).default for n in names
            if hasattr(torch.ops.flash_attn, n)}
