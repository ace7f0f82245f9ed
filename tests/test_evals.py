"""Retrieval evals: scoring against models whose answers are known, and the same scores on every
parallel layout as in one process."""

import numpy as np
import torch
from torch import nn

from lctrain.data.batch import micro_batch_from_tokens
from lctrain.data.tasks import KEY
from lctrain.parallel.parallelize import build_model
from lctrain.parallel.runtime import setup_distributed
from lctrain.training.evals import Evaluator, format_table
from tests.helpers import on_ranks, reference_model, tiny_config, with_overrides

EVAL = {"every": 1, "tasks": ["passkey", "recall"], "lengths": [16, 32], "depths": [0.0, 1.0],
        "samples": 3}


def cfg_for(**parallel):
    return tiny_config(eval=EVAL, data={"recall_pairs": 2}, parallel=parallel)


class RetrieveAfterKey(nn.Module):
    """Passkey by hand: at every position predict the token that followed the latest KEY."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens, positions=None, doc_ids=None):
        out = torch.zeros(*tokens.shape, self.vocab)
        for b, row in enumerate(tokens.tolist()):
            answer = 0
            for s, tok in enumerate(row):
                if s and row[s - 1] == KEY:
                    answer = tok
                out[b, s, answer] = 1.0
        return out


def test_scores_of_models_with_known_answers():
    cfg = cfg_for()
    ev = Evaluator(cfg, setup_distributed(cfg))
    assert len(ev.examples) == 2 * 2 * 2 * 3
    results = ev.run(RetrieveAfterKey(cfg.model.vocab_size))
    assert results["eval/passkey/acc"] == 1.0  # a true retrieval algorithm gets every needle
    assert all(results[f"eval/passkey/len{n}/depth{d:.2f}"] == 1.0 for n in (16, 32)
               for d in (0, 1))
    # recall: KEY is followed by the key, not the value, so the same rule must always miss
    assert results["eval/recall/acc"] == 0.0
    lines = format_table(results, ["passkey", "recall"])
    assert lines[0].startswith("eval passkey len16: acc 1.000") and len(lines) == 4


def _reference_predictions(cfg, examples):
    """One process, full logits: (argmax, argmin, top-2 margin) at every example's targets."""
    model = reference_model(cfg)
    out = []
    with torch.no_grad():
        for ex in examples:
            tokens = torch.from_numpy(ex.window.read(0, cfg.train.seq_len + 1))[None]
            mb = micro_batch_from_tokens(tokens, cfg.train.seq_len)
            logits = model(mb.inputs, positions=mb.positions)[0, ex.targets[:, 0]]
            top = logits.topk(2, dim=-1).values
            out.append((logits.argmax(-1).numpy(), logits.argmin(-1).numpy(),
                        (top[:, 0] - top[:, 1]).min().item()))
    return out


def _distributed_scores(cfgs, examples):
    """The scores of each layout in turn, on the same ranks."""
    out = []
    for cfg in cfgs:
        rt = setup_distributed(cfg)
        model = build_model(cfg, rt)  # laid out exactly as training lays it out
        ev = Evaluator(cfg, rt)
        ev.examples = examples
        out.append(ev.run(model))
    return out


def test_every_layout_scores_as_one_process():
    cfg = cfg_for()
    examples = Evaluator(cfg, setup_distributed(cfg)).examples
    # make a known half of the examples right for the untrained model (expected = its own
    # clear argmax) and the rest surely wrong (expected = its argmin)
    right = []
    for i, (ex, (top, bottom, margin)) in enumerate(zip(examples,
                                                        _reference_predictions(cfg, examples))):
        ok = i % 2 == 0 and margin > 1e-3
        ex.targets = np.stack([ex.targets[:, 0], top if ok else bottom], axis=1)
        right.append(ok)
    assert sum(right) >= 6
    expected_passkey = np.mean([r for r, ex in zip(right, examples) if ex.task == "passkey"])
    for world, pars in [(1, [{}]), (4, [{"cp": 2, "dp": 2, "attention": "ring"},
                                        {"tp": 2, "sp": True, "cp": 2, "attention": "ulysses"}])]:
        layouts = [with_overrides(cfg_for(**par), train={"micro_batch": 2, "global_batch": 4})
                   for par in pars]
        per_rank = on_ranks(_distributed_scores, world, layouts, examples, timeout_s=300)
        every_rank = [(par, scores) for rank in per_rank for par, scores in zip(pars, rank)]
        for par, results in every_rank:
            assert results["eval/passkey/acc"] == expected_passkey, par
            for ex_key in ("eval/recall/len32/depth1.00", "eval/passkey/len16/depth0.00"):
                task, length, depth = ex_key.split("/")[1:]
                cell = [r for r, ex in zip(right, examples) if ex.task == task
                        and f"len{ex.length}" == length and f"depth{ex.depth:.2f}" == depth]
                assert results[ex_key] == np.mean(cell), (par, ex_key)


def test_position_bands_double_up_to_the_sequence_and_print_on_one_line():
    from lctrain.config.eval_rules import position_bands
    from lctrain.config.validation import validate

    def bands(seq_len, band):
        return position_bands(tiny_config(train={"seq_len": seq_len}, eval={"position_band": band}))

    assert bands(256, None) == [(0, 64), (64, 128), (128, 256)]  # auto: 64 on short sequences
    assert bands(8192, None) == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert bands(96, 32) == [(0, 32), (32, 64), (64, 96)]  # the last band ends at seq_len
    assert bands(256, 0) == [(0, 256)]
    cfg = tiny_config(train={"seq_len": 32}, eval={"position_band": 32})
    assert any("eval.position_band=32 leaves one band of train.seq_len=32 tokens; try "
               "eval.position_band=8" in p for p in validate(cfg, 1))
    lines = format_table({"val_loss": 4.0, "val_ppl": 54.6, "val_loss/pos0-8": 4.25,
                          "val_loss/pos8-16": 3.75}, [])
    assert lines == ["eval validation: loss 4.0000  ppl 54.60",
                     "eval validation by position: 0-8:4.2500 8-16:3.7500"]
