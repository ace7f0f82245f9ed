"""Whole-model parity of the per-row documents split (load_balance=documents, the default with
packed documents): every gradient after one backward, on rows of many short documents, a
1-token document, one longer than S/cp and prime lengths, two different rows per micro-batch,
equals the one-process model's, for every algorithm at cp 2 and 4 and with TP + SP
(docs/parallelism.md §24). The pipeline's case is tests/test_pipeline.py's pp2_cp2_ring_docs."""

import numpy as np
import pytest
import torch

from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.data.batch import array_window, build_micro_batch
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.training.step import forward_backward
from tests.helpers import HEADS_8, on_ranks, tiny_config

ROWS = [np.array([1, 5, 3, 17, 3, 3]), np.array([2, 3, 5, 7, 11, 4])]  # 32 tokens (+1 label)
LAYOUTS = [  # (world, parallel overrides)
    (2, {"cp": 2, "attention": "ring"}),
    (2, {"cp": 2, "attention": "ulysses"}),
    (2, {"cp": 2, "attention": "allgather"}),
    (4, {"cp": 4, "attention": "ring"}),
    (4, {"cp": 4, "attention": "ulysses"}),
    (4, {"cp": 4, "attention": "usp", "ulysses_degree": 2}),
    (4, {"cp": 4, "attention": "allgather"}),
    (4, {"tp": 2, "sp": True, "cp": 2, "attention": "ring"}),
    (4, {"tp": 2, "sp": True, "cp": 2, "attention": "allgather"}),
]


def _grads(cfg, tokens: torch.Tensor):
    """(loss sum over every rank, {name: whole gradient}) after one backward of the packed
    rows, split by the loader's own function."""
    import torch.distributed as dist

    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    lengths = [np.concatenate([r[:-1], [r[-1] + 1]]) for r in ROWS]  # the label token too
    windows = [array_window(t, n, len(t)) for t, n in zip(tokens.numpy(), lengths)]
    mb = build_micro_batch(windows, cfg.train.seq_len, rt.axis_rank("cp"), cfg.parallel.cp,
                           load_balance_of(cfg), True, ulysses_degree(cfg.parallel))
    scale = rt.topology.group_size("dp_cp") / tokens[:, 1:].numel()
    loss = forward_backward(model, mb, scale, rt).reshape(1)
    if dist.is_initialized() and rt.dp_cp_group is not None:
        dist.all_reduce(loss, group=rt.dp_cp_group)
    return loss.item(), {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                         for n, p in model.named_parameters()}


@pytest.mark.slow  # about 15 s on 2 cores: 10 spawns of 1 to 4 ranks
def test_documents_split_gradients_equal_one_process():
    tokens = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(5))
    base = {"model": HEADS_8, "train": {"global_batch": 2, "micro_batch": 2},
            "data": {"document_masking": True}}
    ref_loss, ref = on_ranks(_grads, 1, tiny_config(**base), tokens)[0]
    for world, par in LAYOUTS:
        cfg = tiny_config(**base, parallel=par)
        assert load_balance_of(cfg) == "documents"
        loss, grads = on_ranks(_grads, world, cfg, tokens, timeout_s=300)[0]
        assert loss == pytest.approx(ref_loss, rel=1e-5), par
        assert grads.keys() == ref.keys()
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=f"{par} {name}")
