"""The RULER-style tasks of eval.tasks (lctrain.data.ruler), scored on greedy generation on the
training layout (lctrain.training.generate): eval.samples examples per (task, length), written
and read with the model's tokenizer, spread over the dp ranks in batches of train.micro_batch
prompts of one length. A generation is scored by the share of the example's expected strings
in its decoded text (up to the end-of-text token). Results: eval/ruler/<task>/len<L> and the
means by task (eval/ruler/<task>/score), by length (eval/ruler/len<L>/score) and overall
(eval/ruler/score); every sample (task, length, prompt ids, answers, generated ids, score) for
eval.json.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import nn

from lctrain.config import LctrainConfig
from lctrain.config.eval_rules import has_validation
from lctrain.config.ruler_tasks import RULER_TASKS, ruler_tasks
from lctrain.data.ruler import Example, RulerBuilder, score
from lctrain.data.sources import build_val_source
from lctrain.data.tokenizer import load_tokenizer
from lctrain.parallel.runtime import Runtime
from lctrain.training.generate import generate


class RulerEval:
    def __init__(self, cfg: LctrainConfig, rt: Runtime):
        from tokenizers import Tokenizer  # lazy: only runs that score these tasks need it

        self.cfg, self.rt = cfg, rt
        info = load_tokenizer(cfg.data)
        self.tokenizer, self.stop = Tokenizer.from_str(info.json), info.eos_id
        builder = RulerBuilder(self._encode, self._text_source())
        e, t = cfg.eval, cfg.train
        self.examples: list[Example] = [
            builder.example(RULER_TASKS[name], length, t.seed, i)
            for name in ruler_tasks(e.tasks) for length in e.lengths or [t.seq_len]
            for i in range(e.samples)]

    def _encode(self, text: str) -> np.ndarray:
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids,
                        dtype=np.int64)

    def _text_source(self):
        """The text haystack: tokens of validation documents (None without validation data)."""
        if not has_validation(self.cfg):
            return None
        source, seq_len = build_val_source(self.cfg), self.cfg.train.seq_len

        def text(rng: np.random.Generator, n: int) -> np.ndarray:
            sample = int(rng.integers(source.samples_per_epoch))
            return source.window(sample).read(0, seq_len + 1)[:n]

        return text

    @torch.no_grad()
    def run(self, model: nn.Module) -> tuple[dict[str, float], list[dict]]:
        """(results, samples), identical on every rank."""
        cfg, rt = self.cfg, self.rt
        dp, dp_rank, size = rt.topology.dp, rt.axis_rank("dp"), cfg.train.micro_batch
        writes = rt.axis_rank("cp") == 0  # one copy per dp rank (and TP rank: the same tokens)
        groups: dict[tuple[str, int], list[int]] = defaultdict(list)
        for i, ex in enumerate(self.examples):
            groups[ex.task, ex.length].append(i)
        longest = max(ex.answer_tokens for ex in self.examples)
        generated = torch.zeros(len(self.examples), longest, dtype=torch.float64,
                                device=rt.device)
        for members in groups.values():
            mine = members[dp_rank::dp]
            new = max(self.examples[i].answer_tokens for i in members)
            for k in range(-(-len(members) // (dp * size))):  # the same count on every rank
                batch = mine[k * size:(k + 1) * size]
                rows = batch or members[:1]  # a rank out of examples generates for nothing
                prompts = torch.from_numpy(np.stack([self.examples[i].prompt for i in rows]))
                tokens = generate(model, cfg, rt, prompts, new, self.stop)
                if writes:
                    for row, i in enumerate(batch):
                        generated[i, :new] = tokens[row].to(generated)
        rt.sum_scores(generated)
        return self._scored(generated.long().cpu())

    def _scored(self, generated: torch.Tensor) -> tuple[dict[str, float], list[dict]]:
        groups: dict[str, list[float]] = defaultdict(list)
        samples = []
        for ex, ids in zip(self.examples, generated.tolist()):
            ids = ids[:ex.answer_tokens]
            if self.stop is not None and self.stop in ids:
                ids = ids[:ids.index(self.stop)]
            value = score(self.tokenizer.decode(ids), ex.answers)
            for key in (f"eval/ruler/{ex.task}/len{ex.length}", f"eval/ruler/{ex.task}/score",
                        f"eval/ruler/len{ex.length}/score", "eval/ruler/score"):
                groups[key].append(value)
            samples.append({"task": ex.task, "length": ex.length,
                            "prompt": ex.prompt.tolist(), "answers": list(ex.answers),
                            "generated": ids, "score": value})
        return {k: float(np.mean(v)) for k, v in sorted(groups.items())}, samples


def ruler_table(results: dict[str, float], lengths: list[int]) -> list[str]:
    """Console lines: the score of each task by length, then the means by length."""
    tasks = [name for name in RULER_TASKS if f"eval/ruler/{name}/score" in results]
    if not tasks:
        return []
    width = max(len(t) for t in tasks)
    lines = [f"eval ruler {'task':<{width}} " + " ".join(f"{n:>8}" for n in lengths)]
    for name in tasks:
        lines.append(f"eval ruler {name:<{width}} " + " ".join(
            f"{results[f'eval/ruler/{name}/len{n}']:>8.3f}" for n in lengths))
    lines.append(f"eval ruler {'mean':<{width}} " + " ".join(
        f"{results[f'eval/ruler/len{n}/score']:>8.3f}" for n in lengths))
    return lines
