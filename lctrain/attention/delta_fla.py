"""The gated delta rule on flash-linear-attention's Triton kernels (the `fla` package of the
`gpu` extra; CUDA only; train.linear_kernel, docs/parallelism.md §31), behind the same contract
as lctrain's chunked rule in plain torch (`lctrain.attention.delta_rule.chunk_gated_delta_rule`),
so that every linear core (one rank, state passing, the head split) runs on either.

Packed documents become fla's variable-length sequences: the rows are flattened into one, cut
at every row's start and every document boundary (`cu_seqlens`, made on the host from the host
document ids, so the kernel needs no host read). A row's initial state goes to its first
document, zeros to the others; its final state is its last document's. The transition T of a
row (final(S0) = T S0 + final(0), zero when the row holds a boundary) is what the rule makes of
the initial state I with no values (v = 0 leaves only T S0): a second call with d_k columns.
"""

from __future__ import annotations

import importlib.util
from functools import cache

import torch
from torch import Tensor

from lctrain.config.kernel_backends import FLA_INSTALL


@cache
def fla_installed() -> bool:
    """Whether flash-linear-attention's package (`fla`) can be imported (checked once)."""
    return importlib.util.find_spec("fla") is not None


def _fla_rule():
    try:  # lazy: optional extra, CUDA only
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise RuntimeError(f"train.linear_kernel=fla needs flash-linear-attention: {FLA_INSTALL}; "
                           "or use train.linear_kernel=torch") from e
    return chunk_gated_delta_rule


def _sequences(doc_ids: Tensor | None, rows: int, length: int
               ) -> tuple[Tensor, Tensor, Tensor]:
    """(cu_seqlens [N + 1] int64, each row's first sequence [B], each row's last [B]) of the
    flattened rows cut at every row start and document boundary (host)."""
    starts = torch.ones(rows, length, dtype=torch.bool)
    if doc_ids is not None:
        docs = doc_ids.cpu()
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    flat = starts.flatten()
    cu = torch.cat([flat.nonzero().flatten(), torch.tensor([rows * length])])
    sequence = flat.cumsum(0) - 1  # each token's sequence
    row_starts = torch.arange(rows) * length
    return cu, sequence[row_starts], sequence[row_starts + length - 1]


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         doc_ids: Tensor | None = None, initial_state: Tensor | None = None,
                         chunk: int = 64, transition: bool = False
                         ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """`chunk_gated_delta_rule`'s contract (q, k [B, S, H_k, d_k], v [B, S, H, d_v], g and beta
    [B, S, H], doc_ids [B, S] or None, initial_state [B, H, d_k, d_v] or None -> output
    [B, S, H, d_v], final state [B, H, d_k, d_v] in float32 (float64 for float64 inputs, which
    only a stand-in for fla takes), and with `transition` T
    [B, H, d_k, d_k]) on fla's kernels (their value heads grouped on the key heads as
    lctrain's: value head j reads key head j // (H / H_k))."""
    rule = _fla_rule()
    b, s, _, d_k = k.shape
    h, d_v = v.shape[2], v.shape[3]
    cu, first, last = _sequences(doc_ids, b, s)
    device, wide = v.device, torch.promote_types(v.dtype, torch.float32)  # the states' dtype
    flat = [x.reshape(1, b * s, *x.shape[2:]) for x in (q, k, v, g, beta)]
    start = torch.zeros(len(cu) - 1, h, d_k, d_v, dtype=wide, device=device)
    if initial_state is not None:
        start = start.index_copy(0, first.to(device), initial_state.to(wide))
    kernel = {"cu_seqlens": cu.to(device), "cu_seqlens_cpu": cu, "chunk_size": chunk,
              "use_qk_l2norm_in_kernel": True, "output_final_state": True}
    out, final = rule(*flat, initial_state=start, **kernel)
    out = out.reshape(b, s, h, d_v)
    final = final[last.to(device)]
    if not transition:
        return out, final
    eye = torch.eye(d_k, dtype=wide, device=device).expand(b, h, d_k, d_k)
    start = torch.zeros(len(cu) - 1, h, d_k, d_k, dtype=wide, device=device)
    start = start.index_copy(0, first.to(device), eye)
    no_values = flat[2].new_zeros(1, b * s, h, d_k)
    _, moved = rule(flat[0], flat[1], no_values, flat[3], flat[4], initial_state=start,
                    **kernel)
    return out, final, moved[last.to(device)]
