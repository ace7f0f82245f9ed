"""lctrain's Ulysses against DeepSpeed-Ulysses, an independent implementation, on gloo ranks.

Every rank builds the full q, k, v and output gradient in float64, runs plain torch SDPA on the
whole sequence (the unsharded reference), shards with `lctrain.layout.sequence.split` (the data
path's function), and feeds the SAME shards to lctrain's `ContextParallelAttention("ulysses")`
and to `deepspeed.sequence.layer.DistributedAttention` wrapping plain SDPA. Outputs and dq/dk/dv
must agree with each other and with the reference.

What DeepSpeed needs that lctrain does internally (adapted on the DeepSpeed side only):
- layout: batch-first [B, S/P, H, d] is `batch_dim_idx=0` on every call (that argument, not
  gather_idx, picks the layout of the even-head all-to-all) with scatter_idx=2, gather_idx=1
  (the default gather_idx=0 describes sequence-first [S/P, B, H, d]); the local attention gets
  [B, S, H/P, d] and must itself transpose to SDPA's [B, H, S, d].
- sequence order: the gathered sequence is the group's shards in rank order and DeepSpeed knows
  nothing of positions, so its local attention is causal only for contiguous shards; for zigzag
  shards it gets an explicit mask from the global positions of those tokens.
- KV heads: DeepSpeed asserts at least P KV heads, and when P does not divide them its
  uneven-head path reads the rank from DeepSpeed's global sequence-parallel state, not from the
  group it is given (every rank is 0 here, and gloo's all-to-all fails). So KV heads are
  repeated (repeat_interleave, keeping q-head groups aligned) to the smallest multiple of P
  first; lctrain does the same inside through `kv_replication`.
  GQA itself is left to the local attention (SDPA enable_gqa), as DeepSpeed does.
"""

import math
import sys
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

deepspeed = pytest.importorskip("deepspeed")
from deepspeed.sequence.layer import DistributedAttention  # noqa: E402

from lctrain.attention import ContextParallelAttention, CPGroups  # noqa: E402
from lctrain.config.derived import kv_replication  # noqa: E402
from lctrain.layout import sequence  # noqa: E402
from lctrain.layout.topology import Topology  # noqa: E402
from lctrain.parallel.runtime import build_mesh, cp_groups  # noqa: E402
from tests.helpers import on_ranks  # noqa: E402

TOL = dict(rtol=1e-10, atol=1e-10)  # float64 everywhere; the paths differ only in summation order


def sdpa(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None = None) -> Tensor:
    """Causal attention, q [B, S, H, d], k/v [B, S, H_kv, d] -> [B, S, H, d], scale 1/sqrt(d).
    Tokens are in position order unless `positions` [S] gives their global positions."""
    mask = None if positions is None else positions[:, None] >= positions[None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return out.transpose(1, 2)


class LocalAttention(torch.nn.Module):
    """DeepSpeed's local attention: the whole group's tokens for H/P heads, [B, S, H/P, d]."""

    def __init__(self, positions: Tensor | None):
        super().__init__()
        self.positions = positions

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, self.positions)


def deepspeed_kv_repeat(n_kv_heads: int, degree: int) -> int:
    """Smallest r with r * n_kv_heads a multiple of the Ulysses degree (and so >= it)."""
    return degree // math.gcd(n_kv_heads, degree)


def check_case(case: dict, groups: CPGroups) -> None:
    B, S, H, Hkv, hd, lb = (case[k] for k in ("B", "S", "H", "Hkv", "hd", "lb"))
    P, rank = groups.cp_size, groups.cp_rank
    gen = torch.Generator().manual_seed(zlib.crc32(repr(sorted(case.items())).encode()))
    q, dout = (torch.randn(B, S, H, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, hd, generator=gen, dtype=torch.float64) for _ in range(2))

    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = sdpa(*ref_in)
    ref_out.backward(dout)

    def local(x: Tensor) -> Tensor:
        return sequence.split(x, 1, rank, P, lb)

    rep = kv_replication(H, Hkv, tp=1, cp_ulysses=P)
    lc_in = [local(x).requires_grad_() for x in (q, k, v)]
    lc_attn = ContextParallelAttention("ulysses", groups, S, lb, kv_replication=rep)
    lc_out = lc_attn(*lc_in)
    lc_out.backward(local(dout))

    ds_in = [local(x).requires_grad_() for x in (q, k, v)]
    ds_rep = deepspeed_kv_repeat(Hkv, P)
    assert ds_rep == rep, f"DeepSpeed and lctrain replicate KV heads differently: {case}"
    ds_k, ds_v = (x.repeat_interleave(ds_rep, dim=2) for x in ds_in[1:])
    gathered = torch.cat([sequence.positions(S, r, P, lb) for r in range(P)])
    in_order = torch.equal(gathered, torch.arange(S))
    ds_attn = DistributedAttention(LocalAttention(None if in_order else gathered), groups.ulysses,
                                   scatter_idx=2, gather_idx=1)
    ds_out = ds_attn(ds_in[0], ds_k, ds_v, batch_dim_idx=0)
    ds_out.backward(local(dout))

    assert lc_out.shape == ds_out.shape == (B, S // P, H, hd), (lc_out.shape, ds_out.shape, case)
    torch.testing.assert_close(lc_out, ds_out, **TOL, msg=f"lctrain vs DeepSpeed out {case}")
    torch.testing.assert_close(lc_out, local(ref_out.detach()), **TOL, msg=f"out {case}")
    for name, lc, ds, ref in zip("qkv", lc_in, ds_in, ref_in):
        torch.testing.assert_close(lc.grad, ds.grad, **TOL,
                                   msg=f"lctrain vs DeepSpeed d{name} {case}")
        torch.testing.assert_close(lc.grad, local(ref.grad), **TOL, msg=f"d{name} {case}")


def run_cases(cases: list[dict]) -> int:
    world = dist.get_world_size()
    # DeepSpeed's CPU backend compiles a shared-memory all-reduce when it starts (about 30 s on
    # 2 cores, whenever its torch_extensions cache is empty or was built by another venv); the
    # Ulysses exchange is an all-to-all and never uses it (by sys.modules: the attribute
    # deepspeed.comm.torch is torch itself)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    topology = Topology(cp_ulysses=world)
    groups = cp_groups(topology, build_mesh(topology, "cpu"), dist.get_rank())
    for case in cases:
        check_case(case, groups)
    return len(cases)


def cases_for(world: int) -> list[dict]:
    # (H, H_kv): MHA with 3 heads per rank; GQA; MQA (KV repeated P times); at P=4 also fewer
    # KV heads than ranks (2 -> 4) and more but not a multiple (6 -> 12)
    shapes = [(3 * world, 3 * world), (8, 2), (3 * world, 1)]
    if world == 4:
        shapes.append((12, 6))
    return [dict(B=2, S=8 * world, H=H, Hkv=Hkv, hd=8, lb=lb)
            for H, Hkv in shapes for lb in ("none", "zigzag")]


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_deepspeed_ulysses(world):
    cases = cases_for(world)
    assert on_ranks(run_cases, world, cases, timeout_s=120) == [len(cases)] * world
