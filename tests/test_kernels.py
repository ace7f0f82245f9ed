"""The kernel layer on the CPU: calls are planned on the host once per block pair (per
micro-batch with documents), the varlen packing covers every call exactly once per wave, and
flash-attn's conventions (lse = +inf for rows that see no key, bottom-right causal alignment)
are what the plain-torch varlen kernel reproduces and what the merge expects after mapping."""

import pytest
import torch

from lctrain.attention import ContextParallelAttention, CPGroups, cuda_kernels
from lctrain.attention import calls as calls_module
from lctrain.attention.calls import Block, band_rows, kernel_calls
from lctrain.attention.cuda_kernels import no_key_lse as _no_key_lse
from lctrain.attention.kernels import (
    KernelOptions,
    merge_into,
    new_accumulators,
)
from lctrain.attention.local import local_attention
from lctrain.attention.varlen_reference import register_cpu_flash_ops, varlen_forward
from lctrain.layout import sequence
from tests.reference import reference_attention


def test_calls_are_planned_once_per_micro_batch(monkeypatch):
    planned = []

    def counting(qb, kb, causal, window):
        planned.append((id(qb), id(kb)))
        return kernel_calls(qb, kb, causal, window)

    monkeypatch.setattr(calls_module, "kernel_calls", counting)
    attn = ContextParallelAttention("ring", CPGroups(None, None, None), 32, "zigzag")
    q, k, v = (torch.randn(2, 32, 4, 8, requires_grad=True) for _ in range(3))
    docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 29])
    for _layer in range(3):  # three layers, forward and backward: one plan
        attn(q, k, v, docs).sum().backward()
    assert len(planned) == 1
    attn(q, k, v, docs.clone()).sum().backward()  # the same ids in another tensor: found again
    assert len(planned) == 1
    attn(q, k, v, docs.flip(0)).sum().backward()  # the next micro-batch: a new plan
    for _layer in range(3):
        attn(q, k, v).sum().backward()  # no documents: planned once, at construction
    assert len(planned) == 3


def _visible(qb: Block, kb: Block, causal: bool, window: int | None) -> torch.Tensor:
    """[B, Sq, Sk] the (query, key) pairs attention may see, token by token: the mask the calls
    must spell without one."""
    qp, kp = qb.row_pos[:, :, None], kb.row_pos[:, None, :]
    seen = qb.doc[:, :, None] == kb.doc[:, None, :]
    if causal:
        seen &= kp <= qp
    if window is not None:
        seen &= kp > qp - window
    return seen


def _covered(calls, rows: int, sq: int, sk: int) -> torch.Tensor:
    """[B, Sq, Sk] how many calls compute each (query, key) pair."""
    count = torch.zeros(rows, sq, sk, dtype=torch.long)
    for call in calls:
        n, m = call.q.stop - call.q.start, call.k.stop - call.k.start
        i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
        if call.kind == "full":
            inside = torch.ones(n, m, dtype=torch.bool)
        elif call.kind == "causal":
            inside = j - m <= i - n  # bottom-right aligned
        else:
            first, last = band_rows(n, m, call.band)
            inside = (j >= first[:, None]) & (j <= last[:, None])
        count[call.rows, call.q, call.k] += inside.long()
    return count


@pytest.mark.parametrize("balance", ["zigzag", "documents"])
def test_calls_spell_the_mask_every_pair_once(balance):
    """The planned calls compute every visible (query, key) pair exactly once and nothing else,
    against the mask built token by token: documents of mixed lengths (an id that comes back,
    one longer than the window and the rank's share), every rank pair of a cp-4 split, causal
    and not, windows shorter and longer than the documents."""
    s, cp = 64, 4
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([3, 30, 1, 12, 18]))
    docs = torch.stack([ids, ids.roll(7), torch.zeros(s, dtype=torch.long)])
    blocks = []
    for r in range(cp):
        pos = sequence.positions(s, r, cp, balance, doc_ids=docs)
        blocks.append(Block(pos, sequence.take(docs, pos, 1)))
    for qb in blocks:
        for kb in blocks:
            for causal, window in ((False, None), (True, None), (True, 1), (True, 5), (True, 40)):
                calls = kernel_calls(qb, kb, causal, window)
                assert all(c.q.stop > c.q.start and c.k.stop > c.k.start for c in calls)
                got = _covered(calls, 3, qb.pos.shape[-1], kb.pos.shape[-1])
                assert torch.equal(got, _visible(qb, kb, causal, window).long()), (causal, window)


def test_varlen_waves_cover_each_call_once_and_never_repeat_a_query_row():
    s = 48
    pos = torch.cat([sequence.positions(s, r, 4, "zigzag") for r in range(4)])
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([7, 20, 1, 20]))
    qb = Block(pos, torch.stack([ids, ids.roll(9)])[:, pos])
    calls = qb.calls(qb, causal=True)
    groups = qb.varlen_groups(qb, causal=True)
    assert len(groups) < len(calls)
    pairs = []
    for g in groups:
        assert len(set(g.q_index.tolist())) == len(g.q_index)  # no query row twice
        cu_q, cu_k = g.cu_q.tolist(), g.cu_k.tolist()
        assert g.max_q == max(b - a for a, b in zip(cu_q, cu_q[1:]))
        for i in range(len(cu_q) - 1):
            qi, ki = g.q_index[cu_q[i]:cu_q[i + 1]], g.k_index[cu_k[i]:cu_k[i + 1]]
            pairs.append((g.causal, qi[0].item(), qi[-1].item(), ki[0].item(), ki[-1].item()))
    expected = [(c.kind == "causal", c.rows.start * s + c.q.start, c.rows.start * s + c.q.stop - 1,
                 c.rows.start * s + c.k.start, c.rows.start * s + c.k.stop - 1) for c in calls]
    assert sorted(pairs) == sorted(expected)


def test_no_key_rows_follow_flash_conventions_and_merge_as_minus_inf():
    # two sequences: 3 queries x 0 keys (nothing seen), and 2 queries x 3 keys, causal, aligned
    # bottom-right (query 0 sees keys 0..1, query 1 sees keys 0..2)
    q = torch.randn(5, 2, 4, dtype=torch.float64)
    k, v = (torch.randn(3, 1, 4, dtype=torch.float64) for _ in range(2))
    out, lse = varlen_forward(q, k, v, torch.tensor([0, 3, 5]), torch.tensor([0, 0, 3]), 0.5,
                              causal=True)
    assert torch.equal(lse[:, :3], torch.full((2, 3), float("inf"), dtype=torch.float64))
    assert torch.equal(out[:3], torch.zeros(3, 2, 4, dtype=torch.float64))
    scores = torch.einsum("hd,khd->hk", q[3], k.expand(3, 2, 4)) * 0.5
    torch.testing.assert_close(lse[:, 3], torch.logsumexp(scores[:, :2], -1))
    mapped = _no_key_lse(lse)
    assert torch.equal(torch.isinf(mapped[:, :3]) & (mapped[:, :3] < 0), torch.ones(2, 3).bool())
    out_acc, lse_acc = new_accumulators(torch.zeros(1, 5, 2, 4, dtype=torch.float64))
    merge_into(out_acc, lse_acc, out[None], mapped[None])
    assert torch.equal(out_acc[0, :3], torch.zeros(3, 2, 4, dtype=torch.float64))  # not NaN
    assert torch.isneginf(lse_acc[0, :, :3]).all()
    merge_into(out_acc, lse_acc, out[None], mapped[None])  # merging twice: same output
    torch.testing.assert_close(out_acc[0, 3:], out[3:])


def test_kernel_options_pick_the_backend_by_device(monkeypatch):
    assert KernelOptions().backend_for(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(cuda_kernels, "flash_attn_installed", lambda: False)
    assert KernelOptions().backend_for(torch.device("cuda")) == "torch"  # a stock torch install
    monkeypatch.setattr(cuda_kernels, "flash_attn_installed", lambda: True)
    assert KernelOptions().backend_for(torch.device("cuda")) == "flash_attn"
    assert KernelOptions(backend="torch").backend_for(torch.device("cuda")) == "torch"


class _Recorder:
    """Wraps torch's flash ops to record the layout of every call the torch backend makes."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("_flash_attention_forward", "_flash_attention_backward"):
            op = getattr(torch.ops.aten, name)
            monkeypatch.setattr(torch.ops.aten, name, self._wrap(name, op), raising=False)

    def _wrap(self, name, op):
        def call(*args, **kwargs):
            result = op(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result
        return call


@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)])
def test_torch_backend_calls_torch_flash_ops_with_their_layouts(monkeypatch, heads):
    """The torch backend's calls go through aten._flash_attention_forward / _backward (given a
    CPU implementation that enforces the CUDA op's argument rules and computes with the varlen
    reference): dense [B, S, H, d] calls with lse [B, H, S], packed documents as [total, H, d]
    with int32 cum_seq and lse [H, total], GQA/MQA head counts passed as they are; the results
    match the float64 masked reference."""
    register_cpu_flash_ops()
    rec = _Recorder(monkeypatch)
    h, hkv = heads
    s, gen = 40, torch.Generator().manual_seed(h * 10 + hkv)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 25, 8]))
    for docs, causal in ((None, True), (None, False), (torch.stack([ids, ids.roll(11)]), True),
                         (torch.stack([ids, ids.roll(3)]), False)):
        rec.calls.clear()
        qkv = [torch.randn(2, s, n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (h, hkv, hkv)]
        block = Block(torch.arange(s), docs)
        out, lse = local_attention(*qkv, block, block, causal=causal, scale=0.3,
                                   options=KernelOptions(backend="torch"))
        grads = torch.autograd.grad(out.sum(), qkv)
        ref_out, ref_lse = reference_attention(*qkv, block, block, causal, 0.3)
        ref_grads = torch.autograd.grad(ref_out.sum(), qkv)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
        names = [c[0] for c in rec.calls]
        assert "_flash_attention_forward" in names and "_flash_attention_backward" in names
        for name, args, kwargs, result in rec.calls:
            q, k = args[0 if "forward" in name else 1], args[1 if "forward" in name else 2]
            cu_q = args[3 if "forward" in name else 6]
            assert (q.shape[-2], k.shape[-2]) == (h, hkv) and kwargs["scale"] == 0.3
            if docs is None:  # one dense call covers the sequence
                assert cu_q is None and q.shape == (2, s, h, 8)
                if "forward" in name:
                    assert result[1].shape == (2, h, s)
            else:
                assert q.dim() == 3 and cu_q.dtype == torch.int32 and int(cu_q[-1]) == len(q)
                lse_arg = result[1] if "forward" in name else args[5]
                assert lse_arg.shape == (h, len(q))


def test_torch_backend_deterministic_sets_torchs_switch_around_the_backward_only(monkeypatch):
    register_cpu_flash_ops()
    seen = []
    op = torch.ops.aten._flash_attention_backward

    def spy(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return op(*args, **kwargs)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", spy, raising=False)
    qkv = [torch.randn(1, 16, 2, 8, requires_grad=True) for _ in range(3)]
    block = Block(torch.arange(16))
    for deterministic in (True, False):
        out, _ = local_attention(*qkv, block, block, causal=True, scale=0.3,
                                 options=KernelOptions("torch", deterministic=deterministic))
        out.sum().backward()
        assert not torch.are_deterministic_algorithms_enabled()  # restored after the call
    assert seen == [True, False]


def test_torch_flash_contract_rejects_what_the_cuda_op_rejects():
    register_cpu_flash_ops()
    q = torch.randn(1, 8, 4, 8)
    fwd = torch.ops.aten._flash_attention_forward
    with pytest.raises(RuntimeError, match="GQA: 3 kv heads divide 4"):
        fwd(q, torch.randn(1, 8, 3, 8), torch.randn(1, 8, 3, 8), None, None, 8, 8, 0.0, True,
            False, scale=0.3)
    with pytest.raises(RuntimeError, match="cum_seq_q is int32"):
        flat = q.view(8, 4, 8)
        cu = torch.tensor([0, 8])
        fwd(flat, flat, flat, cu, cu, 8, 8, 0.0, True, False, scale=0.3)
    with pytest.raises(RuntimeError, match="head dim 12"):
        x = torch.randn(1, 8, 4, 12)
        fwd(x, x, x, None, None, 8, 8, 0.0, True, False, scale=0.3)
