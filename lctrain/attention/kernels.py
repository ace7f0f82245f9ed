"""The attention kernels and the (out, lse) merge: planned calls (calls.py) executed on a device.

Backends (train.attention_kernel; `auto` picks by device): `cpu` (PyTorch's CPU flash-attention
op, one call per KernelCall); `torch` (CUDA: PyTorch's own flash-attention ops, no extra package)
and `flash_attn` (CUDA: the flash-attn package), both dense without documents and, with packed
documents, one variable-length call per kind and block pair instead of one call per document
(cuda_kernels.py); `reference` (the varlen path with a plain-torch varlen kernel that follows
flash attention's conventions: what tests run on the CPU to check the varlen packing, index maps
and lse handling the CUDA backends use). Results merge into float32 accumulators with one
numerically stable (out, lse) merge (docs/parallelism.md §4).

Tensors are [B, S, H, d] (H_kv heads for k and v: GQA is native in the kernels); lse is
[B, H, S] float32. A query row with no visible key has lse = -inf and output 0 (the CUDA kernels
report such rows with lse = +inf: mapped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain import device
from lctrain.attention import cuda_kernels as cuda
from lctrain.attention.calls import ALL_ROWS, Block, KernelCall, VarlenGroup
from lctrain.attention.varlen_reference import varlen_backward, varlen_forward, visible
from lctrain.config.kernel_backends import KERNEL_BACKENDS, backends_on
from lctrain.config.registry import Registry

_NEG_INF = float("-inf")


def auto_backend(on: torch.device) -> str:
    """`auto`: of the backends of the device's kind (`KernelBackend.device`) whose code is
    installed, the one `auto` ranks first: flash-attn on CUDA when it is installed, else
    torch's own kernels; cpu on the CPU."""
    kind = "cuda" if device.gpu_path(on) else "cpu"
    ranked = sorted((KERNEL_BACKENDS[n].auto_rank, n) for n in backends_on(kind)
                    if KERNEL_BACKENDS[n].auto_rank is not None and KERNEL_CODE[n].installed())
    return ranked[0][1]


@dataclass(frozen=True)
class KernelOptions:
    """How the kernels run: the backend (`auto`: by device, see auto_backend), and whether the
    CUDA backward is deterministic (train.deterministic)."""

    backend: str = "auto"
    deterministic: bool = False

    def backend_for(self, device: torch.device) -> str:
        if self.backend == "auto":
            return auto_backend(device)
        assert self.backend in KERNEL_CODE, self.backend
        return self.backend


DEFAULT_KERNEL = KernelOptions()


def acc_dtype(x: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (reference-grade runs)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def new_accumulators(q: Tensor) -> tuple[Tensor, Tensor]:
    """Empty (out, lse) accumulators for q [B, S, H, d]: zeros and -inf (see acc_dtype)."""
    b, s, h, d = q.shape
    return (torch.zeros(b, s, h, d, dtype=acc_dtype(q), device=q.device),
            torch.full((b, h, s), _NEG_INF, dtype=acc_dtype(q), device=q.device))


def merge_into(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """In place: (out_acc, lse_acc) <- softmax-merge of itself with (out, lse).

    out [B, S, H, d], lse [B, H, S]; rows where both lse are -inf stay (0, -inf).
    """
    new = torch.logaddexp(lse_acc, lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(lse_acc - new), 0.0).transpose(1, 2)[..., None]
    w_new = torch.where(finite, torch.exp(lse - new), 0.0).transpose(1, 2)[..., None]
    out_acc.mul_(w_old).add_(out.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


def add_sink(out: Tensor, lse: Tensor, sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """The merged (out [B, S, H, d], lse [B, H, S]) with attention sinks: per head a logit
    sink[h] joins every query's softmax denominator and carries no value, as one more key every
    query sees with value zero, merged once like a block: out * exp(lse - lse'),
    lse' = logaddexp(lse, sink) (docs/parallelism.md §26). Unchanged when sink is None. The
    backward of q, k, v needs nothing else: given the final (out', lse') each key's
    probability is already the sinked one."""
    if sink is None:
        return out, lse
    new = torch.logaddexp(lse, sink.detach().to(lse.dtype)[None, :, None].expand_as(lse))
    weight = torch.exp(lse - new).transpose(1, 2)[..., None]
    return out * weight.to(out.dtype), new


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor | None) -> Tensor | None:
    """d loss / d sink [H] from the final (out, lse) and the output's gradient: the sink's
    probability exp(sink - lse) times -(dout . out) in each query row (the softmax gradient of
    a key of value zero), summed over the batch and the positions; None without sinks."""
    if sink is None:
        return None
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # [B, H, S]
    return -(torch.exp(sink.detach().to(acc)[None, :, None] - lse) * delta).sum((0, 2)).to(
        sink.dtype)


# ---- dense kernels: one call covers all rows of a (query slice, key slice) --------------------

def _band_mask(q: Tensor, k: Tensor, band: tuple[int, int] | None) -> Tensor | None:
    """The CPU op's additive mask [Sq, Sk] for a band call (it takes no window); None else."""
    if band is None:
        return None
    seen = visible(q.shape[1], k.shape[1], False, band, q.device)
    return torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, _NEG_INF)


def _cpu_fwd(q, k, v, causal, scale, options, band=None):
    # [B, S, H, d] -> the CPU op's [B, H, S, d]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
        attn_mask=_band_mask(q, k, band), scale=scale)
    return out.transpose(1, 2), lse


def _cpu_bwd(dout, q, k, v, out, lse, causal, scale, options, band=None):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *(x.transpose(1, 2) for x in (dout, q, k, v, out)), lse, 0.0, causal,
        attn_mask=_band_mask(q, k, band), scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---- varlen kernels: one call per kind covers every document of a block pair -----------------

def _reference_varlen_fwd(q, k, v, group: VarlenGroup, cu_q, cu_k, scale, options):
    out, lse = varlen_forward(q, k, v, cu_q, cu_k, scale, group.causal, group.band)
    return out, cuda.no_key_lse(lse)


def _reference_varlen_bwd(dout, q, k, v, out, lse, group, cu_q, cu_k, scale, options):
    return varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, group.causal, group.band)


@dataclass
class KernelCode:
    """A backend's code, registered under the name of its facts
    (`lctrain.config.kernel_backends`): (forward, backward) for dense calls, and for packed
    (variable-length) calls when its facts say `varlen` (else documents run call by call); the
    ops its forward dispatches, whose outputs selective checkpointing keeps; whether it can run
    here (its optional package imports)."""

    name: str
    dense: tuple[Callable, Callable]
    varlen: tuple[Callable, Callable] | None = None
    forward_ops: Callable[[], set] = set
    installed: Callable[[], bool] = lambda: True


KERNEL_CODE: Registry[KernelCode] = Registry("attention kernel implementation")
for _code in (
        KernelCode("torch", (cuda.torch_forward, cuda.torch_backward),
                   (cuda.torch_varlen_forward, cuda.torch_varlen_backward),
                   forward_ops=cuda.torch_forward_ops),
        KernelCode("flash_attn", (cuda.flash_forward, cuda.flash_backward),
                   (cuda.flash_varlen_forward, cuda.flash_varlen_backward),
                   forward_ops=cuda.flash_forward_ops,
                   installed=lambda: cuda.flash_attn_installed()),  # read when asked
        KernelCode("cpu", (_cpu_fwd, _cpu_bwd)),
        KernelCode("reference", (_cpu_fwd, _cpu_bwd),
                   (_reference_varlen_fwd, _reference_varlen_bwd))):
    KERNEL_CODE.add(_code)


def forward_ops(backend: str) -> set:
    """The ops `backend`'s forward dispatches, whose outputs selective checkpointing keeps."""
    return KERNEL_CODE[backend].forward_ops()


def _packed(qb: Block, kb: Block, causal: bool, window: int | None,
            backend: str) -> list[VarlenGroup] | None:
    """The varlen groups to run instead of per-document calls (None: run the calls)."""
    calls = qb.calls(kb, causal, window)
    if KERNEL_CODE[backend].varlen is None or not calls or calls[0].rows == ALL_ROWS:
        return None
    return qb.varlen_groups(kb, causal, window)


def _rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, S, ...] rows at flat indices b * S + s -> [n, ...]."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


def _lse_rows(lse: Tensor, index: Tensor) -> Tensor:
    """lse [B, H, S] at flat (b, s) indices -> [n, H]."""
    return lse.transpose(1, 2).reshape(-1, lse.shape[1]).index_select(0, index)


def _whole_call(q: Tensor, k: Tensor, qb: Block, kb: Block, causal: bool,
                window: int | None) -> KernelCall | None:
    """The one dense call that covers every query and key, else None."""
    calls = qb.calls(kb, causal, window)
    if len(calls) != 1 or calls[0].rows != ALL_ROWS:
        return None
    qs, ks = calls[0].q, calls[0].k
    whole = (qs.start, qs.stop, ks.start, ks.stop) == (0, q.shape[1], 0, k.shape[1])
    return calls[0] if whole else None


def attend_whole(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                 scale: float, options: KernelOptions = DEFAULT_KERNEL,
                 window: int | None = None) -> tuple | None:
    """(out, lse) straight from the kernel when one dense call covers every query and key (no
    accumulator, no merge: local attention costs what the kernel costs); else None."""
    call = _whole_call(q, k, qb, kb, causal, window)
    if call is None:
        return None
    forward = KERNEL_CODE[options.backend_for(q.device)].dense[0]
    out, lse = forward(q, k, v, call.kind == "causal", scale, options, call.band)
    return out, lse.to(acc_dtype(q))


def attend_whole_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, qb: Block, kb: Block, causal: bool, scale: float,
                          options: KernelOptions = DEFAULT_KERNEL,
                          window: int | None = None) -> tuple | None:
    """(dq, dk, dv) straight from the kernel for a pair `attend_whole` ran whole; else None."""
    call = _whole_call(q, k, qb, kb, causal, window)
    if call is None:
        return None
    backward = KERNEL_CODE[options.backend_for(q.device)].dense[1]
    return backward(dout, q, k, v, out, lse, call.kind == "causal", scale, options, call.band)


def attend_forward(q: Tensor, k: Tensor, v: Tensor, qb: Block, kb: Block, causal: bool,
                   scale: float, out_acc: Tensor, lse_acc: Tensor,
                   options: KernelOptions = DEFAULT_KERNEL, window: int | None = None) -> int:
    """Attend q (positions qb) to k, v (positions kb); merge into the accumulators. `window`:
    a sliding window of that many keys (None: none).

    q [B, Sq, H, d], k/v [B, Sk, Hkv, d], out_acc [B, Sq, H, d] f32, lse_acc [B, H, Sq] f32.
    Returns the number of kernel launches (0 when every pair was masked out).
    """
    backend = options.backend_for(q.device)
    groups = _packed(qb, kb, causal, window, backend)
    if groups is not None:
        fwd = KERNEL_CODE[backend].varlen[0]
        flat_out = out_acc.view(-1, *out_acc.shape[2:])
        for g in groups:
            q_index, k_index, cu_q, cu_k = g.on(q.device)
            out, lse = fwd(_rows(q, q_index), _rows(k, k_index), _rows(v, k_index), g, cu_q,
                           cu_k, scale, options)
            # the group's rows as one sequence: out [1, n, H, d], lse [1, H, n] (copies)
            rows_out = flat_out.index_select(0, q_index)[None]
            rows_lse = _lse_rows(lse_acc, q_index).t()[None]
            merge_into(rows_out, rows_lse, out[None], lse[None])
            flat_out.index_copy_(0, q_index, rows_out[0])
            _lse_scatter(lse_acc, q_index, rows_lse[0].t())
        return len(groups)
    fwd = KERNEL_CODE[backend].dense[0]
    calls = qb.calls(kb, causal, window)
    for bs, qs, ks, kind, band in calls:
        out, lse = fwd(q[bs, qs], k[bs, ks], v[bs, ks], kind == "causal", scale, options, band)
        merge_into(out_acc[bs, qs], lse_acc[bs, :, qs], out, lse)
    return len(calls)


def _lse_scatter(lse: Tensor, index: Tensor, rows: Tensor) -> None:
    """lse [B, H, S] at flat (b, s) indices <- rows [n, H]."""
    b, h, s = lse.shape
    lse.view(b * h * s).index_copy_(
        0, ((index // s) * h * s + index % s)[:, None].add(torch.arange(h, device=lse.device) * s)
        .flatten(), rows.flatten())


def attend_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    qb: Block, kb: Block, causal: bool, scale: float, dq_acc: Tensor,
                    dk_acc: Tensor, dv_acc: Tensor, options: KernelOptions = DEFAULT_KERNEL,
                    window: int | None = None) -> None:
    """Gradient contributions of this (q, kv) block, given the FINAL out and lse of q's rows.

    With the merged lse, each block's softmax probabilities are exact, so per-block backward
    results simply add up (flash-attention backward decomposition). Accumulators are float32.
    """
    backend = options.backend_for(q.device)
    groups = _packed(qb, kb, causal, window, backend)
    if groups is not None:
        bwd = KERNEL_CODE[backend].varlen[1]
        for g in groups:
            q_index, k_index, cu_q, cu_k = g.on(q.device)
            dq, dk, dv = bwd(_rows(dout, q_index), _rows(q, q_index), _rows(k, k_index),
                             _rows(v, k_index), _rows(out, q_index),
                             _lse_rows(lse, q_index).t().contiguous(), g, cu_q, cu_k, scale,
                             options)
            for acc, grad, index in ((dq_acc, dq, q_index), (dk_acc, dk, k_index),
                                     (dv_acc, dv, k_index)):
                acc.view(-1, *acc.shape[2:]).index_add_(0, index, grad.to(acc.dtype))
        return
    bwd = KERNEL_CODE[backend].dense[1]
    for bs, qs, ks, kind, band in qb.calls(kb, causal, window):
        dq, dk, dv = bwd(dout[bs, qs], q[bs, qs], k[bs, ks], v[bs, ks], out[bs, qs],
                         lse[bs, :, qs], kind == "causal", scale, options, band)
        dq_acc[bs, qs] += dq
        dk_acc[bs, ks] += dk
        dv_acc[bs, ks] += dv
