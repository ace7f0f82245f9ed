"""Validation loss on held-out data (eval.val_data, or the documents data.val_fraction keeps out
of training): val_loss and val_ppl, token-weighted over eval.val_sequences sequences exactly as
the training loss is, on the training layout itself."""

from __future__ import annotations

import math

import torch
from torch import nn

from lctrain.config import LctrainConfig
from lctrain.data.batch import IGNORE_INDEX, MicroBatch
from lctrain.data.loader import DataLoader
from lctrain.data.sources import build_val_source
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import loss_value, vocab_parallel


class ValidationLoss:
    """The same eval.val_sequences sequences every time, each dp rank scoring its share."""

    def __init__(self, cfg: LctrainConfig, rt: Runtime):
        self.rt, self.sequences = rt, cfg.eval.val_sequences
        t, topo = cfg.train, rt.topology
        loader = DataLoader(build_val_source(cfg), t.seq_len, dp_rank=rt.axis_rank("dp"),
                            dp=topo.dp, cp_rank=rt.axis_rank("cp"), cp=topo.cp,
                            load_balance=cfg.parallel.load_balance, micro_batch=t.micro_batch,
                            grad_accum=self.sequences // (t.micro_batch * topo.dp),
                            document_masking=cfg.data.document_masking, seed=t.seed)
        self.micro_batches: list[MicroBatch] = loader.next_step()

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """{'val_loss': mean token loss, 'val_ppl': its exponential} (identical on every rank)."""
        rt = self.rt
        totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss sum, tokens
        for mb in self.micro_batches:
            mb = mb.to(rt.device)
            with vocab_parallel(rt.topology.tp), rt.autocast():
                loss = model(mb.inputs, mb.positions, mb.doc_ids, labels=mb.labels)
            if loss is not None:  # None: not the last pipeline stage
                totals[0] += loss_value(loss).double()
                totals[1] += (mb.labels != IGNORE_INDEX).sum()
        rt.sum_scores(totals)
        loss = (totals[0] / totals[1]).item()
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
