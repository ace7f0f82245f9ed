"""The CUDA step proven on the CPU, feature by feature: every model family, CP algorithm, load
balance and data-parallel engine that validation accepts, traced on the CUDA code path (fake
tensors, torch's meta kernels for the flash and grouped-matmul ops, whose argument checks run:
lctrain.tracing.trace), and the moments the host would wait for the GPU counted in each
(`HostSyncs`): none in a micro-step's forward and backward, but the one read per MoE layer and
micro-step of the split sizes that expert parallelism's uneven all-to-all needs, and one read
per step around them."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import _redistribute

from lctrain.attention.calls import PlanCache
from lctrain.config.derived import derive
from lctrain.config.validation import validate
from lctrain.models import blocks
from lctrain.models.moe import sorted_counts
from lctrain.tracing import trace
from lctrain.training.optim import REDISTRIBUTE_LOG
from tests.helpers import tiny_config

MOE = {"family": "qwen3_moe", "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 48}
GPT_OSS = {"family": "gpt_oss", "n_experts": 4, "experts_per_token": 2, "expert_ffn_dim": 48,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
GEMMA3 = {"family": "gemma3_text", "sliding_window": 8, "rope_local_theta": 10000.0,
          "query_pre_attn_scalar": 16, "tie_embeddings": True,
          "layer_types": ["sliding_attention", "full_attention"]}
WINDOW = {"family": "mistral", "sliding_window": 8}
DOCS = {"document_masking": True}


def _case(model=None, data=None, train=None, **parallel):
    """A bf16 config (the flash kernels' dtype) of `parallel`'s layout, dp=1 by default."""
    return tiny_config(model=model or {}, data=data or {},
                       train={"dtype": "bf16", **(train or {})},
                       parallel={"cp": 1, "dp": 1, **parallel})


def _world(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.cp * p.pp * p.dp


MODELS = {"llama": {}, "mistral window": WINDOW, "gemma3": GEMMA3, "qwen3-moe": MOE,
          "gpt-oss": GPT_OSS}
"""Every kind of block: dense, sliding window, Gemma 3's window pattern with a tied embedding,
experts, and sinks with biased experts."""
LAYOUTS = {"one GPU": {}, "ulysses cp2": {"cp": 2, "attention": "ulysses"},
           "ring cp2": {"cp": 2, "attention": "ring"},
           "all-gather cp2": {"cp": 2, "attention": "allgather"},
           "usp cp4": {"cp": 4, "attention": "usp", "ulysses_degree": 2}}
"""No context parallelism, and every CP algorithm."""
ENGINES = {"fsdp": {"dp": 2}, "ddp": {"dp": 2, "dp_engine": "ddp"}, "dp1": {},
           "optimizer on the host": {"offload_state": "optimizer"}}
"""The data-parallel engines over two ranks, none to spread over, and the state on the host."""


def _matrix() -> dict:
    """Every (model, CP algorithm, load balance) that validation accepts, the engines taken in
    turn (each model meets every engine), a mixture of experts at ep 2 in every other case
    where it has two ranks to spread them over, and gradient accumulation in every fifth."""
    cases, turn = {}, 0
    for model, block in MODELS.items():
        for layout, cp in LAYOUTS.items():
            for balance in ("zigzag",) if not cp else ("zigzag", "documents"):
                engine = list(ENGINES)[turn % len(ENGINES)]
                parallel = {**cp, **ENGINES[engine], "load_balance": balance}
                ranks = parallel.get("cp", 1) * parallel.get("dp", 1)
                if "n_experts" in block and ranks >= 2 and turn % 2:
                    parallel["ep"] = 2
                data = DOCS if balance == "documents" or turn % 3 == 0 else {}
                # one micro-step per step (half the trace's time), accumulation every fifth case
                # (5 and the 4 engines are coprime: each engine accumulates somewhere)
                train = {} if turn % 5 == 0 else {"global_batch": parallel.get("dp", 1)}
                name = (f"{model}, {layout}, {balance}, {engine}"
                        f"{', ep2' if 'ep' in parallel else ''}{', documents' if data else ''}"
                        f"{', accumulation' if not train else ''}")
                cfg = _case(block, data, train, **parallel)
                if validate(cfg, _world(cfg)) == []:
                    cases[name] = cfg
                turn += 1
    return cases


MATRIX = _matrix()
FAST_NAMES = [next(n for n in MATRIX if n.startswith(f"{model}, {layout},"))
              for model, layout in zip(MODELS, LAYOUTS)]
"""One case of each model and each layout (the matrix's diagonal), in the fast tier."""
FAST = {
    **{name: MATRIX[name] for name in FAST_NAMES},
    # each chunk's sizes from one read per layer, and none again when a chunk is recomputed
    "qwen3-moe ep2 tiled, fsdp": _case(MOE, train={"mlp_chunk": 8}, dp=2, ep=2),
}
SLOW = {
    **{name: cfg for name, cfg in MATRIX.items() if name not in FAST},
    "qwen3-moe ep4 over dp2 x cp2, fsdp": _case(MOE, dp=2, cp=2, ep=4),
    "gemma3 pp2 x dp2, tiled loss and mlp": _case(
        GEMMA3, train={"mlp_chunk": 8, "loss_chunk": 8}, pp=2, dp=2),
    "llama pp2 x cp2 ring, documents split": _case(
        data=DOCS, cp=2, pp=2, attention="ring", load_balance="documents"),
    "mistral window, tp2+sp x usp cp4": _case(WINDOW, tp=2, sp=True, cp=4, attention="usp",
                                              ulysses_degree=2),
    "qwen3-moe tp2+sp x ep2 x cp2 ring": _case(MOE, tp=2, sp=True, cp=2, ep=2,
                                               attention="ring"),
}


def test_the_matrix_holds_every_model_layout_and_balance():
    """Validation refuses no (model, layout, balance) of the matrix: a combination it started
    refusing would leave the matrix silently."""
    assert len(MATRIX) == len(MODELS) * (1 + 2 * (len(LAYOUTS) - 1)), sorted(MATRIX)


def _expected_micro_step_syncs(cfg) -> int:
    """One split-size read per MoE layer and micro-step under expert parallelism, else none."""
    if cfg.parallel.ep == 1:
        return 0
    moe_layers = sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layers))
    return moe_layers * derive(cfg, _world(cfg)).grad_accum


def _check(cfg) -> dict:
    assert validate(cfg, _world(cfg)) == [], "the matrix traces what validation accepts"
    out = trace.trace_apart(cfg, _world(cfg), 0, 8, True)
    syncs = out["host_syncs"]
    in_micro_steps = [s for s in syncs["sites"] if s["phase"] in ("forward", "backward")]
    assert sum(s["count"] for s in in_micro_steps) == _expected_micro_step_syncs(cfg), syncs
    assert all(s["what"] == "device.counts" and "parallel/experts.py" in s["where"]
               for s in in_micro_steps), syncs
    # around the micro-steps, one read: the update's decision with the step's metrics (the
    # token count is counted on the host; the loss scale stays on the device)
    assert syncs["by_phase"].get("step") == 1 and "optimizer" not in syncs["by_phase"], syncs
    assert out["peak"] > 0 and out["ops"] > 0
    return out


@pytest.mark.parametrize("name", FAST)
def test_traced_on_the_cuda_path(name):
    _check(FAST[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_traced_on_the_cuda_path_everywhere(name):
    _check(SLOW[name])


def test_a_host_read_in_the_attention_is_counted_and_named(monkeypatch):
    """A value read on the host (`.item()`) added to the attention path shows in the count,
    with its line."""
    rotary = blocks.apply_rotary

    def apply_rotary(x, cos, sin):
        if x.sum().item() > 0:  # a host sync: the GPU queue drained in every layer
            return rotary(x, cos, sin)
        return rotary(x, cos, sin)

    monkeypatch.setattr(blocks, "apply_rotary", apply_rotary)
    cfg = _case(WINDOW)
    out = trace.trace_apart(cfg, 1, 0, 8, True)
    (site,) = [s for s in out["host_syncs"]["sites"] if s["phase"] == "forward"]
    # the innermost line of lctrain on the way: the attention's forward, which called it
    assert site["what"] == "item" and "lctrain/models/blocks.py" in site["where"], site
    assert site["count"] == 2 * cfg.model.n_layers * derive(cfg, 1).grad_accum, site


def test_experts_in_bf16_under_every_engine():
    """Without FSDP's bf16 weights (DDP, one GPU) the experts' fp32 weights met bf16 rows in
    torch's grouped matmul, which refuses mixed dtypes (its meta kernel checks it in the
    trace): the experts now compute in the activations' dtype."""
    out = trace.trace_apart(_case(MOE, dp_engine="none"), 1, 0, 8, True)
    assert out["host_syncs"]["by_phase"].get("forward", 0) == 0


def test_expert_counts_without_a_histogram():
    """sorted_counts against torch.bincount, with experts no token chose."""
    ids = torch.tensor([0, 0, 2, 2, 2, 5])
    assert sorted_counts(ids, 7).tolist() == torch.bincount(ids, minlength=7).tolist()
    assert sorted_counts(torch.zeros(0, dtype=torch.long), 3).tolist() == [0, 0, 0]


def test_plans_are_found_again_by_content():
    """Equal document ids in another tensor (a pipeline stage's recompute, a later layer) hit
    the plan; other ids make a new one; the oldest goes past the cache's size."""
    made = []
    cache = PlanCache(lambda doc: made.append(doc) or len(made), size=2)
    a = torch.tensor([[0, 0, 1]])
    assert cache(a) == cache(a.clone()) == 1
    assert cache(torch.tensor([[0, 1, 1]])) == 2 and cache(None) == 3
    assert cache(a) == 4 and len(made) == 4  # a was the oldest of two: planned again


def test_planned_expert_gradients_are_the_ranks_own_experts_under_tp():
    """The plan counted a 1/tp share of every expert and then took away (ep-1)/ep of all of
    them: negative gradient bytes for tp2 x ep8 (qwen3-30b-a3b's search winner planned
    -37 GiB of accumulated gradients; its trace held +17). A rank holds E/ep whole experts
    (expert parallelism spans the TP ranks), counted here from the built model's parameters."""
    from lctrain.models.registry import new_model
    from lctrain.planning.state import accumulated_grad_bytes, local_params

    cfg = tiny_config(model=MOE, parallel={"tp": 2, "sp": True, "dp": 2, "ep": 4,
                                           "dp_engine": "ddp"},
                      train={"global_batch": 8, "micro_batch": 1})
    with torch.device("meta"):
        model = new_model(cfg.model)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    others_local = sum(local_params(cfg)) - experts // cfg.parallel.tp
    assert accumulated_grad_bytes(cfg, 4) == 4 * (others_local + experts // cfg.parallel.ep)


def _two_steps(cfg) -> tuple[list[float], str, list[bool], bool]:
    """Two training steps on this rank: the losses, a digest of every byte of its parameters,
    whether torch's deterministic algorithms were on at each forward, and after the steps."""
    import hashlib

    from lctrain.parallel.data_parallel import unwrap
    from lctrain.parallel.runtime import setup_distributed
    from lctrain.training import loop
    from lctrain.training.step import train_step

    rt = setup_distributed(cfg)
    model, optimizer, scheduler, loader = loop.build_training(cfg, rt)
    seen = []
    unwrap(model).register_forward_pre_hook(
        lambda *_: seen.append(torch.are_deterministic_algorithms_enabled()))
    losses = [train_step(model, optimizer, scheduler, loader.next_step(), cfg, rt)["loss"]
              for _ in range(2)]
    digest = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        digest.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return losses, digest.hexdigest(), seen, torch.are_deterministic_algorithms_enabled()


def test_deterministic_steps_repeat_byte_for_byte():
    """train.deterministic turns torch's deterministic algorithms on for the whole step (not
    only around the attention's backward), and off after it; two steps at cp2 ring with packed
    documents and a mixture of experts, run twice, leave the same bytes."""
    from tests.helpers import on_ranks

    cfg = tiny_config(model=MOE, data=DOCS, train={"deterministic": True, "steps": 2},
                      parallel={"cp": 2, "dp": 1, "attention": "ring"})
    first, again = (on_ranks(_two_steps, 2, cfg) for _ in range(2))
    assert first == again
    for _, _, seen, after in first:
        assert seen and all(seen) and not after, (seen, after)


@pytest.mark.slow
def test_the_trace_of_tp_says_nothing_of_torchs_redistribution(caplog):
    """The gradient norm over dp x cp and tp: torch's note that it all-reduces one mesh
    dimension at a time (two calls of one number) stays out of the output."""
    _redistribute._warned_flatten_issues.clear()  # torch says it once per process
    with caplog.at_level(logging.WARNING, logger=REDISTRIBUTE_LOG):
        _check(SLOW["mistral window, tp2+sp x usp cp4"])
    assert not [r for r in caplog.records if "While redistributing" in r.getMessage()]
