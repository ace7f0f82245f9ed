"""The RULER-style tasks (lctrain.data.ruler) against hand-made checks: every prompt exactly its
length in the model's tokens, its task's statements whole in it, the expected answers there
and never a distractor's, the word lists' counts as the answers say, the same prompt for the
same seed; the scoring on present, absent and partly present answers."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lctrain.config.ruler_tasks import RULER_TASKS
from lctrain.data import ruler
from lctrain.data.ruler import RulerBuilder, score

TEXT = "Once upon a time a river ran past an old mill where nobody worked any more. " * 3


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A small BPE that knows the templates' words; digits, letters and dashes byte by byte."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [ruler.NOISE, *ruler.HEAD.values(), ruler.NEEDLE, ruler.QUESTION, ruler.VT_HEAD,
              ruler.VT_FIRST, ruler.VT_NEXT, ruler.VT_QUESTION, ruler.CWE_HEAD,
              ruler.CWE_QUESTION, ruler.FWE_HEAD, ruler.FWE_QUESTION, TEXT, " ".join(ruler.KEYS),
              "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ -.,:\n"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def _builder(tok: Tokenizer) -> RulerBuilder:
    text = np.array(tok.encode(TEXT).ids, dtype=np.int64)

    def source(rng: np.random.Generator, n: int) -> np.ndarray:
        start = int(rng.integers(len(text)))
        return np.tile(np.roll(text, -start), -(-n // len(text)))[:n]

    return RulerBuilder(lambda s: np.array(tok.encode(s).ids, dtype=np.int64), source)


def _contains(prompt: np.ndarray, piece: np.ndarray) -> bool:
    window = np.lib.stride_tricks.sliding_window_view(prompt, len(piece))
    return bool((window == piece).all(axis=1).any())


@pytest.mark.parametrize("length", [700, 1024, 2900])
def test_every_task_fills_its_length_exactly_with_its_answers_in_place(tokenizer, length):
    builder = _builder(tokenizer)
    for name, task in RULER_TASKS.items():
        ex = builder.example(task, length, seed=0, index=1)
        assert (ex.task, ex.length, len(ex.prompt)) == (name, length, length), name
        again = builder.example(task, length, seed=0, index=1)
        assert np.array_equal(ex.prompt, again.prompt) and ex.answers == again.answers
        assert not np.array_equal(ex.prompt, builder.example(task, length, 0, 2).prompt)
        text = tokenizer.decode(ex.prompt.tolist())
        assert len(set(ex.answers)) == len(ex.answers), name
        if task.kind == "niah":
            _check_needles(builder, task, ex, text)
        elif task.kind == "vt":
            _check_chain(ex, text)
        else:
            _check_counts(task, ex, text)
        assert ex.answer_tokens >= len(tokenizer.encode(" " + ", ".join(ex.answers)).ids)


def _check_needles(builder, task, ex, text):
    """The asked values each in a needle of an asked key, whole; every other needle's value
    is no answer; a multi-value key's values all there."""
    found = re.findall(r"special magic (?:numbers?|uuids?) for ([\w-]+) is: ([\w-]+)\.",
                       text.replace("  ", " "))
    by_key: dict[str, list[str]] = {}
    for key, value in found:
        by_key.setdefault(key, []).append(value)
    asked = [k for k, values in by_key.items() if set(values) & set(ex.answers)]
    assert len(asked) == task.queries, (task.name, asked)
    assert sorted(v for k in asked for v in by_key[k]) == sorted(ex.answers), task.name
    others = [v for k, values in by_key.items() if k not in asked for v in values]
    assert len(others) >= task.keys - task.queries and not set(others) & set(ex.answers)
    for key in asked:  # the question names every asked key
        assert key in text[text.rindex("What are all"):], task.name
    for value in ex.answers:  # the needles are whole: the value's tokens in the prompt
        needle = builder._ids(ruler.NEEDLE.format(
            kind=task.value_kind, key=next(k for k in asked if value in by_key[k]), value=value))
        assert _contains(ex.prompt, needle), (task.name, value)


def _check_chain(ex, text):
    """The asked value's chain: its first name takes the value, every next name the one before,
    all of them expected; the distractor chains' names and values are not."""
    assignments = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", text))
    value = re.search(r"the value (\d+) in the text", text).group(1)
    holds = {name for name, what in assignments.items() if what == value}
    while True:
        more = {n for n, what in assignments.items() if what.removeprefix("VAR ") in holds}
        if more <= holds:
            break
        holds |= more
    assert holds == set(ex.answers) and len(holds) == 5
    assert len(assignments) == 25  # five chains of five


def _check_counts(task, ex, text):
    """The expected words are the list's most common (cwe: each strictly more often than any
    other word) or its most frequent (fwe)."""
    words = (re.findall(r"^ ?\d+\. (\w+)$", text, flags=re.M) if task.kind == "cwe"
             else text[text.index("appears.") + len("appears."):text.index("Question")].split())
    counts = Counter(words)
    top = counts.most_common()
    expected = {w for w, _ in top[:task.top]}
    assert expected == set(ex.answers), task.name
    assert top[task.top - 1][1] > top[task.top][1], (task.name, top[:task.top + 1])


def test_a_length_too_short_is_refused_with_the_shortest_that_fits(tokenizer):
    builder = _builder(tokenizer)
    with pytest.raises(ValueError, match=r"niah_multiquery at 60 tokens: .*at least \d+"):
        builder.example(RULER_TASKS["niah_multiquery"], 60, seed=0, index=0)
    with pytest.raises(ValueError, match="give a text source"):
        RulerBuilder(builder.encode).example(RULER_TASKS["niah_single_2"], 700, 0, 0)


def test_the_score_is_the_share_of_expected_strings_generated():
    answers = ("1234567", "7654321", "5555555")
    assert score(" 1234567, 7654321 and 5555555.", answers) == 1.0
    assert score(" the numbers are 1234567 and 7654321", answers) == pytest.approx(2 / 3)
    assert score(" I do not know.", answers) == 0.0
    assert score(" AMBER-FALCON", ("amber-falcon",)) == 1.0  # case folded


SCORED = ["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"]
"""The tasks the wiring test scores: every kind, the haystacks that need no validation data."""


def _ruler_rank(cfg):
    from lctrain.parallel.parallelize import build_model
    from lctrain.parallel.runtime import setup_distributed
    from lctrain.training.evals import Evaluator

    rt = setup_distributed(cfg)
    model = build_model(cfg, rt)
    evaluator = Evaluator(cfg, rt)
    return evaluator.run(model), evaluator.samples


@pytest.mark.slow  # 3 layouts of a random model generating 2 x 5 answers at 700 tokens
def test_the_suite_scores_generations_the_same_on_every_layout(tokenizer, tmp_path):
    """eval.tasks scored on greedy generation (tests/test_generate.py checks the tokens against
    transformers'): on one rank, dp2 and cp2 ring, the same samples (prompts, generated ids)
    and scores, each score the share of its answers in the decoded generation, the means as the
    table says."""
    from lctrain.training.evals import format_table
    from tests.helpers import on_ranks, tiny_config

    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    runs = {}
    for name, par, world in (("one", {"dp": 1}, 1), ("dp2", {"dp": 2}, 2),
                             ("cp2", {"dp": 1, "cp": 2, "attention": "ring"}, 2)):
        runs[name] = (world, tiny_config(
            model={"vocab_size": tokenizer.get_vocab_size()},
            data={"tokenizer": str(path), "source": "synthetic", "add_bos": False,
                  "add_eos": False},
            train={"seq_len": 768, "global_batch": 2, "micro_batch": 1},
            parallel=par, eval={"every": 1, "tasks": SCORED, "lengths": [700], "samples": 2}))
    got = {name: on_ranks(_ruler_rank, world, cfg, timeout_s=300)
           for name, (world, cfg) in runs.items()}
    results, samples = got["one"][0]
    assert [(s["task"], s["length"]) for s in samples] == [
        (t, 700) for t in SCORED for _ in range(2)]
    for name in ("dp2", "cp2"):
        for rank_results, rank_samples in got[name]:
            assert rank_samples == samples and rank_results == results, name
    for s in samples:
        text = tokenizer.decode(s["generated"])
        assert s["score"] == score(text, tuple(s["answers"]))
        assert len(s["prompt"]) == 700 and len(s["generated"]) > 0
    for task in SCORED:
        want = np.mean([s["score"] for s in samples if s["task"] == task])
        assert results[f"eval/ruler/{task}/len700"] == pytest.approx(want)
    lines = format_table(results, SCORED, [700])
    assert lines[0].split() == ["eval", "ruler", "task", "700"] and len(lines) == len(SCORED) + 2


def test_the_suite_is_refused_by_name_where_it_cannot_run(tmp_path):
    """No tokenizer; a text haystack without validation data; a layout generation does not run
    (TP with SP, pipeline stages); the suite's name expands to every task."""
    from lctrain.config.ruler_tasks import ruler_tasks
    from lctrain.config.validation import validate
    from tests.helpers import tiny_config

    assert ruler_tasks(["ruler", "passkey"]) == list(RULER_TASKS)
    assert ruler_tasks(["fwe", "vt"]) == ["vt", "fwe"]
    cfg = tiny_config(eval={"every": 1, "tasks": ["ruler"]},
                      parallel={"tp": 2, "sp": True, "pp": 2, "dp": 1})
    problems = validate(cfg, 4)
    for message in ("set data.tokenizer", "niah_single_2, niah_single_3, niah_multikey_1, "
                    "niah_multivalue, niah_multiquery, whose haystack is held-out text",
                    "parallel.sp=true: generation decodes one token", "parallel.pp=2: generation"):
        assert any(message in p for p in problems), (message, problems)


def test_lengths_too_short_for_a_task_are_refused_before_launch(tokenizer, tmp_path):
    from lctrain.prepare.checks import input_problems
    from tests.helpers import tiny_config

    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    cfg = tiny_config(model={"vocab_size": tokenizer.get_vocab_size()},
                      data={"tokenizer": str(path), "add_bos": False, "add_eos": False},
                      train={"seq_len": 768},
                      eval={"every": 1, "tasks": ["vt", "cwe"], "lengths": [100, 700]})
    problems = input_problems(cfg)
    assert len(problems) == 2 and all("eval.lengths contains 100" in p for p in problems)
    need = RulerBuilder(_builder(tokenizer).encode).min_length(RULER_TASKS["vt"], 0)
    assert f"the vt task needs contexts of at least {need} tokens" in problems[0]
    for i in range(4):  # the bound holds for other draws
        _builder(tokenizer).example(RULER_TASKS["vt"], need, seed=1, index=i)
