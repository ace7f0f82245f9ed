"""The kernel layer on the CPU: calls are planned on the host once per block pair (per
micro-batch with documents), the varlen packing covers every call exactly once per wave, and
flash-attn's conventions (lse = +inf for rows that see no key, bottom-right causal alignment)
are what the plain-torch varlen kernel reproduces and what the merge expects after mapping."""

import torch

from lctrain.attention import ContextParallelAttention, CPGroups
from lctrain.attention import calls as calls_module
from lctrain.attention.calls import Block, kernel_calls
from lctrain.attention.kernels import KernelOptions, _no_key_lse, merge_into, new_accumulators
from lctrain.attention.varlen_reference import varlen_forward
from lctrain.layout import sequence


def test_calls_are_planned_once_per_micro_batch(monkeypatch):
    planned = []

    def counting(qb, kb, causal):
        planned.append((id(qb), id(kb)))
        return kernel_calls(qb, kb, causal)

    monkeypatch.setattr(calls_module, "kernel_calls", counting)
    attn = ContextParallelAttention("ring", CPGroups(None, None, None), 32, "zigzag")
    q, k, v = (torch.randn(2, 32, 4, 8, requires_grad=True) for _ in range(3))
    docs = torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 29])
    for _layer in range(3):  # three layers, forward and backward: one plan
        attn(q, k, v, docs).sum().backward()
    assert len(planned) == 1
    attn(q, k, v, docs.clone()).sum().backward()  # the next micro-batch: a new plan
    for _layer in range(3):
        attn(q, k, v).sum().backward()  # no documents: planned once, at construction
    assert len(planned) == 3


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


def test_kernel_options_pick_the_backend_by_device():
    assert KernelOptions().backend_for(torch.device("cpu")) == "cpu"
    assert KernelOptions().backend_for(torch.device("cuda")) == "flash"
    assert KernelOptions(backend="reference").backend_for(torch.device("cuda")) == "reference"
