"""Mixture-of-experts MLPs (docs/parallelism.md §28): a router, top-k routing without capacity
limits (every token reaches its k experts), the experts' gated MLPs computed expert by expert
over the tokens sorted by expert (one grouped matmul per projection where torch has one for the
device and dtype), and the router statistics the load-balancing loss and the expert-load
metrics are made of.

Routing, as transformers' Qwen3-MoE and Mixtral routers: probabilities p = softmax(router(x)) in
float32, the k largest per token, renormalised to sum to 1 when `model.norm_topk_prob`; the
token's output is the sum of its experts' outputs weighted by those probabilities.

The load-balancing loss couples every MoE layer of the model (transformers' definition: counts
and probabilities summed over all layers before their product), so each layer records its
statistics in the model's `RouterLog`, and the model returns them beside its output as one
routing table (`RouterLog.table`); whoever holds the micro-batch's tokens sums the tables
(pipeline stages, context-parallel ranks) and computes the loss (`table_loss`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain import device
from lctrain.config import ModelConfig
from lctrain.models.init import ZEROS


def _in_backward() -> bool:
    """Whether autograd's engine is running this code: activation checkpointing recomputing a
    block's forward, whose routing was recorded the first time."""
    return torch._C._current_graph_task_id() != -1


class RouterLog:
    """What the MoE layers of one forward recorded: per layer, the tokens sent to each expert
    (float [E], no gradient); per call (a layer's, or a chunk's of a tiled layer), the routing
    probabilities summed over its tokens (float32 [E], with gradient) and its tokens."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.counts: dict[int, Tensor] = {}
        self.prob_sums: list[Tensor] = []
        self.tokens = 0

    def record(self, layer: int, counts: Tensor, prob_sum: Tensor, tokens: int) -> None:
        if not _in_backward():
            before = self.counts.get(layer)
            self.counts[layer] = counts.float() if before is None else before + counts
            self.prob_sums.append(prob_sum)
            self.tokens += tokens

    def table(self, moe_layers: list[int], n_experts: int, device: torch.device) -> Tensor:
        """What was recorded as a routing table [M + 2, E] over the model's M MoE layers: row i
        the tokens sent to each expert by MoE layer `moe_layers[i]` (zeros for a layer this
        forward did not run: another pipeline stage's), row M the routing probabilities summed
        over every layer's tokens (with their gradient), row M + 1 the (layer, token) rows in
        its first column. Tables add up: stages' and ranks' sums are the model's. Clears the
        log."""
        table = torch.zeros(len(moe_layers) + 2, n_experts, device=device)
        for i, layer in enumerate(moe_layers):
            if layer in self.counts:
                table[i] = self.counts[layer]
        table[-1, 0] = float(self.tokens)
        if self.prob_sums:
            probs = torch.stack(self.prob_sums).sum(dim=0)
            table = torch.cat([table[:-2], probs[None], table[-1:]])
        else:  # a stage without MoE layers: its table still carries the gradient back
            table.requires_grad_(True)
        self.clear()
        return table


def table_counts(table: Tensor) -> Tensor:
    """Tokens sent to each expert per MoE layer, [M, E] (no gradient), of a routing table."""
    return table[:-2].detach()


def table_loss(table: Tensor, n_experts: int) -> Tensor:
    """The load-balancing loss of a routing table summed over the model's layers and the ranks
    that hold the micro-batch's tokens; the gradient reaches the probabilities only."""
    counts = table[:-2].detach().sum(dim=0)
    return load_balancing_loss(counts, table[-2], table[-1, 0].detach(), n_experts)


def load_balancing_loss(counts: Tensor, prob_sums: Tensor, rows: Tensor, n_experts: int
                        ) -> Tensor:
    """transformers' `load_balancing_loss_func`: E * sum_e f_e P_e, where f_e is the share of
    top-k assignments to expert e and P_e the mean routing probability of e, both over every
    (MoE layer, token) row: counts [E] and prob_sums [E] summed over the layers (and over the
    ranks that hold the micro-batch's tokens), rows their number."""
    return n_experts * torch.sum((counts / rows) * (prob_sums / rows))


def grouped_matmul(x: Tensor, w: Tensor, counts: Tensor, splits: list[int] | None) -> Tensor:
    """x [N, in] (rows sorted by expert, counts [E] of them each) @ w[e] [E, in, out] for each
    expert's rows: torch's grouped matmul on CUDA in bf16 (`splits` None), else one matmul per
    expert (`splits`: counts as a list)."""
    if splits is None:
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    pieces = x.split(splits)
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)])


def sorted_counts(sorted_ids: Tensor, n: int) -> Tensor:
    """How many of `sorted_ids` [N] (ascending, in 0..n-1) equal each of 0..n-1: [n] int64.
    A binary search of the n + 1 boundaries, of fixed size, so it neither waits for the device
    (CUDA's bincount reads the ids' range on the host) nor depends on data under a trace, and
    is deterministic (no atomics)."""
    bounds = torch.arange(n + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, bounds).diff()


GROUPED_MM_ALIGN = 8
"""bf16 elements in 16 bytes: torch's grouped matmul loads its operands by 16-byte rows (TMA),
so every static dimension (D and the experts' widths) must be a multiple of this."""


def uses_grouped_mm(x: Tensor, *widths: int) -> bool:
    """Whether `grouped_matmul` takes torch's grouped matmul for rows `x` and the experts'
    `widths` (CUDA, bf16, 16-byte aligned); else one matmul per expert."""
    aligned = all(n % GROUPED_MM_ALIGN == 0 for n in (x.shape[-1], *widths))
    return device.gpu_path(x.device) and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and aligned


def _splits(xs: Tensor, counts: Tensor, known: list[int] | None, *widths: int
            ) -> list[int] | None:
    """`grouped_matmul`'s splits: None for torch's grouped matmul, else the rows of each expert
    as numbers (`known` when the host has them, else read from `counts`: a host read)."""
    if uses_grouped_mm(xs, *widths):
        return None
    return known if known is not None else device.counts(counts, xs.shape[0])


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Experts(nn.Module):
    """The experts of one MoE layer, their matrices stacked by expert: w1 (gate) and w3 (up)
    [E, F, D], w2 (down) [E, D, F], expert e computing w2[e] (act(w1[e] x) * w3[e] x).

    Every parameter of an Experts module is stacked by expert (dim 0), so that expert
    parallelism can give each rank E/ep consecutive experts from outside
    (`lctrain.parallel.experts`: each parameter a DTensor sharded by expert, the rows carried to
    their experts' ranks and back around this module's own computation)."""

    def __init__(self, cfg: ModelConfig, activation: Callable[[Tensor], Tensor] = F.silu):
        super().__init__()
        self.n_experts = cfg.n_experts
        self.activation = activation
        self.std, self.out_std = cfg.init_std, cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.grad_scale = 1.0
        """Factor on the experts' gradients (tp/ep under expert parallelism, §28)."""
        self.make_parameters(cfg.n_experts, cfg.dim, cfg.expert_dim)

    def make_parameters(self, e: int, d: int, f: int) -> None:
        """The experts' parameters, each stacked by expert (E first), in the order `mlp` takes
        them."""
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))

    def forward(self, xs: Tensor, counts: Tensor, ahead: object = None) -> Tensor:
        """Each expert's MLP over its rows of xs [N k, D] (sorted by expert; counts [E]).
        `ahead`: what a parallel style around this module found ahead for these rows (none
        here)."""
        return self.mlp(xs, counts, *self.local_weights(xs.dtype))

    def local_weights(self, dtype: torch.dtype) -> list[Tensor]:
        """This module's parameters in registration order as plain tensors of `dtype`, their
        gradients scaled by `grad_scale`: in the activations' dtype under every engine (torch's
        grouped matmul has no autocast rule and takes one dtype, and autocast would leave fp32
        biases promoting the rows; a no-op under FSDP's bf16 weights); a DTensor's local shard
        (its experts on this rank)."""
        weights = [(w.to_local() if isinstance(w, DTensor) else w).to(dtype)
                   for w in self.parameters(recurse=False)]
        if self.grad_scale != 1.0:
            weights = [_ScaleGrad.apply(w, self.grad_scale) for w in weights]
        return weights

    def mlp(self, xs: Tensor, counts: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
            splits: list[int] | None = None) -> Tensor:
        """The experts' MLPs over xs sorted by expert, given their (local) parameters in
        registration order; `splits`: counts on the host when they are known there."""
        splits = _splits(xs, counts, splits, w1.shape[-2])
        gate = self.activation(grouped_matmul(xs, w1.transpose(-2, -1), counts, splits))
        up = grouped_matmul(xs, w3.transpose(-2, -1), counts, splits)
        return grouped_matmul(gate * up, w2.transpose(-2, -1), counts, splits)

    def init_rules(self) -> dict[str, float | None]:
        # the down projections feed the residual stream: scaled down by depth, as dense MLPs'
        return {"w1": self.std, "w3": self.std, "w2": self.out_std}


class GptOssExperts(Experts):
    """GPT-OSS's experts, in its checkpoints' layout: gate_up_proj [E, D, 2F] (x @ W, gate and
    up interleaved column by column) with gate_up_proj_bias [E, 2F], down_proj [E, F, D] with
    down_proj_bias [E, D]; the gate clamped to at most `model.swiglu_limit`, the up projection
    to +-limit, out = (up + 1) * gate * sigmoid(alpha gate) (`model.swiglu_alpha`)."""

    def __init__(self, cfg: ModelConfig, activation: Callable[[Tensor], Tensor] = F.silu):
        super().__init__(cfg, activation)
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def make_parameters(self, e: int, d: int, f: int) -> None:
        self.gate_up_proj = nn.Parameter(torch.empty(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.empty(e, d))

    def mlp(self, xs: Tensor, counts: Tensor, gate_up: Tensor, gate_up_bias: Tensor,
            down: Tensor, down_bias: Tensor, splits: list[int] | None = None) -> Tensor:
        splits = _splits(xs, counts, splits, gate_up.shape[-1], down.shape[-2])
        rows = torch.arange(counts.shape[0], device=xs.device).repeat_interleave(
            counts, output_size=xs.shape[0])  # each row's expert, for its biases
        h = grouped_matmul(xs, gate_up, counts, splits) + gate_up_bias[rows]
        gate = h[..., ::2].clamp(max=self.limit)
        up = h[..., 1::2].clamp(min=-self.limit, max=self.limit)
        glu = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return grouped_matmul(glu, down, counts, splits) + down_bias[rows]

    def init_rules(self) -> dict[str, float | None]:
        return {"gate_up_proj": self.std, "gate_up_proj_bias": ZEROS,
                "down_proj": self.out_std, "down_proj_bias": ZEROS}


class MoE(nn.Module):
    """A mixture-of-experts MLP: `router` (Linear D -> E, with a bias in GPT-OSS) and
    `experts` (`Experts`, or a family's); with a `shared_expert` (a gated MLP every token runs
    through: Qwen3.5-MoE, Qwen3-Next) its output times sigmoid(`shared_expert_gate`(x)) (a
    Linear D -> 1) is added to the experts'."""

    def __init__(self, cfg: ModelConfig, experts: Experts, layer: int = 0,
                 log: RouterLog | None = None, router_bias: bool = False,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(cfg.dim, 1, bias=False)
                                   if shared_expert is not None else None)
        self.layer = layer
        self.n_experts, self.top_k, self.norm_topk = (cfg.n_experts, cfg.experts_per_token,
                                                      cfg.norm_topk_prob)
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=router_bias)
        self.experts = experts
        self.log = log if log is not None else RouterLog()
        self.std = cfg.init_std

    def choose(self, x: Tensor) -> Tensor:
        """The k experts of each of x's N tokens [N, k] (int16; no gradient): what `route` picks
        for x, found ahead (a tiled layer's chunks, `lctrain.parallel.tiling.TiledMoE`)."""
        with torch.no_grad():
            probs = F.softmax(self.router(x).float(), dim=-1).reshape(-1, self.n_experts)
            return torch.topk(probs, self.top_k, dim=-1).indices.to(torch.int16)

    def route(self, x: Tensor, chosen: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, S, D] (its router sees the sequence dim: sequence parallelism's layout) ->
        (weights [N, k] in x's dtype, the N k (token, choice) rows in expert order [N k],
        tokens per expert [E]) for its N = B S tokens, to the k largest probabilities' experts
        or to `chosen`'s ([N, k], `choose`); records the statistics."""
        probs = F.softmax(self.router(x).float(), dim=-1).reshape(-1, self.n_experts)
        if chosen is None:
            top, experts = torch.topk(probs, self.top_k, dim=-1)
        else:  # the same experts, and the same probabilities: topk's values are these
            experts = chosen.long()
            top = probs.gather(1, experts)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        sorted_experts, order = experts.reshape(-1).sort(stable=True)
        counts = sorted_counts(sorted_experts, self.n_experts)
        self.log.record(self.layer, counts, probs.sum(dim=0), probs.shape[0])
        return top.to(x.dtype), order, counts

    def forward(self, x: Tensor, chosen: Tensor | None = None, ahead: object = None) -> Tensor:
        """x [B, S, D] through its tokens' experts (`chosen`, `ahead`: as `route` and
        `Experts.forward` take them, when found ahead)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, order, counts = self.route(x, chosen)
        token = order // self.top_k
        y = self.experts(flat[token], counts, ahead)
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, token, y).reshape(shape)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def init_rules(self) -> dict[str, float | None]:
        rules = {"router.weight": self.std}
        if self.shared_expert_gate is not None:
            rules["shared_expert_gate.weight"] = self.std
        if self.router.bias is not None:
            rules["router.bias"] = ZEROS
        return rules
