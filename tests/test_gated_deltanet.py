"""Gated DeltaNet (the linear-attention mixer of hybrid models) against independent references:
the chunked gated delta rule against the token-by-token recurrence in float64 (outputs, final
states and gradients) with packed documents of every awkward kind, and against transformers'
own torch functions; the whole mixer against transformers' `Qwen3_5GatedDeltaNet` with its
weights, on rows and on packed documents (transformers run one document at a time)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from lctrain.attention.delta_rule import LinearHeads, chunk_gated_delta_rule, initial_states
from lctrain.config.validation import validate
from lctrain.models.gated_deltanet import GatedDeltaNet, LinearShape, grouped_to_qkv
from tests.helpers import tiny_config
from tests.reference import gated_delta_reference

CHUNK = 8  # several chunks in short rows
DOCS = {  # one row each: lengths of its documents (37 tokens, a prime)
    "whole row": [37],
    "one-token documents and prime lengths": [1, 5, 1, 13, 17],
    "documents across chunk boundaries": [7, 9, 3, 18],
    "only short documents": [2, 3, 1, 4, 2, 5, 3, 1, 6, 2, 3, 5],
}


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])


def _inputs(b: int, s: int, h_k: int, h: int, d_k: int, d_v: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = rand(b, s, h_k, d_k), rand(b, s, h_k, d_k), rand(b, s, h, d_v)
    g = -torch.rand(b, s, h, generator=gen, dtype=dtype)  # log decays <= 0
    beta = torch.rand(b, s, h, generator=gen, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def test_the_chunked_rule_is_the_recurrence_on_packed_documents():
    rows = list(DOCS.values())
    doc_ids = torch.stack([_doc_ids(r) for r in rows])
    inputs = _inputs(len(rows), 37, 2, 4, 8, 6)  # 2 key heads for 4 value heads
    start = torch.randn(len(rows), 4, 8, 6, dtype=torch.float64, requires_grad=True)
    out, state = chunk_gated_delta_rule(*inputs, doc_ids=doc_ids, initial_state=start,
                                        chunk=CHUNK)
    want, want_state = gated_delta_reference(*inputs, doc_ids=doc_ids, initial_state=start)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(out), torch.randn_like(state)
    leaves = [*inputs, start]
    got = torch.autograd.grad((out * weights[0]).sum() + (state * weights[1]).sum(), leaves)
    ref = torch.autograd.grad((want * weights[0]).sum() + (want_state * weights[1]).sum(),
                              leaves)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("cuts", [
    [12, 16, 22, 28],  # cuts inside documents, at a boundary, two inside one document
    [3, 5, 6, 7, 19, 20, 30],  # 8 stretches (zigzag on cp 4 holds them 2 a rank), 1-token ones
])
def test_stretches_from_zero_states_combine_to_the_whole_rows(cuts):
    """Context parallelism by state passing, without the ranks (§31): each stretch run from a
    zero state gives its final state and transition; the exact initial state of each follows in
    sequence order (`initial_states`), and a second pass from it gives the whole rows'
    outputs, final states and gradients. A stretch holding a document boundary passes
    nothing on (its transition is zero)."""
    rows = [DOCS["documents across chunk boundaries"], DOCS["only short documents"]]
    doc_ids = torch.stack([_doc_ids(r) for r in rows])
    inputs = _inputs(2, 37, 2, 4, 8, 6)
    bounds = [0, *cuts, 37]
    spans = [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def stretch(span, start=None, transition=False):
        return chunk_gated_delta_rule(*(x[:, span] for x in inputs), doc_ids=doc_ids[:, span],
                                      initial_state=start, chunk=CHUNK, transition=transition)

    first = [stretch(span, transition=True) for span in spans]
    continues = [torch.zeros(2, dtype=torch.bool)] + [
        doc_ids[:, span.start] == doc_ids[:, span.start - 1] for span in spans[1:]]
    starts = initial_states([f[1] for f in first], [f[2] for f in first], continues)
    second = [stretch(span, start) for span, start in zip(spans, starts)]
    out, state = torch.cat([o for o, _ in second], dim=1), second[-1][1]
    want, want_state = chunk_gated_delta_rule(*inputs, doc_ids=doc_ids, chunk=CHUNK)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state, want_state, rtol=1e-10, atol=1e-12)
    for span, (_, _, moved) in zip(spans, first):
        for row in range(2):
            if len(doc_ids[row, span].unique()) > 1:
                assert not moved[row].any(), (span, row)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum() + state.sum(), inputs)
    ref = torch.autograd.grad((want * weight).sum() + want_state.sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("chunk", [CHUNK, 64])
def test_the_chunked_rule_is_transformers_rule(chunk):
    """transformers' torch functions (which compute in float32) on one document per row."""
    q, k, v, g, beta = (x.detach().float() for x in _inputs(2, 37, 2, 4, 8, 6))
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    for rule in (hf_qwen3_5.torch_chunk_gated_delta_rule,
                 hf_qwen3_5.torch_recurrent_gated_delta_rule):
        want, want_state = rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def _pair(dtype=torch.float32):
    """lctrain's mixer and transformers' with the same random weights."""
    config = transformers.Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, num_hidden_layers=1, layer_types=["linear_attention"])
    torch.manual_seed(0)
    theirs = hf_qwen3_5.Qwen3_5GatedDeltaNet(config, 0).to(dtype)
    with torch.no_grad():  # away from their initial values
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    shape = LinearShape(dim=32, key_heads=2, value_heads=4, key_dim=8, value_dim=6,
                        conv_kernel=4, eps=1e-6)
    ours = GatedDeltaNet(shape, 0.02, 0.01).to(dtype)
    ours.load_state_dict({k: _grouped(k, v) for k, v in theirs.state_dict().items()})
    return ours, theirs


REGROUPED = ("in_proj_qkv.weight", "conv1d.weight")
"""The parameters lctrain holds grouped by key head where transformers holds every Q, every K,
every V (`lctrain.models.gated_deltanet.grouped_to_qkv`)."""


def _grouped(name: str, t: torch.Tensor) -> torch.Tensor:
    """transformers' tensor `name` in lctrain's row order."""
    if name not in REGROUPED:
        return t
    return t[grouped_to_qkv(LinearHeads(2, 8, 4, 6)).argsort()]


def test_the_mixer_is_transformers_gated_deltanet_on_rows_and_documents():
    ours, theirs = _pair()
    lengths = DOCS["one-token documents and prime lengths"]
    x = torch.randn(2, 37, 32, requires_grad=True)
    doc_ids = torch.stack([_doc_ids(lengths), _doc_ids(DOCS["whole row"])])
    got = ours(x, doc_ids=doc_ids)
    # transformers has no packed documents: each document alone, from a zero state
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    first = torch.cat([theirs(x[:1, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    want = torch.cat([first, theirs(x[1:])])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    weight = torch.randn_like(got)
    names = [n for n, _ in theirs.named_parameters()]
    mine = dict(ours.named_parameters())
    ref_grads = torch.autograd.grad((want * weight).sum(), [x, *theirs.parameters()])
    got_grads = torch.autograd.grad((got * weight).sum(), [x, *(mine[n] for n in names)])
    names = ["x", *names]
    for name, a, b in zip(names, got_grads, ref_grads, strict=True):  # float32 sums of 37 rows
        b = _grouped(name, b)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()), msg=name)


def _state_passing_rank(inputs, doc_ids, weight, balance):
    """This rank's output, input gradients and elements sent by `state_passing_delta_rule` on
    its share of the rows (split as the data path splits them)."""
    import torch.distributed as dist

    from lctrain.attention.delta_cp import state_passing_delta_rule, stretch_plan
    from lctrain.comm import record_traffic
    from lctrain.layout import sequence

    p, me = dist.get_world_size(), dist.get_rank()
    s = doc_ids.shape[1]
    plan = stretch_plan([sequence.positions(s, r, p, balance, doc_ids=doc_ids) for r in range(p)],
                        doc_ids, me)

    def mine(x):
        return sequence.split(x, 1, me, p, balance, doc_ids=doc_ids)

    local = [mine(x.detach()).requires_grad_() for x in inputs]
    with record_traffic() as sent:
        out = state_passing_delta_rule(*local, mine(doc_ids), plan, dist.group.WORLD,
                                       chunk=CHUNK)
        (out * mine(weight)).sum().backward()
    return out.detach(), [x.grad for x in local], dict(sent.elements), plan.slots


@pytest.mark.parametrize("world,balance", [(2, "zigzag"), (4, "zigzag"), (4, "none"),
                                           (4, "documents")])
def test_context_parallel_state_passing_is_the_whole_sequence(world, balance):
    """Each rank runs its stretches from zero, the (final state, transition) pairs are
    all-gathered and combined in sequence order, the stretches run again from their exact
    states: every rank's outputs and input gradients are the whole rows' (float64), and each
    rank sends its (final state, transition) pairs, forward and backward, nothing else."""
    from lctrain.layout import sequence
    from tests.helpers import on_ranks

    rows = [DOCS["documents across chunk boundaries"] + [3], DOCS["only short documents"] + [3]]
    doc_ids = torch.stack([_doc_ids(r) for r in rows])  # 40 tokens: 8 stretches of 5 at cp 4
    inputs = _inputs(2, 40, 2, 4, 8, 6)
    weight = torch.randn(2, 40, 4, 6, dtype=torch.float64)
    # the ranks fork before this process runs any backward (autograd's threads)
    got = on_ranks(_state_passing_rank, world, [x.detach() for x in inputs], doc_ids, weight,
                   balance)
    want, _ = gated_delta_reference(*inputs, doc_ids=doc_ids)
    grads = torch.autograd.grad((want * weight).sum(), inputs)
    for rank, (out, local_grads, sent, slots) in enumerate(got):
        # each rank sends its slots of (E, T) pairs, B H d_k (d_k + d_v) each, to the others
        per_pass = slots * 2 * 4 * 8 * (8 + 6) * (world - 1)
        assert sent == {("other", "all_gather"): per_pass,
                        ("other", "reduce_scatter"): per_pass}, sent

        def mine(x):
            return sequence.split(x, 1, rank, world, balance, doc_ids=doc_ids)  # noqa: B023

        torch.testing.assert_close(out, mine(want), rtol=1e-10, atol=1e-12)
        for name, a, b in zip(("q", "k", "v", "g", "beta"), local_grads, grads, strict=True):
            torch.testing.assert_close(a, mine(b), rtol=1e-9, atol=1e-11, msg=(rank, name))


def test_the_state_exchange_sends_the_same_at_four_times_the_sequence():
    from tests.helpers import on_ranks

    sent = []
    for repeat in (1, 4):
        doc_ids = _doc_ids(DOCS["documents across chunk boundaries"] * repeat + [3] * repeat)
        s = doc_ids.shape[0]
        inputs = [x.detach() for x in _inputs(1, s, 2, 4, 8, 6)]
        weight = torch.randn(1, s, 4, 6, dtype=torch.float64)
        got = on_ranks(_state_passing_rank, 4, inputs, doc_ids[None], weight, "zigzag")
        sent.append([rank[2] for rank in got])
    assert sent[0] == sent[1], sent


def _halo_conv_rank(x, weight, doc_ids, balance, world, documents):
    import torch.distributed as dist

    from lctrain.attention.delta_cp import StatePassing
    from lctrain.layout import sequence

    rank = dist.get_rank()
    core = StatePassing(dist.group.WORLD, rank, world, x.shape[1], balance, weight.shape[-1])
    local = sequence.split(x, 1, rank, world, balance, doc_ids=doc_ids).clone().requires_grad_()
    out = core.conv(local, weight, doc_ids if documents else None)
    (out * sequence.split(_ramp(x), 1, rank, world, balance, doc_ids=doc_ids)).sum().backward()
    return out.detach(), local.grad


def _ramp(x):
    """Weights of the outputs in the loss: each position its own."""
    return torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1).expand(x.shape[0], -1, 1)


@pytest.mark.parametrize("world,balance,documents", [
    (2, "zigzag", True), (4, "zigzag", True), (3, "none", True), (2, "documents", True),
    (2, "zigzag", False)])
def test_the_convolution_takes_its_halo_from_the_ranks_before(world, balance, documents):
    """Under context parallelism each stretch's convolution reads the k - 1 inputs before it
    from the rank holding them (a document of one token, documents crossing ranks; or no
    document ids, each row one document): every rank's outputs and input gradients are the
    whole rows' (float64)."""
    from lctrain.attention.delta_rule import causal_conv
    from lctrain.layout import sequence
    from tests.helpers import on_ranks

    torch.manual_seed(0)
    x = torch.randn(2, 24, 5, dtype=torch.float64)
    weight = torch.randn(5, 1, 4, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 5 + [1] * 2 + [2] * 11 + [3] * 6, [0] + [1] * 20 + [2] * 3])
    got = on_ranks(_halo_conv_rank, world, x, weight, doc_ids, balance, world, documents)
    whole = x.clone().requires_grad_()
    want = causal_conv(whole, weight, doc_ids if documents else None)
    (want * _ramp(x)).sum().backward()
    for rank, (out, grad) in enumerate(got):
        def mine(t):
            return sequence.split(t, 1, rank, world, balance, doc_ids=doc_ids)  # noqa: B023

        torch.testing.assert_close(out, mine(want.detach()), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, mine(whole.grad), rtol=1e-12, atol=1e-12)


def _mix_rank(qkv, weight, g, beta, doc_ids, heads, balance, world, how):
    import torch.distributed as dist

    from lctrain.attention.delta_cp import StatePassing
    from lctrain.attention.delta_heads import HeadSplit
    from lctrain.comm import record_traffic
    from lctrain.layout import sequence

    rank = dist.get_rank()
    core = (HeadSplit(dist.group.WORLD, rank, world, qkv.shape[1], balance) if how == "heads"
            else StatePassing(dist.group.WORLD, rank, world, qkv.shape[1], balance,
                              weight.shape[-1]))
    local = [sequence.split(x, 1, rank, world, balance, doc_ids=doc_ids).clone().requires_grad_()
             for x in (qkv, g, beta)]
    with record_traffic() as sent:
        out = core.mix(*local[:1], weight, *local[1:], doc_ids, heads)
        out.pow(2).sum().backward()
    return out.detach(), [x.grad for x in local], sum(sent.elements.values())


@pytest.mark.parametrize("world,balance,how,held_whole", [
    (2, "zigzag", "heads", False), (2, "documents", "heads", False),
    (4, "zigzag", "state", False), (4, "zigzag", "state", True)])
def test_the_head_split_and_state_passing_are_the_whole_rows(world, balance, how, held_whole):
    """The two ways a linear layer runs under context parallelism (parallel.linear_cp), from the
    projected Q, K, V before the convolution to the rule's output: every rank's output and
    the gradients of its inputs equal the whole rows' (float64, packed documents); the head
    split sends what grows with the sequence: (P - 1)/P of its tokens' C_c + 2 H_v numbers and
    H_v d_v back, forward and backward. Documents each held whole by one rank (`held_whole`:
    stretches of 5 tokens, documents of 5) need no exchange at all: state passing sends
    nothing."""
    from lctrain.attention.delta_rule import LinearHeads, gated_delta_mix
    from lctrain.layout import sequence
    from tests.helpers import on_ranks

    torch.manual_seed(0)
    heads = LinearHeads(2, 4, 4, 3)
    b, s = 2, 40
    qkv = torch.randn(b, s, heads.channels, dtype=torch.float64)
    weight = torch.randn(heads.channels, 1, 4, dtype=torch.float64)
    g = -torch.rand(b, s, 4, dtype=torch.float64)
    beta = torch.rand(b, s, 4, dtype=torch.float64)
    rows = [DOCS["documents across chunk boundaries"] + [3], DOCS["only short documents"] + [3]]
    if held_whole:
        rows = [[5] * 8, [2, 3] * 8]
    doc_ids = torch.stack([_doc_ids(r) for r in rows])
    got = on_ranks(_mix_rank, world, qkv, weight, g, beta, doc_ids, heads, balance, world, how)
    whole = [x.clone().requires_grad_() for x in (qkv, g, beta)]
    want = gated_delta_mix(whole[0], weight, *whole[1:], doc_ids, heads)
    want.pow(2).sum().backward()
    for rank, (out, grads, sent) in enumerate(got):
        def mine(t):
            return sequence.split(t, 1, rank, world, balance, doc_ids=doc_ids)  # noqa: B023

        torch.testing.assert_close(out, mine(want.detach()), rtol=1e-9, atol=1e-11)
        for grad, ref in zip(grads, whole, strict=True):
            torch.testing.assert_close(grad, mine(ref.grad), rtol=1e-9, atol=1e-10)
        if how == "heads":  # per token: channels and (g, beta) there, the output back; x 2
            per_token = heads.channels + 2 * 4 + 4 * 3
            assert sent == 2 * b * (s // world) * per_token * (world - 1) // world, sent
        else:
            assert (sent == 0) == held_whole, sent


HYBRID_MODEL = {"family": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"],
                "linear_key_heads": 2, "linear_value_heads": 4, "linear_key_dim": 8,
                "linear_value_dim": 16}


@pytest.mark.parametrize("model,parallel,message", [
    ({}, {"tp": 4, "sp": True}, "parallel.tp=4 does not divide model.linear_key_heads=2"),
    ({}, {"cp": 4, "linear_cp": "heads"}, "2 key heads per TP rank over parallel.cp=4"),
    ({}, {"tp": 2, "sp": True, "cp": 2, "linear_cp": "heads"},
     "1 key heads per TP rank over parallel.cp=2"),
    ({"linear_value_heads": 3}, {}, "linear_value_heads=3 is not a multiple"),
    ({"family": "qwen3_5_moe_text", "n_experts": 4}, {}, "set model.shared_expert_ffn_dim"),
    ({"n_experts": 0, "shared_expert_ffn_dim": 32}, {}, "which has no shared expert")])
def test_what_the_linear_layers_and_shared_experts_cannot_run_is_refused_by_name(
        model, parallel, message):
    """TP or a head split the key heads do not divide, value heads that do not group under the
    key heads; a shared expert's width missing where the family has one, set where it has
    none. (TP, PP and every CP algorithm run them: tests/test_model_families.py.)"""
    cfg = tiny_config(model={**HYBRID_MODEL, **model}, parallel={"dp": 1, **parallel})
    world = cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.dp
    problems = validate(cfg, world)
    assert any(message in p for p in problems), problems
    for layout in ({"pp": 2, "cp": 2, "dp": 1}, {"tp": 2, "sp": True, "cp": 2, "dp": 1}):
        assert validate(tiny_config(model=HYBRID_MODEL, parallel=layout), 4) == []


def _fake_fla(monkeypatch):
    """flash-linear-attention's `chunk_gated_delta_rule` as its docstring specifies it (variable
    -length sequences flattened into one row and cut by cu_seqlens, an initial and a final
    state per sequence, value heads grouped on the key heads, L2-normalised q and k), computed
    by the token-by-token reference: what lctrain's glue is checked against on the CPU."""
    import sys
    import types

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=64):
        assert use_qk_l2norm_in_kernel and scale is None and chunk_size in (16, 32, 64)
        assert q.shape[0] == 1 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        bounds = cu_seqlens_cpu.tolist()
        outs, finals = [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            out, final = gated_delta_reference(
                *(x[:, a:b] for x in (q, k, v, g, beta)),
                initial_state=initial_state[i:i + 1].to(v.dtype))
            outs.append(out)
            finals.append(final)
        finals = torch.cat(finals).to(initial_state.dtype)  # fla's: float32
        return torch.cat(outs, dim=1), finals if output_final_state else None

    gated = types.ModuleType("fla.ops.gated_delta_rule")
    gated.chunk_gated_delta_rule = chunk_gated_delta_rule
    for name, module in (("fla", types.ModuleType("fla")),
                         ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", gated)):
        monkeypatch.setitem(sys.modules, name, module)


def test_the_fla_kernels_glue_keeps_the_rules_contract(monkeypatch):
    """train.linear_kernel=fla: packed documents as fla's variable-length sequences, each row's
    initial state to its first document and its final state from its last, the transition from
    a second call with the identity and no values; against lctrain's chunked rule (float64),
    outputs, final states, transitions and every gradient, on rows with and without
    boundaries. (On CUDA, tests/test_gpu.py runs the real kernels against it.)"""
    from lctrain.attention.delta_fla import fla_gated_delta_rule
    from lctrain.attention.delta_rule import delta_rule

    _fake_fla(monkeypatch)
    torch.manual_seed(0)
    assert delta_rule("fla", torch.device("cpu")) is fla_gated_delta_rule
    assert delta_rule("auto", torch.device("cpu")) is chunk_gated_delta_rule
    doc_ids = torch.stack([_doc_ids(DOCS["documents across chunk boundaries"]),
                           _doc_ids(DOCS["whole row"])])
    inputs = _inputs(2, 37, 2, 4, 8, 6)
    start = torch.randn(2, 4, 8, 6, dtype=torch.float64, requires_grad=True)
    got = fla_gated_delta_rule(*inputs, doc_ids=doc_ids, initial_state=start, transition=True)
    want = chunk_gated_delta_rule(*inputs, doc_ids=doc_ids, initial_state=start,
                                  transition=True)
    assert torch.count_nonzero(want[2][0]) == 0 and torch.count_nonzero(want[2][1]) > 0
    recurrence = gated_delta_reference(*inputs, doc_ids=doc_ids, initial_state=start)
    for a, b in zip(got[:2], recurrence):  # the token-by-token recurrence, independently
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-9, atol=1e-11)
    weights = [torch.randn_like(x) for x in want]
    leaves = [*inputs, start]
    grads = [torch.autograd.grad(sum((x * w).sum() for x, w in zip(result, weights)), leaves)
             for result in (got, want)]
    for name, a, b in zip(("output", "final state", "transition"), got, want, strict=True):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=1e-6, atol=1e-8, msg=name)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial state"), *grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)
