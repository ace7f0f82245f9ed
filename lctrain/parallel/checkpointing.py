"""Activation checkpointing of the transformer blocks: none | selective | full.

Applied by running each block's forward through `torch.utils.checkpoint.checkpoint` (not
re-entrant), installed on the block itself, so parameter names and the model code stay as they
are; it composes with TP/SP (applied before) and FSDP (after, whose hooks run around the block's
call: the recompute, inside the backward, finds the weights the backward gathered). A block may
be recomputed more than once: the zero-bubble pipeline schedules run the input-gradient and the
weight-gradient halves of its backward apart, and each recomputes it (torch's composable
`checkpoint` recomputes in a context that can be entered once).
Selective checkpointing keeps what is expensive to recompute, the matmul outputs and, with local
attention (cp = 1), the attention kernel's output and lse, and recomputes the cheap, memory-heavy
rest (norms, RoPE, SwiGLU, residuals). Context-parallel attention runs many partial kernel calls
(one per ring step and run pair); caching each would cost more than the whole output, so there
the attention core is recomputed, as in Korthikanti et al.'s selective recompute
(docs/parallelism.md §11).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
LOCAL_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,  # CPU
    torch.ops.aten._scaled_dot_product_flash_attention.default,  # CUDA, the kernels SDPA picks
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}
"""The fused attention ops local SDPA runs, whose output and lse selective keeps."""


def _policy(save: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def saved_ops(mode: str, cp: int, kernel_ops: set = frozenset()) -> set | None:
    """The ops whose outputs selective checkpointing keeps (None: full recompute); at cp = 1
    also `kernel_ops`, the forward ops of lctrain's kernel backend (documents, or a named
    train.attention_kernel: lctrain.attention.kernels.forward_ops)."""
    if mode == "full":
        return None
    return MATMULS | (LOCAL_ATTENTION | set(kernel_ops) if cp == 1 else set())


def apply_activation_checkpointing(model: nn.Module, mode: str, cp: int = 1,
                                   kernel_ops: set = frozenset()) -> nn.Module:
    """Checkpoint every block of `model` in place (mode none | selective | full); returns it."""
    if mode == "none":
        return model
    save = saved_ops(mode, cp, kernel_ops)
    context_fn = noop_context_fn if save is None else partial(
        create_selective_checkpoint_contexts, partial(_policy, save))
    for layer in model.layers.values():
        layer.forward = partial(checkpoint, layer.forward, use_reentrant=False,
                                context_fn=context_fn)
    return model
