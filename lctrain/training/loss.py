"""The training loss: the sum of token cross-entropies over valid targets (docs/parallelism.md
§10), vocab-parallel when TP shards the logits over the vocabulary."""

from __future__ import annotations

import contextlib

import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lctrain.data.batch import IGNORE_INDEX


def vocab_parallel(logits: Tensor) -> contextlib.AbstractContextManager:
    """The context the loss of `logits` (and its backward) runs in: vocab-sharded logits
    [B, S/cp, V/tp] need loss_parallel, so that no rank holds all of V."""
    return loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext()


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Sum of the cross-entropies of the valid targets, in float32 (call inside
    `vocab_parallel(logits)`; a DTensor result under TP)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def value(loss: Tensor) -> Tensor:
    """The plain tensor of a loss (a DTensor loss is replicated over tp)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
