"""Every model family (Llama, Qwen2/Qwen2.5, Qwen3, Mistral, Gemma 3, Qwen3-MoE, Mixtral,
GPT-OSS) through the model registry, against transformers.

Each family's random model is built here from transformers' own config class (not from lctrain's
export), with every feature that differs from Llama switched on and away from its initial value
(nonzero Q/K/V biases, norms that are not their initial scale, an explicit head_dim that is not
dim / heads, a tied embedding, sliding windows shorter than the sequence and the documents, per
layer for Qwen2 and Gemma 3 with its own local RoPE; llama3 RoPE for Llama).
`model.init_from` with no model.* override must then give transformers' logits at one rank,
transformers' mean cross-entropy and every one of its gradients on cp2 ring zigzag with packed
documents, on cp2 x tp2+sp Ulysses, on pp2 and (full suite) on USP 2x2 with the documents
split, and an export that transformers loads with the
same logits; a checkpoint resumes under another layout (all-gather KV + DDP + tiling, pp2, USP
+ tiling) and DeepSpeed ZeRO-3 trains the same steps; `lctrain train +recipe=tiny
model.init_from=DIR` runs as the README says. What lctrain cannot compute is refused by name,
and the planner counts every preset's parameters as the built model holds them.
"""

import dataclasses
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from lctrain.config import ConfigError
from lctrain.config.compose import compose
from lctrain.config.keys import keys
from lctrain.config.model_families import MODEL_FAMILIES, model_family
from lctrain.config.model_size import active_param_count, param_count
from lctrain.config.validation import validate
from lctrain.data.batch import IGNORE_INDEX
from lctrain.data.loader import build_loader
from lctrain.layout.topology import Topology
from lctrain.models.decoder import without_routing
from lctrain.models.hf import (
    export_hf,
    from_hf_state_dict,
    full_parameters,
    hf_config,
    load_hf_weights,
)
from lctrain.models.parts import parts_of
from lctrain.models.registry import family_code, new_model
from lctrain.parallel.data_parallel import unwrap
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.prepare.checks import preflight
from lctrain.prepare.init_from import resolve_model
from lctrain.training.step import Routing, micro_steps, read_all, token_weighted_loss
from tests.helpers import on_ranks, run_cli, single_process, train_each

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
         "rope_theta": 50000.0}
WINDOW = 7
"""The sliding window of the random models that have one: shorter than the documents and the
sequence, so that it cuts every long document and the halo exchange crosses ranks."""
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {  # model_type -> transformers config of a random model with the family's features
    "llama": transformers.LlamaConfig(**{k: v for k, v in SHAPE.items() if k != "rope_theta"},
                                      rope_parameters=LLAMA3_ROPE),
    "qwen2": transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                      sliding_window=WINDOW, use_sliding_window=True,
                                      max_window_layers=1),
    "qwen3": transformers.Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False,
                                      rms_norm_eps=1e-6),
    "mistral": transformers.MistralConfig(**SHAPE, head_dim=16, sliding_window=WINDOW),
    "gemma3_text": transformers.Gemma3TextConfig(
        **{k: v for k, v in SHAPE.items() if k != "rope_theta"}, head_dim=16,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=True, rms_norm_eps=1e-6,
        pad_token_id=None,  # transformers' padding_idx row gets no gradient; lctrain's learns
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}),
    # 4 experts, 2 per token, a load-balancing loss that moves the gradients: Qwen3-MoE with a
    # dense layer (mlp_only_layers), narrower experts and unnormalised top-k weights
    "qwen3_moe": transformers.Qwen3MoeConfig(
        **SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False, router_aux_loss_coef=0.05,
        output_router_logits=True, rms_norm_eps=1e-6),
    "mixtral": transformers.MixtralConfig(**SHAPE, head_dim=16, num_local_experts=4,
                                          num_experts_per_tok=2, router_aux_loss_coef=0.05,
                                          output_router_logits=True),
    # GPT-OSS: Q/K/V/O biases, sinks, alternating window layers, YaRN without truncation,
    # router and expert biases, the clamped SwiGLU (a limit the random weights reach)
    "gpt_oss": transformers.GptOssConfig(
        **{k: v for k, v in SHAPE.items() if k != "rope_theta"}, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 50000.0,
                         "original_max_position_embeddings": 16},
        router_aux_loss_coef=0.05, output_router_logits=True),
    # Qwen3.5: a Gated DeltaNet layer (two value heads per key head) and a full-attention one
    # with the output gate, head norms and RoPE over half of each head
    "qwen3_5_text": transformers.Qwen3_5TextConfig(
        **{k: v for k, v in SHAPE.items() if k != "rope_theta"}, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                         "partial_rotary_factor": 0.5}),
    # Qwen3.5-MoE: Qwen3.5's layers, every MLP 4 experts (2 per token) and a shared expert
    "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in SHAPE.items() if k not in ("rope_theta", "intermediate_size")},
        head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=40, router_aux_loss_coef=0.05,
        output_router_logits=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                         "partial_rotary_factor": 0.5}),
    # Qwen3-Next: Qwen3.5's layers with fused projections grouped by key head, a mixture of 4
    # experts (2 per token, unnormalised) with a shared expert, and a dense layer
    "qwen3_next": transformers.Qwen3NextConfig(
        **{k: v for k, v in SHAPE.items() if k != "rope_theta"}, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=40, mlp_only_layers=[1],
        norm_topk_prob=False, router_aux_loss_coef=0.05, output_router_logits=True,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0,
                         "partial_rotary_factor": 0.5}),
}
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe_text", "qwen3_next")
LINEAR = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""Families with linear-attention layers: they train on LINEAR_LAYOUTS too."""
LAYOUTS_OF_ALL = ("usp2x2_documents",)
"""The layouts every family runs (an MoE family runs the rest of LAYOUTS as MOE_LAYOUTS)."""
FUSED_IN_MEMORY = ("qwen3_moe", "mixtral", "qwen3_5_moe_text", "qwen3_next")
"""Families whose checkpoints store each expert's matrices apart and transformers' modules fuse
them in memory (gate_up_proj [E, 2F, D], down_proj [E, D, F]); GPT-OSS's are fused in both."""
"""The families with experts: they train on their own layouts too (MOE_LAYOUTS)."""
WINDOW_OF = {"qwen2": WINDOW, "mistral": WINDOW, "gemma3_text": WINDOW, "gpt_oss": WINDOW}
"""The families whose random model has window layers (shorter than a packed row's documents'
longest, and than train.seq_len)."""
RUN = ["+recipe=tiny", "data.source=synthetic", "train.seq_len=32", "train.global_batch=4",
       "train.steps=1", "eval.every=0", "logging.progress=false", "optim.warmup_steps=1",
       "data.doc_len_min=8", "data.doc_len_max=24", "train.micro_batch=1"]
LAYOUTS = {  # the 4-rank layouts every family trains on
    "cp2_ring_zigzag_docs": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ring",
                             "parallel.load_balance=zigzag", "data.document_masking=true"],
    "cp2_tp2_sp_ulysses": ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2", "parallel.sp=true",
                           "parallel.attention=ulysses", "data.document_masking=false"],
    "pp2_dp2": ["parallel.cp=1", "parallel.dp=2", "parallel.pp=2",
                "data.document_masking=false"],
}
MOE_LAYOUTS = {"ep2_cp2_ring_docs": ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2",
                                     "parallel.attention=ring", "data.document_masking=true"],
               "moe_cp2_ring_zigzag_docs": LAYOUTS["cp2_ring_zigzag_docs"],
               "moe_cp2_tp2_sp_ulysses": LAYOUTS["cp2_tp2_sp_ulysses"],
               "moe_pp2_dp2": LAYOUTS["pp2_dp2"],
               "ep2_pp2_dp2": ["parallel.cp=1", "parallel.dp=2", "parallel.pp=2",
                               "parallel.ep=2", "data.document_masking=false"],
               "ep2_tp2_sp_cp2_ring": ["parallel.cp=2", "parallel.dp=1", "parallel.tp=2",
                                       "parallel.sp=true", "parallel.ep=2",
                                       "parallel.attention=ring",
                                       "data.document_masking=false"],
               "cp2_ulysses_ddp_tiled": ["parallel.cp=2", "parallel.dp=2",
                                         "parallel.attention=ulysses", "parallel.dp_engine=ddp",
                                         "train.mlp_chunk=8",
                                         "train.activation_checkpointing=full",
                                         "data.document_masking=true"],
               "ep2_cp2_ddp": ["parallel.cp=2", "parallel.dp=2", "parallel.ep=2",
                               "parallel.dp_engine=ddp", "parallel.attention=allgather",
                               "data.document_masking=true"],
               "ep4_dp4_tiled": ["parallel.cp=1", "parallel.dp=4", "parallel.ep=4",
                                 "train.mlp_chunk=8", "train.activation_checkpointing=full",
                                 "data.document_masking=true"]}
"""The MoE families' layouts (full suite, with USP): LAYOUTS' three, ep2 x cp2 ring, ep2 x
tp2+sp x cp2 ring, ep2 x pp2, DDP with Ulysses, ep2 x cp2 all-gather KV with DDP (the experts
reduced apart), and ep4, DDP and ep4 tiled and fully recomputed. The fast tier checks them at one rank (logits), and tests/test_moe.py and
tests/test_activation_memory.py train ep2."""
EXPORTED_BY = {"cp2_tp2_sp_ulysses": [f for f in FAMILIES if f not in MOE],
               "moe_cp2_tp2_sp_ulysses": list(MOE)}
"""The layout whose run exports each family (the MoE families' in the full suite)."""
USP_LAYOUT = {"usp2x2_documents": ["parallel.cp=4", "parallel.dp=1", "parallel.attention=usp",
                                   "parallel.ulysses_degree=2", "data.document_masking=true"]}
"""USP 2x2 with the per-row documents split: the window layers' halo inside ring groups after
the all-to-all (in the full suite: 5 more 4-rank runs)."""
LINEAR_LAYOUTS = {
    "cp2_linear_heads_docs": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ring",
                              "parallel.linear_cp=heads", "data.document_masking=true"],
    "linear_cp2_ulysses_ddp_tiled": MOE_LAYOUTS["cp2_ulysses_ddp_tiled"],
    "cp2_allgather_heads_selective": ["parallel.cp=2", "parallel.dp=2",
                                      "parallel.attention=allgather", "parallel.linear_cp=heads",
                                      "train.activation_checkpointing=selective",
                                      "data.document_masking=false"],
    "pp2_cp2_ring_docs": ["parallel.cp=2", "parallel.dp=1", "parallel.pp=2",
                          "parallel.attention=ring", "data.document_masking=true"]}
"""The linear-attention families' own layouts (full suite): the head split instead of state
passing, under Ring and all-gather KV; Ulysses with DDP, the tiled MLP and full recompute;
selective recompute; pp2 x cp2 ring (a stage of linear layers, one of attention)."""
LINEAR_MOE_LAYOUTS = {
    "ep2_cp4_ring_docs": ["parallel.cp=4", "parallel.dp=1", "parallel.ep=2",
                          "parallel.attention=ring", "data.document_masking=true"]}
"""The hybrid MoE families' own layout (full suite): experts split over two of four context
ranks, each of whose linear layers passes its state on to the next."""
DECAY_PARAMETERS = ("linear_attention.dt_bias", "linear_attention.A_log",
                    "linear_attention.in_proj_a.weight", "linear_attention.in_proj_ba.weight")
"""The parameters of a Gated DeltaNet's decays, whose gradients sum terms of both signs over
every later token: in float32 they carry an error of about 1e-4 of their largest element, in
transformers' chunked rule as in lctrain's (against either computed in float64, measured on
these random models at cp 2 without documents: 1.05e-4 for lctrain's). They are compared to
2e-4 of their largest element."""
ALL_LAYOUTS = {**LAYOUTS, **MOE_LAYOUTS, **USP_LAYOUT, **LINEAR_LAYOUTS, **LINEAR_MOE_LAYOUTS}


def save_family(path, family: str) -> transformers.PreTrainedModel:
    """A random transformers model of `family` saved with save_pretrained; the features lctrain
    must honour are moved away from their initial values (biases start at zero, norms at one)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_bias")):
                param.normal_(0.0, 0.5)
            elif "norm" in name:  # Gemma's and Qwen3.5's scale by 1 + w, w starting at zero
                param.normal_(1.0 if param.abs().sum() else 0.0, 0.3)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: (root / family, save_family(root / family, family)) for family in FAMILIES}


def _resolved(hf_dir, *overrides):
    return resolve_model(compose([*RUN, f"model.init_from={hf_dir}", *overrides]))


def test_every_family_is_registered_with_its_code_and_a_test():
    """docs/extending.md's checklist for a model family: its code found from its facts, a test
    config, the README."""
    assert list(MODEL_FAMILIES) == list(FAMILIES)
    for family in MODEL_FAMILIES:
        assert family_code(family).parts == parts_of(model_family(family))
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Continue pretraining"):]
    section = section[:section.index("\n## ")]
    listed = dict(next(k for k in keys("model") if k.name == "model.family").registered)
    assert tuple(listed) == tuple(MODEL_FAMILIES)  # `lctrain keys` lists each with its summary
    for family in MODEL_FAMILIES:
        assert f"| `{family}` |" in section, f"the README's Continue pretraining lists {family}"


def test_config_json_decides_the_family_and_one_rank_gives_transformers_logits(hf_dirs):
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    for family, (path, hf) in hf_dirs.items():
        composed = _resolved(path)
        m = composed.cfg.model
        assert (m.family, m.dim, m.n_layers, m.norm_eps) == (
            family, 64, 2, FAMILIES[family].rms_norm_eps), family
        assert composed.origins["family"] == "config.json"
        assert m.d_head == (32 if family == "qwen3" else 16)
        assert m.head_dim == (32 if family == "qwen3" else None)  # 16 = dim / heads: derived
        assert m.sliding_window == WINDOW_OF.get(family)
        assert (m.n_experts, m.experts_per_token, m.expert_dim, m.moe_layers, m.norm_topk_prob,
                m.router_aux_loss_coef) == {
            "qwen3_moe": (4, 2, 48, [0], False, 0.05), "mixtral": (4, 2, 96, None, True, 0.05),
            "gpt_oss": (4, 2, 96, None, True, 0.05), "qwen3_5_moe_text": (4, 2, 48, None, True, 0.05),
            "qwen3_next": (4, 2, 48, [0], False, 0.05)}.get(family, (0, 2, 96, None, True, 0.0))
        assert m.shared_expert_ffn_dim == (40 if family in ("qwen3_5_moe_text", "qwen3_next")
                                           else None)
        assert [m.layer_window(i) for i in range(2)] == {
            "qwen2": [None, WINDOW], "mistral": [WINDOW, WINDOW],
            "gemma3_text": [WINDOW, None], "gpt_oss": [WINDOW, None]}.get(family, [None, None]), \
            family
        assert preflight(composed.cfg, 4) == []
        model = new_model(m)
        load_hf_weights(model, str(path))
        with torch.no_grad():
            want = hf(input_ids=tokens[:, :-1]).logits
            logits = without_routing(model(tokens[:, :-1]))  # (a MoE's routing table beside)
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
            loss = without_routing(model(tokens[:, :-1], labels=tokens[:, 1:]))
            loss = loss / tokens[:, 1:].numel()
        assert float(loss) == pytest.approx(float(F.cross_entropy(
            want.flatten(0, 1), tokens[:, 1:].flatten())), rel=1e-5)


def _hf_step(hf: transformers.PreTrainedModel, cfg) -> tuple[float, dict, "_Routing"]:
    """transformers' token-mean loss and gradients over the step's global batch, in lctrain's
    parameter names, and its routing. Packed documents are run one document at a time, at the
    positions lctrain gives them (each document from 0), which is what document masking
    computes; a mixture of experts adds each micro-batch's load-balancing loss (over its rows'
    documents) at router_aux_loss_coef, averaged over the micro-batches."""
    single = single_process(cfg)
    accum = single.train.global_batch // single.train.micro_batch
    loader = build_loader(single, Topology(), 0, accum)
    micro_batches = loader.next_step()
    tokens = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in micro_batches)
    hf.zero_grad()
    total, routing = 0.0, _Routing()
    for mb in micro_batches:
        rows, router_logits = [], []
        for row in range(mb.inputs.shape[0]):
            ids = (mb.doc_ids[row] if mb.doc_ids is not None
                   else torch.zeros(mb.inputs.shape[1], dtype=torch.long))
            pieces = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
            positions = mb.positions[row if mb.positions.shape[0] > 1 else 0]
            starts = [sum(pieces[:i]) for i in range(len(pieces))]
            outs = [hf(input_ids=mb.inputs[row:row + 1, a:a + n],
                       position_ids=positions[None, a:a + n]) for a, n in zip(starts, pieces)]
            rows.append(torch.cat([out.logits[0] for out in outs]))
            router_logits += [out.router_logits for out in outs if "router_logits" in out]
        loss = F.cross_entropy(torch.stack(rows).flatten(0, 1), mb.labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum") / tokens
        total += loss.item()
        if router_logits:  # the micro-batch's load-balancing loss, as transformers computes it
            loss = loss + hf.config.router_aux_loss_coef * routing.add(
                hf, [torch.cat(layer) for layer in zip(*router_logits)]) / len(micro_batches)
        loss.backward()
    grads = {name: p.grad.clone() for name, p in hf.named_parameters()}
    fused = hf.config.model_type in FUSED_IN_MEMORY
    moe = {k: v for k, v in grads.items() if fused and (".mlp.gate." in k or ".mlp.experts." in k)}
    grads = {**from_hf_state_dict({k: v for k, v in grads.items() if k not in moe},
                                  dataclasses.replace(cfg.model, tie_embeddings=False)),
             **_moe_grads(moe)}
    return total, grads, routing  # tied: one tensor, listed once under its embedding's name


class _Routing:
    """transformers' routing of a step: the load-balancing losses of its micro-batches, and
    the top-k assignments counted per expert and MoE layer from the routers' logits."""

    def __init__(self):
        self.aux: list[float] = []
        self.counts = None

    def add(self, hf, layers: list[torch.Tensor]) -> torch.Tensor:
        """layers: each MoE layer's router logits [tokens, E] of one micro-batch."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        c = hf.config
        experts, k = getattr(c, "num_experts", None) or c.num_local_experts, c.num_experts_per_tok
        aux = load_balancing_loss_func(tuple(layers), experts, k)
        counts = torch.stack([torch.bincount(torch.topk(logits, k, dim=-1).indices.flatten(),
                                             minlength=experts) for logits in layers])
        self.counts = counts if self.counts is None else self.counts + counts
        self.aux.append(aux.item())
        return aux


def _moe_grads(grads: dict) -> dict:
    """The gradients of transformers' MoE modules (in memory: the router `mlp.gate`, the
    experts fused as gate_up_proj [E, 2F, D] and down_proj [E, D, F]) in lctrain's names."""
    out = {}
    for name, grad in grads.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".mlp.")
        ours = f"layers.{layer}.feed_forward"
        experts = f"{ours}.experts"
        if rest == "gate.weight":
            out[f"{ours}.router.weight"] = grad
        elif rest == "experts.gate_up_proj":
            out[f"{experts}.w1"], out[f"{experts}.w3"] = grad.chunk(2, dim=1)
        else:
            assert rest == "experts.down_proj", name
            out[f"{experts}.w2"] = grad
    return out


def _one_step(cfgs: dict, out_dir: str) -> dict:
    """On this rank, for every (family, layout) config: the step's loss and this rank's whole
    gradients after one forward and backward; the cp2 x tp2 layout also exports."""
    out = {}
    for key, cfg in cfgs.items():
        rt = setup_distributed(cfg)
        model = build_model(cfg, rt)
        loader = build_loader(cfg, rt.topology, rt.rank, rt.derived.grad_accum)
        micro_batches = loader.next_step()
        routing = Routing()
        loss, _ = token_weighted_loss(micro_batches, rt, partial(
            micro_steps, model, micro_batches, rt=rt, routing=routing))
        grads = {}
        for name, param in unwrap(model).named_parameters():  # (DDP's module.* names)
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            grads[name] = grad.clone()
        if key[0] in EXPORTED_BY.get(key[1], ()):
            export_hf(full_parameters(model), cfg.model, f"{out_dir}/{key[0]}", rt.rank)
        out[key] = (float(loss), grads, read_all(routing.reduced(rt)))
    return out


def _trains_on(family: str, layout: str) -> bool:
    """Every family trains on LAYOUTS_OF_ALL; the dense ones on the rest of LAYOUTS, the MoE
    ones on MOE_LAYOUTS, the linear-attention ones on LINEAR_LAYOUTS (and LINEAR_MOE_LAYOUTS
    if they have experts)."""
    if layout in LINEAR_LAYOUTS or layout in LINEAR_MOE_LAYOUTS:
        return family in LINEAR and (layout in LINEAR_LAYOUTS or family in MOE)
    return layout in LAYOUTS_OF_ALL or (layout in MOE_LAYOUTS) == (family in MOE)


@pytest.mark.parametrize("layouts", [
    pytest.param(LAYOUTS, id="cp_tp_pp", marks=pytest.mark.slow),
    pytest.param({**USP_LAYOUT, **MOE_LAYOUTS, **LINEAR_LAYOUTS, **LINEAR_MOE_LAYOUTS},
                 id="usp_moe",
                 marks=pytest.mark.slow)])
def test_every_family_trains_on_every_layout_with_transformers_loss_and_gradients(
        hf_dirs, tmp_path, layouts):
    cfgs, wants = {}, {}
    for family, (path, hf) in hf_dirs.items():
        for layout, overrides in layouts.items():
            if not _trains_on(family, layout):
                continue
            cfg = _resolved(path, *overrides).cfg
            assert preflight(cfg, 4) == [], (family, layout)
            cfgs[family, layout] = cfg
            wants[family, layout] = _hf_step(hf, cfg)
    per_rank = on_ranks(_one_step, 4, cfgs, str(tmp_path), timeout_s=300)
    for key, (want_loss, want_grads, want_routing) in wants.items():
        grads = {}
        for rank in per_rank:  # under pp each rank holds its stage's parameters
            loss, rank_grads, routing = rank[key]
            assert loss == pytest.approx(want_loss, rel=1e-4), key
            grads.update(rank_grads)
            if want_routing.aux:  # the step's mean load-balancing loss and expert load
                assert routing["aux_loss"] == pytest.approx(np.mean(want_routing.aux),
                                                            rel=1e-5), key
                assert routing["expert_load"] == want_routing.counts.tolist(), key
        assert sorted(grads) == sorted(want_grads), key
        for name, want in want_grads.items():
            decay = name.endswith(DECAY_PARAMETERS)
            atol = 1e-6 + (2e-4 * float(want.abs().max()) if decay else 0.0)
            torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=atol,
                                       msg=lambda m, k=key, n=name: f"{k} {n}: {m}")
    exported = [f for layout in layouts for f in EXPORTED_BY.get(layout, ())]
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    for family in exported:
        hf = hf_dirs[family][1]
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
        assert type(back) is type(hf)
        config = json.loads((tmp_path / family / "config.json").read_text())
        assert config["model_type"] == family
        assert config["head_dim"] == (32 if family == "qwen3" else 16)
        with torch.no_grad():
            torch.testing.assert_close(back(input_ids=tokens).logits, hf(input_ids=tokens).logits,
                                       rtol=1e-5, atol=1e-5)


RESUMED_UNDER = {  # family -> the layout that loads the cp2 x tp2+sp Ulysses checkpoint: the
    # families whose blocks hold more than Llama's (Mistral's are Llama's: test_checkpoint.py)
    "qwen2": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=allgather",
              "parallel.dp_engine=ddp", "train.loss_chunk=8", "train.mlp_chunk=8",
              "data.document_masking=false"],
    "qwen3": ["parallel.cp=2", "parallel.dp=1", "parallel.pp=2", "parallel.attention=ring",
              "train.loss_chunk=8", "train.mlp_chunk=8", "data.document_masking=false"],
    # the tied embedding split over the first and last stage, refreshed from the loaded weights
    "gemma3_text": LAYOUTS["pp2_dp2"],
    # the linear layers' rows grouped by key head, split by TP, whole on each pipeline stage
    "qwen3_5_text": LAYOUTS["pp2_dp2"],
}


@pytest.mark.slow  # 14 s on 2 cores: 5 runs on 4 ranks
def test_a_moe_checkpoint_reshards_between_expert_parallel_sizes(hf_dirs, tmp_path):
    """Qwen3-MoE from its HF weights, three steps at ep2 x cp2 ring (a checkpoint at step 2);
    the step-2 checkpoint loaded at ep1 (cp2 x dp2) and at ep4 (dp4) continues with the same
    loss, load-balancing loss and grad norm: the experts' DTensors reshard by expert. Qwen3.5's
    MoE alike from ep2 x cp2 to ep2 x cp4: its linear layers' states then pass over four
    ranks instead of two."""
    steps = ["train.steps=3", "optim.warmup_steps=1"]
    runs, resumed = {}, {}
    for family, saved, loads in (
            ("qwen3_moe", MOE_LAYOUTS["ep2_cp2_ring_docs"], {
                "ep1": ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ring",
                        "data.document_masking=true"],
                "ep4": ["parallel.cp=1", "parallel.dp=4", "parallel.ep=4",
                        "data.document_masking=true"]}),
            ("qwen3_5_moe_text", MOE_LAYOUTS["ep2_cp2_ring_docs"],
             {"ep2_cp4": LINEAR_MOE_LAYOUTS["ep2_cp4_ring_docs"]})):
        path = hf_dirs[family][0]
        step2 = tmp_path / family / "checkpoints" / "step-00000002"
        loaded = [*steps, "checkpoint.every=0", f"checkpoint.load={step2}"]
        runs[family] = _resolved(path, *saved, *steps, "checkpoint.every=2").cfg
        for name, layout in loads.items():
            runs[f"{family}_{name}"] = _resolved(path, *layout, *loaded).cfg
            resumed[f"{family}_{name}"] = family
    histories = on_ranks(train_each, 4, runs, str(tmp_path), timeout_s=300)[0]
    for name, family in resumed.items():
        want = histories[family][2]
        assert want["step"] == 3 and want["aux_loss"] > 0
        [got] = histories[name]
        assert got["step"] == 3, name
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (name, key)


DEEPSPEED = ["parallel.cp=2", "parallel.dp=2", "parallel.attention=ring",
             "parallel.dp_engine=deepspeed", "deepspeed.zero_stage=3",
             "data.document_masking=false"]
"""DeepSpeed ZeRO-3 over dp x cp, which Qwen2 (biases, tied embedding) also trains on."""


@pytest.mark.slow  # 12 s on 2 cores: 5 runs on 4 ranks
def test_every_family_checkpoints_and_resumes_under_another_layout(hf_dirs, tmp_path):
    """Three steps from the HF weights on cp2 x tp2+sp (a checkpoint at step 2); the step-2
    checkpoint loaded under another layout (all-gather KV with DDP and tiling for Qwen2, ring
    x pp2 with tiling for Qwen3, pp2 x dp2 for Gemma 3's tied embedding and Qwen3.5's linear
    layers) continues with the same loss and grad norm; DeepSpeed ZeRO-3 trains Qwen2's first steps alike. (Llama's reshards: tests/test_checkpoint.py and
    test_pipeline.py; DeepSpeed's own: tests/test_deepspeed.py.)"""
    runs = {}
    for family in RESUMED_UNDER:
        path = hf_dirs[family][0]
        steps = ["train.steps=3", "checkpoint.every=2"]
        runs[f"{family}_saved"] = _resolved(path, *LAYOUTS["cp2_tp2_sp_ulysses"], *steps).cfg
        step2 = tmp_path / f"{family}_saved" / "checkpoints" / "step-00000002"
        loaded = ["train.steps=3", "checkpoint.every=0", f"checkpoint.load={step2}"]
        runs[f"{family}_loaded"] = _resolved(path, *RESUMED_UNDER[family], *loaded).cfg
        problems = validate(runs[f"{family}_loaded"], 4)  # the checkpoint is written later
        assert [p for p in problems if not p.startswith("checkpoint.load=")] == [], family
    # ZeRO-3 partitions the tied embedding and the biases too
    runs["qwen2_deepspeed"] = _resolved(hf_dirs["qwen2"][0], *DEEPSPEED, "train.steps=2").cfg
    histories = on_ranks(train_each, 4, runs, str(tmp_path), timeout_s=300)[0]
    for family in RESUMED_UNDER:
        saved, loaded = histories[f"{family}_saved"], histories[f"{family}_loaded"]
        assert [h["step"] for h in loaded] == [3], family
        for got, want in zip(loaded, saved[2:]):
            assert got["loss"] == pytest.approx(want["loss"], rel=2e-5), family
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), family
    deepspeed = histories["qwen2_deepspeed"]
    assert [h["step"] for h in deepspeed] == [1, 2]
    for got, want in zip(deepspeed, histories["qwen2_saved"]):  # (from the third step on,
        # DeepSpeed's Adam, about lr x sign(g) early on, turns rounding-level gradient
        # differences into 1e-4-level loss differences)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("family,change,message", [
    ("qwen3", {"attention_bias": True}, "attention_bias=true; lctrain's qwen3 has no attention"),
    ("qwen2", {"mlp_bias": True}, "mlp_bias=true"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "the MLP activation 'gelu'"),
    ("qwen3_5_text", {"attn_output_gate": False}, "attn_output_gate=false"),
    ("qwen3", {"layer_types": ["linear_attention", "full_attention"]},
     "lctrain's qwen3 computes full_attention, sliding_attention layers only"),
    ("llama", {"sliding_window": 16}, "lctrain's llama attends over the whole causal context"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}},
     "quantization_config (quant_method mxfp4); lctrain trains unquantized weights"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1; lctrain's routers take"),
    ("mistral", {"model_type": "gemma2"}, "model_type='gemma2'; lctrain loads the model types "
                                          "llama, qwen2, qwen3, mistral, gemma3_text"),
])
def test_what_a_family_cannot_compute_is_refused_by_name(hf_dirs, tmp_path, family, change,
                                                         message):
    config = json.loads((hf_dirs[family][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    try:
        problems = preflight(_resolved(tmp_path).cfg, 4)
    except ConfigError as e:
        problems = e.problems
    assert any(message in p for p in problems), problems


def test_windows_shorter_than_the_sequence_train_and_layer_types_are_checked(hf_dirs):
    """A window shorter than train.seq_len is planned and trained (the layouts above); the
    layer types must be one per layer, of the two kinds, and sliding ones need a window."""
    assert preflight(_resolved(hf_dirs["mistral"][0], "train.seq_len=64").cfg, 4) == []
    cfg = compose(["model=mistral-7b", "train.seq_len=8192", "model.sliding_window=4096"]).cfg
    assert preflight(cfg, 1) == []
    for overrides, message in (
            (["model.layer_types=[full_attention]"], "model.layer_types has 1 entries for "
                                                     "model.n_layers=32"),
            (["model.sliding_window=null", "model.layer_types=[" + ",".join(
                ["sliding_attention"] * 32) + "]"], "model.sliding_window is null"),
            (["model.layer_types=[" + ",".join(["local"] * 32) + "]"], "['local']")):
        bad = compose(["model=mistral-7b", *overrides]).cfg
        assert any(message in p for p in preflight(bad, 1)), (overrides, preflight(bad, 1))


PUBLISHED = {"qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.62, "qwen3-0.6b": 0.60, "qwen3-8b": 8.19,
             "mistral-7b": 7.25, "llama3-8b": 8.03, "llama3-70b": 70.55, "llama3.2-1b": 1.24,
             "llama3.2-3b": 3.21, "smollm2-135m": 0.13, "qwen3-30b-a3b": 30.53,
             "qwen3-235b-a22b": 235.09, "mixtral-8x7b": 46.7, "gpt-oss-20b": 20.91,
             "gpt-oss-120b": 116.83}
"""preset -> its model card's size in billions of parameters"""
ACTIVE = {"qwen3-30b-a3b": 3.3, "qwen3-235b-a22b": 22, "mixtral-8x7b": 12.9, "gpt-oss-20b": 3.6,
          "gpt-oss-120b": 5.1}
"""preset -> its model card's active parameters per token, in billions (OpenAI's leave the
input embedding out, Qwen's and Mistral's count it)"""
GEMMA3_TEXT = ("gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
QWEN3_5_TEXT = ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b")
VISION_CARDS = GEMMA3_TEXT + QWEN3_5_TEXT + ("qwen3-next-80b-a3b",)
"""Presets whose model cards count a vision tower too, or a multi-token-prediction layer
(Qwen3.5's, Qwen3-Next's): their text decoders are counted by transformers' own model built
from the preset's config (on the meta device)."""


@pytest.mark.slow  # 7 s: every preset built on the meta device
def test_the_planner_counts_every_preset_as_the_built_model_holds_it():
    presets = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    assert set(PUBLISHED) | set(VISION_CARDS) == set(presets) - {"tiny"}
    for preset in presets:
        m = compose([f"model={preset}"]).cfg.model
        with torch.device("meta"):
            held = sum(p.numel() for p in new_model(m).parameters())
            if preset in VISION_CARDS:
                hf = transformers.AutoModelForCausalLM.from_config(hf_config(m))
                assert held == sum(p.numel() for p in hf.parameters()), preset
        assert param_count(m) == held, preset
        assert preset in ("tiny", *VISION_CARDS) or round(held / 1e9, 2) == PUBLISHED[preset]
        if preset in ACTIVE:  # the card's figure, which Qwen's cards cut (22.19B: "22B")
            embedding = m.vocab_size * m.dim if m.family == "gpt_oss" else 0
            assert abs(active_param_count(m) - embedding - ACTIVE[preset] * 1e9) < 0.2e9, preset


@pytest.mark.slow  # 6 s on 2 cores: `lctrain preprocess`, then a 4-rank `lctrain train` per family
def test_each_family_continues_pretraining_as_the_readme_says(tmp_path, capsys):
    """`lctrain train +recipe=tiny model.init_from=DIR data.source=tokens data.path=SHARDS`, with
    no model.* override, for a checkpoint of each family (its tokenizer, its shards)."""
    from tests.test_preprocess import SENTENCES, train_tokenizer, write_jsonl

    rng = np.random.default_rng(0)
    write_jsonl(tmp_path / "corpus.jsonl", [" ".join(rng.choice(SENTENCES, 8)) for _ in range(300)])
    tokenizer = train_tokenizer(["<s>", "</s>"])
    for family, config in FAMILIES.items():
        model_dir = tmp_path / family
        config = config.__class__(**{**config.to_dict(), "vocab_size": 192})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
        tokenizer.save(str(model_dir / "tokenizer.json"))
        if family == "llama":  # one set of shards: every family here has the same tokenizer
            code, _, err = run_cli(["preprocess", f"model.init_from={model_dir}",
                                    f"data.path={tmp_path / 'corpus.jsonl'}",
                                    f"preprocess.output={tmp_path / 'shards'}"], capsys)
            assert code == 0, err[-2000:]
        experts = ["parallel.ep=2"] if family in MOE else []  # the command
        code, _, err = run_cli(["train", "+recipe=tiny", f"model.init_from={model_dir}",
                                "data.source=tokens", f"data.path={tmp_path / 'shards'}",
                                "data.val_fraction=0.05", "eval.tasks=[]", "eval.every=2",
                                "eval.val_sequences=8", "train.steps=2", *experts,
                                f"hydra.run.dir={tmp_path / 'run' / family}"], capsys)
        assert code == 0, err[-3000:]
        assert family == "llama" or \
            f"model.family: 'llama' (default) -> '{family}' (config.json)" in err, family
        assert "model.n_layers: 4 (default) -> 2 (config.json)" in err, family
        records = [json.loads(line) for line in (tmp_path / "run" / family / "metrics.jsonl").open()]
        assert records[-1]["val_loss"] > 0 and records[-1]["step"] == 2, family


@pytest.mark.parametrize("family,release", [("qwen3_5_text", "Qwen3_5"),
                                            ("qwen3_5_moe_text", "Qwen3_5Moe")])
def test_a_released_multimodal_qwen3_5_checkpoint_trains_its_language_model(
        tmp_path, family, release):
    """A checkpoint as Qwen3.5 is released (model_type qwen3_5 or qwen3_5_moe:
    ...ForConditionalGeneration with a nested text_config, a vision tower, the language model
    under model.language_model.*): config.json's text_config decides the model, said once with
    the vision tower left out; the language model's weights give transformers' logits on text.
    The MoE's weights are stored as transformers' modules hold them (its state dict: every
    layer's experts in one gate_up_proj [E, 2 F, D] and one down_proj), which loading reads
    when a checkpoint has no per-expert tensors."""
    config = getattr(transformers, f"{release}Config")(
        text_config=FAMILIES[family].to_dict(),
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                       "out_hidden_size": 64},
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = getattr(transformers, f"{release}ForConditionalGeneration")(config).eval()
    hf.save_pretrained(tmp_path)
    if family in MOE:  # the experts fused
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(tmp_path / "model.safetensors"))
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in f.keys()  # noqa: SIM118
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["model_type"] == family.removesuffix("_text") and "text_config" in stored
    composed = _resolved(tmp_path)
    m = composed.cfg.model
    assert (m.family, m.layer_types, m.rotary_fraction) == (
        family, ["linear_attention", "full_attention"], 0.5)
    (note,) = [n for n in composed.notes if "vision tower" in n]
    assert f"{stored['model_type']} checkpoint" in note and "model.language_model.*" in note
    assert preflight(composed.cfg, 4) == []
    model = new_model(m)
    load_hf_weights(model, str(tmp_path))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(without_routing(model(tokens)), hf(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)


def test_multi_token_prediction_layers_are_left_out_by_name(hf_dirs, tmp_path):
    """A Qwen3-Next checkpoint as released, with a multi-token-prediction layer (config.json's
    mtp_num_hidden_layers, mtp.* tensors): the note says it is left out, and the language
    model's weights still give transformers' logits."""
    path, hf = hf_dirs["qwen3_next"]
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, str(tmp_path / "mtp.safetensors"))
    composed = _resolved(tmp_path)
    (note,) = [n for n in composed.notes if "multi-token-prediction" in n]
    assert "1 multi-token-prediction layer(s) (mtp.*)" in note and "left out" in note
    model = new_model(composed.cfg.model)
    load_hf_weights(model, str(tmp_path))
    tokens = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(without_routing(model(tokens)), hf(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
