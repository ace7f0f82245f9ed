"""The configuration sections about data: the training sequences' source, packing and documents
(data.*), the evals and the validation split (eval.*), and `lctrain preprocess`'s shards
(preprocess.*). Part of `lctrain.config.schema`'s LctrainConfig, read and checked as the other
sections are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lctrain.config.fields import at_least, each_one_of, one_of
from lctrain.config.ruler_tasks import RULER_SUITE, RULER_TASKS


@dataclass
class MixtureEntry:
    source: str = "synthetic"
    """A built-in source (synthetic, passkey, recall) or a directory from `lctrain preprocess`."""
    weight: float = 1.0
    """Share of the sequences drawn from this source (weights are normalised)."""


@dataclass
class LengthBucket:
    max_len: int | None = at_least(1, None)
    """Documents longer than the bucket before's max_len and at most this many tokens; null: no
    bound (the last bucket)."""
    weight: float = 1.0
    """Share of each epoch's tokens taken from this bucket (weights are normalised)."""


@dataclass
class DataConfig:
    source: str = one_of("synthetic", "passkey", "recall", "tokens", "mixture")
    """Where training sequences come from: synthetic (bigram chain whose documents repeat their
    first half) | passkey | recall (long-context retrieval tasks, lctrain.data.tasks) | tokens
    (a directory written by `lctrain preprocess`, at data.path) | mixture (data.mixture)."""
    path: str | None = None
    """source=tokens: the preprocessed directory. `lctrain preprocess`: the corpus to read (file,
    folder, glob such as 'corpus/*.jsonl', or a hub dataset name when online)."""
    mixture: list[MixtureEntry] = field(default_factory=list)
    """source=mixture: the sources and their weights, e.g.
    '[{source: /data/web, weight: 3}, {source: passkey, weight: 1}]'."""
    tokenizer: str | None = None
    """`lctrain preprocess`: tokenizer.json file, a folder holding one, or a hub name (online)."""
    text_field: str = "text"
    """`lctrain preprocess`: the field holding each document's text (json, jsonl, parquet, arrow,
    hub)."""
    format: str = one_of("auto", "jsonl", "json", "text", "parquet", "arrow", "hub")
    """`lctrain preprocess`: auto (from file suffixes; hub when data.path is not local) | jsonl |
    json | text | parquet | arrow | hub."""
    text_unit: str = one_of("document", "paragraph", "line")
    """`lctrain preprocess`, text files: what one document is: document (a whole file) |
    paragraph (blank-line separated) | line."""
    split: str = "train"
    """`lctrain preprocess`, hub datasets: the split to read."""
    add_bos: bool = True
    """`lctrain preprocess`: put the tokenizer's BOS token before every document."""
    add_eos: bool = True
    """`lctrain preprocess`: put the tokenizer's EOS token after every document."""
    bos_token: str | None = None
    """BOS token string; null = from tokenizer_config.json or the usual names (<s>, ...)."""
    eos_token: str | None = None
    """EOS token string; null = from tokenizer_config.json or the usual names (</s>, ...)."""
    strict: bool = False
    """`lctrain preprocess`: fail on the first bad row (malformed JSON, missing or non-string
    text, empty document, invalid UTF-8) instead of skipping and counting it."""
    long_docs: str = one_of("split", "drop")
    """Documents longer than train.seq_len: split (they continue over the next sequences, like
    every document that crosses a sequence border) | drop (skipped, and the count is logged)."""
    length_mix: list[LengthBucket] = field(default_factory=list)
    """source=tokens: each epoch's tokens by document length, e.g. '[{max_len: 4096, weight:
    0.3}, {max_len: 32768, weight: 0.3}, {max_len: null, weight: 0.4}]': a bucket's documents are
    repeated (or capped) to supply its share (lctrain.data.lengths). Empty: as the corpus is."""
    packing: str = one_of("stream", "best_fit")
    """source=tokens: stream (documents concatenated and cut every train.seq_len tokens) |
    best_fit (each document that fits a sequence kept whole in one, longest first into the
    sequence it fills best; the rest padded)."""
    val_fraction: float = at_least(0, 0.0)
    """source=tokens: the share of data.path's documents held out for the validation loss
    (eval.every), by a split seeded with train.seed; they are never trained on."""
    document_masking: bool = False
    """Packed documents do not attend to each other, and RoPE positions restart per document."""
    doc_len_min: int = at_least(1, 32)
    """synthetic, passkey, recall: shortest generated document in tokens."""
    doc_len_max: int = at_least(1, 256)
    """synthetic, passkey, recall: longest generated document in tokens."""
    doc_len_dist: str = one_of("uniform", "loguniform")
    """synthetic, passkey, recall: how document lengths are drawn: uniform | loguniform (as
    many short documents as long ones per octave: short ones teach a task fast, long ones teach
    it over the whole context)."""
    branching: int = at_least(1, 4)
    """synthetic (and the filler text of the tasks): successors each token may have in the
    hidden bigram chain (entropy floor about ln b)."""
    answer_len: int = at_least(1, 1)
    """passkey: tokens in the passkey; recall: tokens in each value."""
    recall_pairs: int = at_least(1, 4)
    """recall: key-value pairs hidden in each document (all are queried at its end)."""


@dataclass
class EvalConfig:
    every: int = at_least(0, 0)
    """Run the retrieval evals every N optimizer steps and after the last one (0 = never)."""
    tasks: list[str] = each_one_of("passkey", "recall", "needle", RULER_SUITE, *RULER_TASKS,
                                   default=("passkey",))
    """Tasks to score: passkey | recall (lctrain.data.tasks: token ids of the built-in data, with
    data.answer_len and data.recall_pairs) | needle (lctrain.data.needle: real held-out text and
    the model's tokenizer, for a pretrained model; needs validation data and data.tokenizer),
    scored on the answer's logits; ruler (every RULER-style task, lctrain.data.ruler) or its
    tasks by name, scored on greedy generation (the share of the expected strings generated),
    with the model's tokenizer (data.tokenizer), the text-haystack tasks on validation data."""
    lengths: list[int] = field(default_factory=list, metadata={"min": 1, "hint": None})
    """Context lengths to score (each <= train.seq_len); empty = [train.seq_len]."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Needle depths as fractions of the context (0 = first token, 1 = just before the query)."""
    samples: int = 8
    """Examples per (task, length, depth) cell."""
    needle_keys: int = at_least(1, 1)
    """needle: needles with different keys per example, one asked (RULER's multi-key)."""
    needle_values: int = at_least(1, 1)
    """needle: values of the asked key, all asked for in text order (RULER's multi-value)."""
    val_data: str | None = None
    """A directory from `lctrain preprocess` whose validation loss (val_loss, val_ppl) is
    computed every eval.every steps (or hold documents out with data.val_fraction)."""
    val_sequences: int = at_least(1, 16)
    """Sequences of train.seq_len in the validation loss (a multiple of micro_batch x dp)."""
    position_band: int | None = at_least(0, None)
    """Validation loss by position: the first band's width in tokens, the bands doubling from it
    up to train.seq_len ([0, b), [b, 2b), [2b, 4b), ...), logged as val_loss/pos<lo>-<hi>. A
    token's position is its RoPE position (inside its document with data.document_masking).
    null: 1024, or 64 below a 2048-token sequence; 0: one number only."""


@dataclass
class PreprocessConfig:
    output: str | None = None
    """Directory to write (token shards, document index, meta.json); required."""
    workers: int = at_least(0, 0)
    """Tokenizer processes; 0 = one per CPU core."""
    dtype: str = one_of("auto", "uint16", "uint32")
    """Token dtype: auto (uint16 when the vocabulary fits, else uint32) | uint16 | uint32."""
    shard_tokens: int = at_least(1, 268435456, hint="preprocess.shard_tokens=268435456")
    """Tokens per shard file before the next one starts (at a document border)."""
    batch_rows: int = at_least(1, 512, hint="preprocess.batch_rows=512")
    """Rows sent to a worker at a time."""
    overwrite: bool = False
    """Replace an existing output directory (only once the new one is complete)."""
