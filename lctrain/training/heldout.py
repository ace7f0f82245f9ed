"""Validation loss on held-out data (eval.val_data, or the documents data.val_fraction keeps out
of training): val_loss and val_ppl, token-weighted over eval.val_sequences sequences exactly as
the training loss is, on the training layout itself; and the same loss by position band
(eval.position_band), val_loss/pos<lo>-<hi>, over the targets whose predicting token sits at a
RoPE position in [lo, hi). The bands' token-weighted losses recombine to val_loss: they are its
parts, each a loss sum of the same forward (`Decoder.forward` with one label set per band)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.config.eval_rules import position_bands
from lctrain.data.batch import IGNORE_INDEX, MicroBatch
from lctrain.data.loader import DataLoader
from lctrain.data.sources import build_val_source
from lctrain.models.decoder import without_routing
from lctrain.parallel.runtime import Runtime
from lctrain.parallel.tensor import loss_value, vocab_parallel


class ValidationLoss:
    """The same eval.val_sequences sequences every time, each dp rank scoring its share."""

    def __init__(self, cfg: LctrainConfig, rt: Runtime):
        self.rt, self.sequences = rt, cfg.eval.val_sequences
        t, topo = cfg.train, rt.topology
        loader = DataLoader(build_val_source(cfg), t.seq_len, dp_rank=rt.axis_rank("dp"),
                            dp=topo.dp, cp_rank=rt.axis_rank("cp"), cp=topo.cp,
                            load_balance=load_balance_of(cfg), micro_batch=t.micro_batch,
                            grad_accum=self.sequences // (t.micro_batch * topo.dp),
                            document_masking=cfg.data.document_masking, seed=t.seed,
                            ulysses=ulysses_degree(cfg.parallel))
        self.micro_batches: list[MicroBatch] = loader.next_step()
        self.bands = position_bands(cfg)

    def _band_labels(self, mb: MicroBatch) -> Tensor:
        """[bands, B, S/cp]: the micro-batch's labels, each band's own targets kept."""
        positions = mb.positions.expand_as(mb.labels)
        return torch.stack([torch.where((positions >= lo) & (positions < hi), mb.labels,
                                        IGNORE_INDEX) for lo, hi in self.bands])

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """{'val_loss': mean token loss, 'val_ppl': its exponential, and with more than one
        band 'val_loss/pos<lo>-<hi>': each band's mean token loss (a band without targets is
        left out)}, identical on every rank."""
        rt, n = self.rt, len(self.bands)
        totals = torch.zeros(2, n, dtype=torch.float64, device=rt.device)  # loss sums, tokens
        for mb in self.micro_batches:
            mb = mb.to(rt.device)
            labels = self._band_labels(mb)
            with vocab_parallel(rt.topology.tp), rt.autocast():
                loss = without_routing(model(mb.inputs, positions=mb.positions, doc_ids=mb.doc_ids,
                                             labels=labels))
            if loss is not None:  # None: not the last pipeline stage
                totals[0] += loss_value(loss).double()
                totals[1] += (labels != IGNORE_INDEX).flatten(1).sum(1)
        rt.sum_scores(totals)
        loss = (totals[0].sum() / totals[1].sum()).item()
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
        if n > 1:
            out.update({f"val_loss/pos{lo}-{hi}": (s / count).item() for (lo, hi), s, count
                        in zip(self.bands, totals[0], totals[1]) if count > 0})
        return out
