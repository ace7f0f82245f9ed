"""Corpus ingestion for `lctrain preprocess`: stream the rows of the inputs and check each row.
The inputs come from lctrain.data.inputs (`resolve_inputs`), the tokenizer from
lctrain.data.tokenizer (`load_tokenizer`); both are re-exported here.

`iter_rows` streams inputs as rows `(kind, prefix, n, payload)`: the location of a row
is `f"{prefix}{n}"` (`path:LINE`, 1-based, for line formats; `path:row N` or `NAME[split]:row N`,
0-based as `dataset[N]`, for JSON arrays and datasets). Rows stay raw bytes where that is
possible, so that decoding and parsing (`check_row`) run in the tokenizer workers. JSON lines
and text are read by our own line reader: `datasets` aborts a whole file on one malformed line
or one invalid UTF-8 byte, and such rows must be skipped and counted instead. Parquet, Arrow,
`save_to_disk` folders and hub datasets stream through `datasets`, so nothing is read whole.

Text files (data.text_unit): `document` is the whole file, verbatim; `paragraph` is a run of
non-blank lines joined with "\\n" (lines with only whitespace separate paragraphs); `line` is
one line without its line ending (a blank line is an `empty` row).
"""

from __future__ import annotations

import codecs
import gzip
import json
from collections.abc import Iterator
from typing import IO

from lctrain.config import DataConfig
from lctrain.data.inputs import EXPECTED, SUFFIX_FORMATS, Input, hub_offline, resolve_inputs
from lctrain.data.tokenizer import (
    BOS_NAMES,
    EOS_NAMES,
    TokenizerInfo,
    TokenizerMismatch,
    load_tokenizer,
)

__all__ = [  # with the names of inputs and tokenizer, which the data modules import from here
    "BAD", "BOS_NAMES", "EOS_NAMES", "EXPECTED", "JSON_LINE", "RECORD", "SKIP_REASONS",
    "SUFFIX_FORMATS", "TEXT", "DataError", "Input", "Row", "TokenizerInfo", "TokenizerMismatch",
    "check_row", "hub_offline", "iter_rows", "load_tokenizer", "resolve_inputs",
]

SKIP_REASONS = ("malformed_json", "missing_field", "not_a_string", "empty", "invalid_utf8",
                "no_tokens")
"""Why a row is skipped; `no_tokens` (text that tokenizes to nothing, with neither BOS nor EOS
added) is decided after tokenization."""

# Row kinds: what the payload of a row is.
JSON_LINE = "json_line"  # bytes of one JSON lines line
TEXT = "text"            # bytes of one text document
RECORD = "record"        # a parsed object (JSON array element, dataset row)
BAD = "bad"              # (reason, detail) decided while reading

Row = tuple[str, str, int, object]


class DataError(ValueError):
    """Bad input data: a bad row with data.strict=true, or no valid document at all."""


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its ending); a UTF-8 BOM on line 1 is dropped."""
    with _open(path) as f:
        for n, line in enumerate(f, start=1):
            if n == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            yield n, line.rstrip(b"\r\n")


def _text_rows(path: str, unit: str) -> Iterator[Row]:
    prefix = f"{path}:"
    if unit == "document":
        with _open(path) as f:
            data = f.read()
        yield TEXT, prefix, 1, data.removeprefix(codecs.BOM_UTF8)
    elif unit == "line":
        for n, line in _lines(path):
            yield TEXT, prefix, n, line
    else:
        start, para = 0, []
        for n, line in _lines(path):
            if line.strip():
                start = start if para else n
                para.append(line)
            elif para:
                yield TEXT, prefix, start, b"\n".join(para)
                para = []
        if para:
            yield TEXT, prefix, start, b"\n".join(para)


def _first_byte(path: str) -> bytes:
    """The first non-whitespace byte of a file (after a BOM), or b''."""
    with _open(path) as f:
        chunk = f.read(4096).removeprefix(codecs.BOM_UTF8)
        while chunk and not chunk.strip():
            chunk = f.read(4096)
        return chunk.strip()[:1]


def _json_rows(path: str) -> Iterator[Row]:
    """A JSON array of objects (whole file, one unit) or else JSON lines."""
    if _first_byte(path) != b"[":
        yield from ((JSON_LINE, f"{path}:", n, line) for n, line in _lines(path))
        return
    with _open(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        yield BAD, f"{path}:", raw.count(b"\n", 0, e.start) + 1, ("invalid_utf8", str(e))
        return
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        yield BAD, f"{path}:", e.lineno, ("malformed_json", f"{e.msg}, column {e.colno}")
        return
    yield from ((RECORD, f"{path}:row ", i, item) for i, item in enumerate(items))


def _dataset_rows(ds, prefix: str, text_field: str) -> Iterator[Row]:
    """Rows of a `datasets` IterableDataset, reduced to the text field."""
    names = ds.column_names
    if names and text_field in names and len(names) > 1:
        ds = ds.select_columns([text_field])
    for i, row in enumerate(ds):
        if text_field in row:
            yield RECORD, prefix, i, {text_field: row[text_field]}
        else:
            yield BAD, prefix, i, ("missing_field", f"no {text_field!r} column; columns: "
                                   f"{', '.join(map(str, row))}; set data.text_field")


def _streamed(item: Input, split: str):
    """An IterableDataset over one parquet/arrow file, save_to_disk folder or hub dataset."""
    try:
        import datasets  # lazy: only parquet, arrow, save_to_disk and hub inputs
    except ImportError as e:
        raise ImportError(f"reading {item.path} ({item.kind}) needs the datasets package: "
                          "pip install datasets") from e

    if item.kind in ("parquet", "arrow"):
        return datasets.load_dataset(item.kind, data_files=[item.path], split="train",
                                     streaming=True)
    if item.kind == "hub":
        return datasets.load_dataset(item.path, split=split, streaming=True)
    saved = datasets.load_from_disk(item.path)
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ValueError(f"{item.path} has the splits {', '.join(saved)}, not "
                             f"data.split={split!r}; set data.split to one of them")
        saved = saved[split]
    return saved.to_iterable_dataset()


def iter_rows(inputs: list[Input], data: DataConfig) -> Iterator[Row]:
    """Every row of every input, in order, as `(kind, prefix, n, payload)`."""
    for item in inputs:
        if item.kind == "jsonl":
            yield from ((JSON_LINE, f"{item.path}:", n, line) for n, line in _lines(item.path))
        elif item.kind == "json":
            yield from _json_rows(item.path)
        elif item.kind == "text":
            yield from _text_rows(item.path, data.text_unit)
        else:
            name = f"{item.path}[{data.split}]" if item.kind == "hub" else item.path
            yield from _dataset_rows(_streamed(item, data.split), f"{name}:row ", data.text_field)


def _checked_text(text: str) -> tuple[str | None, str, str]:
    if not text.strip():
        return None, "empty", "the text is empty or only whitespace"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON \\ud800 escape
            return None, "invalid_utf8", str(e)
    return text, "", ""


def check_row(kind: str, payload: object, text_field: str) -> tuple[str | None, str, str]:
    """(text, "", "") for a good row, else (None, reason, detail) with a reason of SKIP_REASONS."""
    if kind == BAD:
        reason, detail = payload
        return None, reason, detail
    if kind in (JSON_LINE, TEXT):
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, "invalid_utf8", str(e)
        if kind == TEXT:
            return _checked_text(text)
        if not text.strip():
            return None, "empty", "blank line"
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as e:
            return None, "malformed_json", f"{e.msg}, column {e.colno}"
    if not isinstance(payload, dict):
        return None, "malformed_json", f"a JSON {type(payload).__name__}, not an object"
    if text_field not in payload:
        keys = ", ".join(map(str, list(payload)[:8])) or "none"
        return None, "missing_field", f"no {text_field!r} key (keys: {keys}); set data.text_field"
    value = payload[text_field]
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, "invalid_utf8", str(e)
    if not isinstance(value, str):
        return None, "not_a_string", f"{text_field!r} is {type(value).__name__}, not a string"
    return _checked_text(value)
