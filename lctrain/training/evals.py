"""Retrieval evals during training: passkey and multi-key recall accuracy by context length and
needle depth (lctrain.data.tasks), and the needle in real text (lctrain.data.needle), on the
training layout itself; the RULER-style tasks, scored on generation, by
`lctrain.training.ruler_eval`.

Every (task, length, depth) cell has eval.samples examples. An example is one document at the
start of a train.seq_len window (padding after it changes nothing under causal attention), so it
runs through exactly the model, parallel layout and cp split that training uses. The prediction
of each answer token is the argmax of the logits at the position before it, with the true
answer before it as input (teacher forcing: one forward, no generation). An example counts as
correct when every answer token is. Examples are spread over the dp ranks; each cp rank scores
the answer tokens it holds (with pipeline parallelism, on the last stage), and one all-reduce
over dp x cp (and one over the pipeline) adds up the misses.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import nn

from lctrain.config import LctrainConfig
from lctrain.config.derived import load_balance_of, ulysses_degree
from lctrain.config.eval_rules import has_validation
from lctrain.config.ruler_tasks import RULER_SUITE, ruler_tasks
from lctrain.data.batch import build_micro_batch
from lctrain.data.needle import NeedleTask
from lctrain.data.tasks import TASKS, EvalExample, eval_examples
from lctrain.models.decoder import without_routing
from lctrain.parallel.runtime import Runtime
from lctrain.training.generate import vocab_argmax
from lctrain.training.heldout import ValidationLoss
from lctrain.training.ruler_eval import RulerEval, ruler_table


def cell_key(ex: EvalExample) -> str:
    return f"eval/{ex.task}/len{ex.length}/depth{ex.depth:.2f}"


class Evaluator:
    """Decides when to evaluate (`should_run`) and scores the model (`run`) on every rank: the
    retrieval tasks, and the validation loss when validation data is set."""

    def __init__(self, cfg: LctrainConfig, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.validation = (ValidationLoss(cfg, rt) if cfg.eval.every and has_validation(cfg)
                           else None)
        e, t = cfg.eval, cfg.train
        self.examples: list[EvalExample] = []
        generated = ruler_tasks(e.tasks)
        self.ruler = RulerEval(cfg, rt) if e.every and generated else None
        """The RULER-style tasks, scored on generation (lctrain.training.ruler_eval)."""
        self.samples: list[dict] = []
        """Their last run's samples (prompts, answers, generated ids), for eval.json."""
        for name in e.tasks if e.every else []:
            if name in generated or name == RULER_SUITE:
                continue
            task = (NeedleTask(cfg) if name == NeedleTask.name
                    else TASKS[name](cfg.data, cfg.model.vocab_size, t.seq_len, t.seed))
            self.examples += eval_examples(task, e.lengths or [t.seq_len], e.depths, e.samples,
                                           t.seed)
        self.dp, self.dp_rank = rt.topology.dp, rt.axis_rank("dp")
        self.cp_rank = rt.axis_rank("cp")
        self.load_balance, self.ulysses = load_balance_of(cfg), ulysses_degree(cfg.parallel)

    def should_run(self, step: int) -> bool:
        every = self.cfg.eval.every
        return every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def _misses(self, logits: torch.Tensor, batch: list[int],
                global_positions: torch.Tensor) -> torch.Tensor:
        """[examples, 2]: (answer tokens missed, answer tokens scored) on this rank, whose tokens
        sit at `global_positions` ([1 or B, S/cp], the micro-batch's split)."""
        rt = self.rt
        pred = vocab_argmax(logits, rt.group("tp"), rt.axis_rank("tp")).cpu()
        out = torch.zeros(len(self.examples), 2, dtype=torch.float64)
        for b, i in enumerate(batch):
            held = global_positions[min(b, len(global_positions) - 1)]
            local_index = torch.full((self.cfg.train.seq_len,), -1, dtype=torch.long)
            local_index[held] = torch.arange(len(held))
            targets = torch.from_numpy(self.examples[i].targets)
            where = local_index[targets[:, 0]]
            mine = where >= 0
            out[i, 0] = (pred[b, where[mine]] != targets[mine, 1]).sum()
            out[i, 1] = mine.sum()
        return out

    @torch.no_grad()
    def run(self, model: nn.Module) -> dict[str, float]:
        """Accuracy per cell, per task and overall (identical on every rank)."""
        cfg, rt = self.cfg, self.rt
        mine = list(range(self.dp_rank, len(self.examples), self.dp))
        n_batches = -(-len(self.examples) // (self.dp * cfg.train.micro_batch))
        if not self.examples:
            n_batches = 0
        # on the device: NCCL reduces device tensors only
        misses = torch.zeros(len(self.examples), 2, dtype=torch.float64, device=rt.device)
        mb_size = cfg.train.micro_batch
        for k in range(n_batches):  # the same count on every rank (FSDP gathers per forward)
            batch = mine[k * mb_size:(k + 1) * mb_size]
            scored = batch or mine[:1] or [0]  # a rank out of examples runs a discarded forward
            mb = build_micro_batch([self.examples[i].window for i in scored], cfg.train.seq_len,
                                   self.cp_rank, rt.topology.cp, self.load_balance,
                                   cfg.data.document_masking, self.ulysses).to(rt.device)
            with rt.autocast():
                logits = without_routing(model(mb.inputs, positions=mb.positions,
                                                doc_ids=mb.doc_ids))
            if batch and logits is not None:  # None: not the last pipeline stage
                misses += self._misses(logits, batch, mb.global_positions).to(rt.device)
        rt.sum_scores(misses)
        results = summarize(self.examples, misses.cpu())
        if self.ruler is not None:
            scores, self.samples = self.ruler.run(model)
            results.update(scores)
        if self.validation is not None:
            results.update(self.validation.run(model))
        return results


def summarize(examples: list[EvalExample], misses: torch.Tensor) -> dict[str, float]:
    """Exact-match accuracy per cell, per task, and overall from per-example (missed, scored)."""
    correct = ((misses[:, 0] == 0) & (misses[:, 1] > 0)).tolist()
    groups: dict[str, list[bool]] = defaultdict(list)
    for ex, ok in zip(examples, correct):
        for key in (cell_key(ex), f"eval/{ex.task}/acc", f"eval/{ex.task}/len{ex.length}/acc"):
            groups[key].append(ok)
    return {k: float(np.mean(v)) for k, v in sorted(groups.items())}


def format_table(results: dict[str, float], tasks: list[str],
                 lengths: list[int] | None = None) -> list[str]:
    """Console lines: one per task and context length, accuracy by depth; the RULER-style tasks'
    scores by task and length (`lengths`); the validation loss."""
    lines = ruler_table(results, lengths or [])
    if "val_loss" in results:
        lines.append(f"eval validation: loss {results['val_loss']:.4f}  "
                     f"ppl {results['val_ppl']:.2f}")
        bands = [f"{key.removeprefix('val_loss/pos')}:{value:.4f}"
                 for key, value in results.items() if key.startswith("val_loss/pos")]
        if bands:
            lines.append(f"eval validation by position: {' '.join(bands)}")
    for task in tasks:
        cells: dict[str, list[str]] = defaultdict(list)
        for key, acc in results.items():
            parts = key.split("/")
            if (len(parts) == 4 and parts[1] == task and parts[3].startswith("depth")):
                cells[parts[2]].append(f"{parts[3][5:]}:{acc:.2f}")
        for length, row in sorted(cells.items(), key=lambda kv: int(kv[0][3:])):
            lines.append(f"eval {task} {length}: acc {results[f'eval/{task}/{length}/acc']:.3f}  "
                         f"by depth {' '.join(row)}")
    return lines
