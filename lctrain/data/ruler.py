"""RULER-style long-context tasks, generated offline and deterministically by seed, as raw
completions for base models, each prompt exactly the target length in the model's tokens, and
their scoring on generated text: what users of context extension judge a model by (RULER's
task definitions, in lctrain's own wording and templates).

Every task builds its prompt from pieces encoded one by one with the model's tokenizer (`encode`:
text -> token ids), so the lengths add up exactly: a head (what to memorise), the context (a
haystack with the task's statements inserted at token boundaries), the question and the
answer's lead-in. The context takes exactly the tokens the other pieces leave (`room`); a
haystack is cut at a token boundary to fit, and nothing of the task's own statements is ever
cut. A length too short for the statements is refused with the shortest that fits.

The tasks (`RULER_TASKS`, the `ruler` suite in order):
- needles (`niah_*`): sentences "the special magic {value kind} for {key} is: {value}." in a
  haystack of noise sentences, of text, or of other needles; one asked key, its value(s)
  expected. Single (a number in noise; a number or a UUID in text), multi-key (distractor
  needles with other keys in text, in a haystack of needles with numbers or with UUID keys and
  values), multi-value (four values of the asked key, all expected), multi-query (four keys
  asked, all values expected).
- variable tracking (`vt`): "VAR X = 12345." then a chain of "VAR Y = VAR X." assignments
  spread through noise, with distractor chains of other values; every name of the asked
  value's chain expected.
- common words (`cwe`): a numbered list of words, ten of them three times each, every other
  word once (as many as the length holds); the ten expected.
- frequent words (`fwe`): coded words with Zipf counts (as many as the length holds, the top
  ones strictly ahead of the next); the three most frequent expected.

Scoring (`score`): the share of the expected strings present in the generated text (case
folded), RULER's metric for these tasks; an answer's strings are distinct and no distractor
contains one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lctrain.config import LctrainConfig
from lctrain.config.ruler_tasks import RULER_TASKS, RulerTask, ruler_tasks
from lctrain.data.tokenizer import load_tokenizer

Encode = Callable[[str], np.ndarray]
"""A tokenizer's text -> token ids (int64), without special tokens."""
TextSource = Callable[[np.random.Generator, int], np.ndarray]
"""(rng, n) -> n token ids of real text (the run's corpus, a file, the built-in text)."""

NOISE = " The hills are quiet. The lake is still. The road goes on. Day follows night."
"""The noise haystack's sentences, repeated."""
HEAD = {"number": "A few special magic numbers are hidden in the text below. Remember them: "
                  "you will be asked about them at the end.\n",
        "uuid": "A few special magic uuids are hidden in the text below. Remember them: you "
                "will be asked about them at the end.\n"}
NEEDLE = " One of the special magic {kind}s for {key} is: {value}."
QUESTION = ("\nWhat are all the special magic {kind}s for {keys} mentioned in the text above? "
            "The special magic {kind}s for {keys} mentioned in the text above are")
VT_HEAD = ("Remember the variable assignments in the text below: you will be asked to follow "
           "them at the end.\n")
VT_FIRST = " VAR {name} = {value}."
VT_NEXT = " VAR {name} = VAR {previous}."
VT_QUESTION = ("\nQuestion: find every variable that is assigned the value {value} in the text "
               "above. Answer: following the assignments, the variables that hold {value} are")
CWE_HEAD = "Below is a numbered list of words; some of them appear many times.\n"
CWE_ITEM = "{i}. {word}\n"
CWE_QUESTION = ("Question: which are the {n} most common words in the list above? Answer: the "
                "{n} most common words in the list are")
FWE_HEAD = ("Read the coded text below and count how often each coded word appears.\n")
FWE_QUESTION = ("\nQuestion: which are the {n} most frequent coded words in the text above? "
                "Answer: the {n} most frequent coded words are")

KEYS = ("amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
        "juniper", "kestrel", "lantern", "meadow", "nickel", "orchid", "pebble", "quartz",
        "raven", "saffron", "thistle", "umber", "violet", "willow", "yarrow", "zephyr")
"""The needles' word keys (distinct words)."""
_ONSETS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def pseudo_word(index: int, syllables: int = 3) -> str:
    """A pronounceable lowercase word of `syllables` consonant-vowel pairs, distinct for each
    index below 70 ** syllables (the word lists of cwe and fwe, any size)."""
    out = []
    for _ in range(syllables):
        index, at = divmod(index, len(_ONSETS) * len(_VOWELS))
        out.append(_ONSETS[at // len(_VOWELS)] + _VOWELS[at % len(_VOWELS)])
    return "".join(out)


@dataclass(frozen=True)
class Example:
    """One prompt of a task: exactly `length` token ids; the strings a correct generation
    contains, and how many tokens to generate for them."""

    task: str
    length: int
    prompt: np.ndarray
    answers: tuple[str, ...]
    answer_tokens: int


def _uuid(rng: np.random.Generator) -> str:
    digits = "".join(f"{int(d):x}" for d in rng.integers(0, 16, 32))
    return "-".join((digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]))


class RulerBuilder:
    """Examples of the RULER tasks for one tokenizer (`encode`) and text source (`text`: None
    when no task asks for a text haystack)."""

    def __init__(self, encode: Encode, text: TextSource | None = None):
        self.encode, self.text = encode, text

    def _ids(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def _noise(self, n: int) -> np.ndarray:
        unit = self._ids(NOISE)
        return np.tile(unit, -(-n // len(unit)))[:n] if n else unit[:0]

    def _key(self, task: RulerTask, rng: np.random.Generator, exclude) -> str:
        if task.key_kind == "uuid":
            return _uuid(rng)
        choices = [k for k in KEYS if k not in exclude]
        return str(rng.choice(choices))

    def _value(self, task: RulerTask, rng: np.random.Generator) -> str:
        if task.value_kind == "uuid":
            return _uuid(rng)
        return str(int(rng.integers(1_000_000, 10_000_000)))

    def _parts(self, task: RulerTask, rng: np.random.Generator, length: int) -> _Parts:
        """The example's pieces besides its haystack, by the task's kind."""
        build = {"niah": self._niah, "vt": self._vt, "cwe": self._cwe, "fwe": self._fwe}
        return build[task.kind](task, rng, length)

    def min_length(self, task: RulerTask, seed: int, tries: int = 16) -> int:
        """Tokens of the head, the statements (the shortest word list) and the question of
        `tries` examples' draws, the longest, plus a margin of 16 for other draws' keys and
        values: the shortest length to ask for."""
        longest = 0
        for i in range(tries):
            parts = self._parts(task, np.random.default_rng([seed, 0x313, i]), 0)
            longest = max(longest, len(parts.head) + len(parts.tail)
                          + sum(map(len, parts.statements)))
        return longest + 16

    def example(self, task: RulerTask, length: int, seed: int, index: int) -> Example:
        """Example `index` of `task` at `length` tokens (a function of seed, task, length and
        index)."""
        tag = sum(map(ord, task.name))
        rng = np.random.default_rng([seed, 0x5A1E, tag, length, index])
        parts = self._parts(task, rng, length)
        room = (length - len(parts.head) - len(parts.tail)
                - sum(map(len, parts.statements)))
        if room < 0:
            raise ValueError(f"task {task.name} at {length} tokens: its statements and question "
                             f"alone take {length - room}; use lengths of at least "
                             f"{length - room} (eval.lengths)")
        if parts.listed:  # the word list is the context; noise before it to the exact length
            context = np.concatenate([self._noise(room), *parts.statements])
        else:
            haystack = self._haystack(task, rng, room, parts.keys)
            context = self._insert(haystack, parts.statements, parts.depths)
        prompt = np.concatenate([parts.head, context, parts.tail])
        assert len(prompt) == length, (task.name, len(prompt), length)
        answer_tokens = sum(len(self._ids(" " + a)) + 1 for a in parts.answers) + 2
        return Example(task.name, length, prompt, tuple(parts.answers), answer_tokens)

    def _haystack(self, task: RulerTask, rng: np.random.Generator, n: int,
                  asked: list[str]) -> np.ndarray:
        """n tokens of the task's haystack; a haystack of needles never names an asked key."""
        if task.haystack == "text":
            if self.text is None:
                raise ValueError(f"task {task.name} fills its context with text: give a text "
                                 "source (the run's corpus, a file or the built-in text)")
            return np.asarray(self.text(rng, n), dtype=np.int64)[:n]
        if task.haystack == "needles":  # other keys' needles, then noise to the exact length
            pieces, used = [], 0
            while True:
                needle = self._ids(NEEDLE.format(kind=task.value_kind,
                                                 key=self._key(task, rng, exclude=asked),
                                                 value=self._value(task, rng)))
                if used + len(needle) > n:
                    break
                pieces.append(needle)
                used += len(needle)
            return np.concatenate([*pieces, self._noise(n - used)])
        return self._noise(n)

    @staticmethod
    def _insert(haystack: np.ndarray, statements: list[np.ndarray],
                depths: list[float]) -> np.ndarray:
        """The statements at their depths (shares of the haystack) in order of depth, at token
        boundaries; equal depths keep the statements' order."""
        cuts = [round(d * len(haystack)) for d in depths]
        order = sorted(range(len(statements)), key=lambda j: (cuts[j], j))
        pieces, prev = [], 0
        for j in order:
            pieces += [haystack[prev:cuts[j]], statements[j]]
            prev = cuts[j]
        return np.concatenate([*pieces, haystack[prev:]])

    def _niah(self, task: RulerTask, rng: np.random.Generator, length: int) -> _Parts:
        keys: list[str] = []
        for _ in range(task.keys):
            keys.append(self._key(task, rng, exclude=keys))
        values = {key: [self._value(task, rng) for _ in range(task.values)] for key in keys}
        statements = [self._ids(NEEDLE.format(kind=task.value_kind, key=key, value=value))
                      for key in keys for value in values[key]]
        asked = keys[:task.queries]
        names = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
        return _Parts(self._ids(HEAD[task.value_kind]), statements,
                      self._ids(QUESTION.format(kind=task.value_kind, keys=names)),
                      [v for key in asked for v in values[key]],
                      list(rng.uniform(0, 1, len(statements))), keys)

    def _vt(self, task: RulerTask, rng: np.random.Generator, length: int) -> _Parts:
        names = iter(pseudo_word(int(i)).upper()
                     for i in rng.permutation(70 ** 3)[:task.keys * (task.hops + 1)])
        chains: list[tuple[str, list[str]]] = []
        for _ in range(task.keys):  # the first chain is asked, the others distract
            value = self._value(task, rng)
            while value in [v for v, _ in chains]:
                value = self._value(task, rng)
            chains.append((value, [next(names) for _ in range(task.hops + 1)]))
        statements, depths = [], []
        for value, chain in chains:  # each chain's assignments in order through the context
            statements.append(self._ids(VT_FIRST.format(name=chain[0], value=value)))
            statements += [self._ids(VT_NEXT.format(name=n, previous=p))
                           for p, n in zip(chain, chain[1:])]
            depths += sorted(rng.uniform(0, 1, len(chain)))
        value, chain = chains[0]
        return _Parts(self._ids(VT_HEAD), statements,
                      self._ids(VT_QUESTION.format(value=value)), chain, depths)

    def _listed(self, head: np.ndarray, tail: np.ndarray, length: int,
                occurrences: Callable[[int], list[str]], item: Callable[[int, str], str],
                most: int) -> list[np.ndarray]:
        """The items of a word list of the most words that fit the length: `occurrences(n)` the
        shuffled words of a list with n filler words (more as n grows, up to `most`), item(i,
        word) its i-th entry's text."""
        budget = length - len(head) - len(tail)

        def encoded(n: int) -> list[np.ndarray]:
            return [self._ids(item(i, w)) for i, w in enumerate(occurrences(n))]

        fits = 0
        while 2 * fits + 1 <= most and sum(map(len, encoded(2 * fits + 1))) <= budget:
            fits = 2 * fits + 1
        low, high = fits, 2 * fits + 1  # the most filler words that fit, by bisection
        while high - low > 1:
            middle = (low + high) // 2
            low, high = ((middle, high) if sum(map(len, encoded(middle))) <= budget
                         else (low, middle))
        return encoded(low)

    def _cwe(self, task: RulerTask, rng: np.random.Generator, length: int) -> _Parts:
        pool = rng.permutation(70 ** 3)
        common = [pseudo_word(int(i)) for i in pool[:task.top]]
        order = np.random.default_rng(rng.integers(2 ** 63))

        def occurrences(n: int) -> list[str]:  # common words 3 times each, n others once
            items = [w for w in common for _ in range(3)] + [
                pseudo_word(int(i)) for i in pool[task.top:task.top + n]]
            return [items[i] for i in order.permutation(len(items))]

        head, tail = self._ids(CWE_HEAD), self._ids(CWE_QUESTION.format(n=task.top))
        statements = self._listed(head, tail, length, occurrences,
                                  lambda i, w: CWE_ITEM.format(i=i + 1, word=w),
                                  len(pool) - task.top)
        return _Parts(head, statements, tail, common, listed=True)

    def _fwe(self, task: RulerTask, rng: np.random.Generator, length: int) -> _Parts:
        words = [pseudo_word(int(i), 2) for i in rng.permutation(70 ** 2)[:50]]
        order = np.random.default_rng(rng.integers(2 ** 63))

        def occurrences(n: int) -> list[str]:  # Zipf counts, the top ones strictly ahead
            counts = [int((n + 4) / (rank + 1) ** 1.5) for rank in range(len(words))]
            for rank in range(task.top - 1, -1, -1):
                counts[rank] = max(counts[rank], counts[rank + 1] + 1)
            items = [w for w, c in zip(words, counts) for _ in range(c)]
            return [items[i] for i in order.permutation(len(items))]

        head, tail = self._ids(FWE_HEAD), self._ids(FWE_QUESTION.format(n=task.top))
        statements = self._listed(head, tail, length, occurrences, lambda i, w: " " + w,
                                  most=2 ** 40)
        return _Parts(head, statements, tail, words[:task.top], listed=True)


@dataclass
class _Parts:
    """What a task's example is made of besides its haystack."""

    head: np.ndarray
    statements: list[np.ndarray]
    tail: np.ndarray
    answers: list[str]
    depths: list[float] | None = None
    keys: list[str] | None = None
    listed: bool = False
    """The statements are the whole context (a word list), not inserted in a haystack."""


def score(generated: str, answers: tuple[str, ...]) -> float:
    """The share of `answers` present in `generated` (case folded): RULER's string match over
    all expected strings."""
    text = generated.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def ruler_problems(cfg: LctrainConfig) -> list[str]:
    """eval.lengths too short for a RULER-style task of eval.tasks (its statements and question
    in the model's tokens), and a tokenizer that cannot be read."""
    from tokenizers import Tokenizer  # lazy: only runs that score these tasks need it

    try:
        tokenizer = Tokenizer.from_str(load_tokenizer(cfg.data).json)
    except (ValueError, OSError) as e:
        return [f"eval.tasks has RULER-style tasks: {e}"]
    builder = RulerBuilder(lambda text: np.array(
        tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64))
    problems = []
    for name in ruler_tasks(cfg.eval.tasks):
        need = builder.min_length(RULER_TASKS[name], cfg.train.seed)
        problems += [f"eval.lengths contains {n}; the {name} task needs contexts of at least "
                     f"{need} tokens (its statements and question, in the model's tokens)"
                     for n in cfg.eval.lengths or [cfg.train.seq_len] if n < need]
    return problems
