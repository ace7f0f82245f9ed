"""The needle in real text (eval.tasks=[needle]): examples built from held-out documents with a
tokenizer trained here; the needle, the question and the answer where they belong (positions
checked, for one and several keys and values); a model that retrieves by copying scores every
cell, an untrained one none; the one-forward score is greedy decoding's exact match; the same
scores per cell at cp=1 and cp=4 ring; what it needs is refused by name when missing, a stage
of train.stages too short for it included."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from lctrain.config.eval_rules import NEEDLE_KEYS
from lctrain.data.batch import array_window
from lctrain.data.needle import KEYS, NEEDLE, QUESTION, QUESTION_MANY, NeedleTask
from lctrain.data.shards import ShardWriter
from lctrain.data.tasks import eval_examples
from lctrain.parallel.runtime import setup_distributed
from lctrain.prepare.checks import preflight
from lctrain.training.evals import Evaluator
from tests.helpers import on_ranks, reference_model, tiny_config, with_overrides
from tests.test_evals import _distributed_scores

TEXT = ["the cat sat on the mat and looked at the garden", "a dog ran in the park after a ball",
        "once upon a time there was a quiet town by the river",
        "long context models read many tokens before they answer",
        "the river ran past the old mill where nobody worked any more"]


def _tokenizer(path) -> Tokenizer:
    """A word-piece BPE that knows the needle's words, every key and the digits."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    corpus = TEXT + [NEEDLE.format(key=k) + " 0123456789." for k in KEYS] + [
        QUESTION.format(key=k) for k in KEYS] + ["What are all the numbers are: 1, 2."]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokenizer path, token shards of 200 held-out-able documents, vocabulary size)."""
    root = tmp_path_factory.mktemp("needle")
    tok = _tokenizer(root / "tokenizer.json")
    rng = np.random.default_rng(0)
    docs = [tok.encode(" ".join(rng.choice(TEXT, 3))).ids for _ in range(200)]
    writer = ShardWriter(root / "data", "uint16", 10_000)
    writer.add(np.concatenate(docs).astype(np.uint16), np.array([len(d) for d in docs]))
    writer.commit({"vocab_size": tok.get_vocab_size()})
    return root / "tokenizer.json", root / "data", tok.get_vocab_size()


def _cfg(corpus, **eval_keys):
    tokenizer, data, vocab = corpus
    return tiny_config(
        model={"vocab_size": 320}, train={"seq_len": 256, "micro_batch": 2, "global_batch": 4},
        data={"source": "tokens", "path": str(data), "tokenizer": str(tokenizer),
              "val_fraction": 0.25, "document_masking": False},
        eval={"every": 1, "tasks": ["needle"], "lengths": [128, 256], "depths": [0.0, 0.5, 1.0],
              "samples": 2, **eval_keys})


@pytest.mark.parametrize("keys,values", [(1, 1), (3, 1), (2, 3)])
def test_needles_question_and_answer_sit_where_they_belong(corpus, keys, values):
    cfg = _cfg(corpus, needle_keys=keys, needle_values=values)
    assert preflight(cfg, 1) == []
    task = NeedleTask(cfg)
    tok = task.tokenizer
    examples = eval_examples(task, [128, 256], [0.0, 0.5, 1.0], 2, cfg.train.seed)
    assert len(examples) == 12 and len(KEYS) == NEEDLE_KEYS
    for ex in examples:
        tokens = ex.window.read(0, ex.length)
        answer_at, answer = ex.targets[:, 0] + 1, ex.targets[:, 1]
        assert (answer_at == np.arange(ex.length - len(answer), ex.length)).all()
        assert (tokens[answer_at] == answer).all()
        text = tok.decode(tokens.tolist())
        asked = text[text.rindex("for ") + 4:].split()[0]  # the question's key
        numbers = [w.strip(".,") for w in tok.decode(answer.tolist()).replace(",", " ").split()]
        assert len(numbers) == values and all(len(n) == 7 and n.isdigit() for n in numbers)
        # every asked value is in a needle of the asked key, in the order the answer lists them
        needle = NEEDLE.format(key=asked).strip()
        question_at = text.rindex("What")  # the question, whole, then the answer
        question = (QUESTION if values == 1 else QUESTION_MANY).format(key=asked).strip()
        assert text[question_at:].startswith(question)
        spans = [i for i in range(question_at) if text.startswith(needle, i)]
        found = [text[s + len(needle):].split()[0].strip(".") for s in spans]
        assert found == numbers  # before the question, no overlap with it
        needles = sum(text[:question_at].count(f"number for {k} is") for k in KEYS)
        assert needles == keys - 1 + values  # the distractors' and the asked key's
        if values == 1 and keys == 1:  # the needle at its depth of the haystack
            start = _sublist(tokens, task.encode(NEEDLE.format(key=asked)))
            room = ex.length - len(task.pieces(np.random.default_rng(0))[0][0]) - len(
                task.encode(QUESTION.format(key=asked))) - len(answer)
            assert abs(start - round(ex.depth * room)) <= 2, (start, ex.depth, room)


def _sublist(tokens: np.ndarray, piece: np.ndarray) -> int:
    for i in range(len(tokens) - len(piece) + 1):
        if (tokens[i:i + len(piece)] == piece).all():
            return i
    raise AssertionError("needle not found")


class CopyLongestMatch(nn.Module):
    """Retrieval by hand: predict the token that followed the earlier position whose preceding
    tokens match the current ones longest (an induction head with unlimited memory)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens, positions=None, doc_ids=None, labels=None):
        if labels is not None:  # the validation loss the evaluator also runs: not scored here
            return torch.zeros(labels.shape[:-2])
        out = torch.zeros(*tokens.shape, self.vocab)
        for b, row in enumerate(tokens.tolist()):
            for s in range(len(row)):
                best, pick = 0, 0
                for j in range(s):
                    n = 0
                    while n <= j and row[j - n] == row[s - n]:
                        n += 1
                    if n >= best:
                        best, pick = n, row[j + 1]
                out[b, s, pick] = 1.0
        return out


def test_a_copying_model_finds_every_needle_and_an_untrained_one_none(corpus):
    cfg = _cfg(corpus, needle_keys=3)
    ev = Evaluator(cfg, setup_distributed(cfg))
    results = ev.run(CopyLongestMatch(cfg.model.vocab_size))
    assert results["eval/needle/acc"] == 1.0
    assert all(results[f"eval/needle/len{n}/depth{d:.2f}"] == 1.0 for n in (128, 256)
               for d in (0, 0.5, 1))
    assert ev.run(reference_model(cfg))["eval/needle/acc"] == 0.0  # chance: 1e-7 per needle


@pytest.mark.slow  # 1.3 s: 4 ranks (the fast tier's evals on ranks: test_evals.py)
def test_the_same_scores_per_cell_at_cp1_and_cp4_ring(corpus):
    cfg = _cfg(corpus)
    examples = Evaluator(cfg, setup_distributed(cfg)).examples
    # a known half of the examples right for the untrained model (its own argmax), the rest not
    model = reference_model(cfg)
    for i, ex in enumerate(examples):
        tokens = torch.from_numpy(ex.window.read(0, cfg.train.seq_len))[None]
        with torch.no_grad():
            pred = model(tokens)[0, ex.targets[:, 0]].argmax(-1).numpy()
        ex.targets = np.stack([ex.targets[:, 0], pred if i % 2 else pred + 1], axis=1)
    scores = {1: on_ranks(_distributed_scores, 1, [cfg], examples)[0][0]}
    ring = with_overrides(cfg, parallel={"cp": 4, "attention": "ring"})
    scores[4] = on_ranks(_distributed_scores, 4, [ring], examples, timeout_s=300)[0][0]
    needle = {k for k in scores[1] if k.startswith("eval/needle/")}
    assert len(needle) == 1 + 2 + 6 and scores[1]["eval/needle/acc"] == 0.5
    assert {k: scores[4][k] for k in needle} == {k: scores[1][k] for k in needle}
    assert {scores[1][f"eval/needle/len{n}/depth{d:.2f}"] for n in (128, 256)
            for d in (0, 0.5, 1)} == {0.5}


def test_what_the_needle_needs_is_refused_by_name(corpus):
    no_tokenizer = _cfg(corpus)
    no_tokenizer.data.tokenizer = None
    assert any("eval.tasks has needle, which writes its needle and question with the model's "
               "tokenizer" in p for p in preflight(no_tokenizer, 1))
    no_text = _cfg(corpus)
    no_text.data.val_fraction = 0.0
    assert any("eval.tasks has needle, whose haystack is held-out text" in p
               for p in preflight(no_text, 1))
    short = _cfg(corpus, lengths=[16])
    assert any("eval.lengths contains 16; the needle task needs contexts of at least" in p
               for p in preflight(short, 1))


def test_a_stage_too_short_for_the_needle_is_refused_by_name(corpus):
    from lctrain.config.schema import StageConfig

    staged = _cfg(corpus)
    staged.train.steps = 2
    staged.train.stages = [StageConfig(32, 1), StageConfig(256, 1)]
    assert any(p.startswith("train.stages[0]: train.seq_len=32 (scored as eval.lengths is "
                            "empty); the needle task needs")
               for p in preflight(staged, 1))


def test_the_score_is_greedy_decodings_exact_match(corpus):
    """What the model generates greedily, token by token from the prompt, is exactly what the
    one-forward score counts as right; one token off anywhere, and it is wrong."""
    cfg = _cfg(corpus)
    ev = Evaluator(cfg, setup_distributed(cfg))
    model = reference_model(cfg)
    ev.examples = ev.examples[::3]
    for i, ex in enumerate(ev.examples):
        first = int(ex.targets[0, 0]) + 1  # the first answer token's position
        seq = torch.from_numpy(ex.window.read(0, first))[None]
        with torch.no_grad():
            for _ in range(len(ex.targets)):  # greedy generation, no cache
                seq = torch.cat([seq, model(seq)[0, -1].argmax().view(1, 1)], dim=1)
        generated = seq[0, first:].numpy().copy()
        if i % 2:  # an answer greedy decoding does not give
            generated[-1] += 1
        # the example whose answer is `generated`
        tokens = np.concatenate([ex.window.read(0, first), generated, [0]])
        ex.window = array_window(tokens, np.array([len(tokens)]), cfg.train.seq_len + 1)
        ex.targets = np.stack([ex.targets[:, 0], generated], axis=1)
    results = ev.run(model)
    assert results["eval/needle/acc"] == np.mean([i % 2 == 0 for i in range(len(ev.examples))])
