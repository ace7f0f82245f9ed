"""Corpus ingestion for `lctrain preprocess`: find the inputs, stream their rows, check each row,
and load the tokenizer.

`resolve_inputs` turns data.path (a file, a folder, a glob, or a hub dataset name) into
`Input`s. `iter_rows` streams them as rows `(kind, prefix, n, payload)`: the location of a row
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
import glob
import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lctrain.config import DataConfig

SKIP_REASONS = ("malformed_json", "missing_field", "not_a_string", "empty", "invalid_utf8",
                "no_tokens")
"""Why a row is skipped; `no_tokens` (text that tokenizes to nothing, with neither BOS nor EOS
added) is decided after tokenization."""
SUFFIX_FORMATS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "json", ".json.gz": "json",
                  ".txt": "text", ".txt.gz": "text", ".md": "text", ".parquet": "parquet",
                  ".arrow": "arrow"}
EXPECTED = (f"files ending in {', '.join(SUFFIX_FORMATS)}, or a folder written by "
            "datasets' save_to_disk")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")

# Row kinds: what the payload of a row is.
JSON_LINE = "json_line"  # bytes of one JSON lines line
TEXT = "text"            # bytes of one text document
RECORD = "record"        # a parsed object (JSON array element, dataset row)
BAD = "bad"              # (reason, detail) decided while reading

Row = tuple[str, str, int, object]


class DataError(ValueError):
    """Bad input data: a bad row with data.strict=true, or no valid document at all."""


class TokenizerMismatch(ValueError):
    """A data.* or preprocess.* setting that does not fit the tokenizer (a configuration error)."""


@dataclass(frozen=True)
class Input:
    kind: str
    """jsonl | json | text | parquet | arrow | disk (a save_to_disk folder) | hub."""
    path: str
    """File or folder path, or the hub dataset name."""


def hub_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
               for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _looks_like_hub(spec: str) -> bool:
    """`name` or `owner/name`, and no file suffix we would read."""
    return (re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None and not spec.startswith(".")
            and _suffix_format(spec) is None)


def _suffix_format(name: str) -> str | None:
    name = name.lower()
    return next((fmt for suffix, fmt in SUFFIX_FORMATS.items() if name.endswith(suffix)), None)


def _is_saved_dataset(folder: Path) -> bool:
    return ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()) or (
        folder / "dataset_dict.json").is_file()


def _is_token_dataset(folder: Path) -> bool:
    """An `lctrain preprocess` output: never corpus input."""
    return (folder / "meta.json").is_file() and (folder / "docs-00000.npy").is_file()


def _saved_root(path: Path) -> Path | None:
    """The save_to_disk folder that is `path` or holds it directly."""
    return next((d for d in (path, path.parent) if d.is_dir() and _is_saved_dataset(d)), None)


def _file_input(path: Path, forced: str) -> Input | None:
    """The input a file is read as (None: not a file we read)."""
    kind = forced if forced not in ("auto", "hub") else _suffix_format(path.name)
    return None if kind is None else Input(kind, str(path))


def _from_glob(pattern: str, forced: str) -> list[Input]:
    """Files matched by a glob ('**' recursive), sorted by path; a save_to_disk folder is one
    input, and an `lctrain preprocess` output is none."""
    found: dict[str, Input] = {}
    for match in glob.glob(os.path.expanduser(pattern), recursive=True):
        path = Path(match)
        root = _saved_root(path) if forced in ("auto", "arrow") else None
        if root is not None:  # its folders and .arrow files stand for it, its .json files not
            if path.is_dir() or path.suffix == ".arrow":
                found[str(root)] = Input("disk", str(root))
        elif path.is_file() and not _is_token_dataset(path.parent) and (
                i := _file_input(path, forced)) is not None:
            found[i.path] = i
    saved = [Path(i.path) for i in found.values() if i.kind == "disk"]
    return sorted((i for i in found.values()  # a DatasetDict's splits go with it
                   if not any(s in Path(i.path).parents for s in saved)), key=lambda i: i.path)


def resolve_inputs(data: DataConfig) -> list[Input]:
    """The inputs data.path names, in reading order; ValueError if it names nothing readable."""
    spec, forced = data.path, data.format
    if forced == "hub":
        return [_hub_input(spec)]
    path = Path(spec).expanduser()
    if path.is_dir() and _is_token_dataset(path):
        raise ValueError(f"data.path={spec!r} is already a preprocessed token dataset; train on it "
                         f"with data.source=tokens data.path={spec}")
    if path.is_dir():  # hidden names are skipped, as by any glob
        inputs = _from_glob(os.path.join(glob.escape(str(path)), "**"), forced)
    elif path.is_file():
        inputs = [i] if (i := _file_input(path, forced)) else []
    elif glob.has_magic(spec):
        inputs = _from_glob(spec, forced)
    elif forced == "auto" and _looks_like_hub(spec):
        return [_hub_input(spec)]
    else:
        raise ValueError(f"data.path={spec!r} does not exist; give a file, a folder, a glob such "
                         "as 'corpus/*.jsonl' or a hub dataset name")
    if not inputs:
        raise ValueError(f"data.path={spec!r} has nothing to read; expected {EXPECTED} (or set "
                         "data.format to read other files as jsonl, json or text)")
    return inputs


def _hub_input(spec: str) -> Input:
    if hub_offline():
        raise ValueError(f"data.path={spec!r} does not exist locally and the Hugging Face hub is "
                         "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); point data.path at a "
                         "local file, folder or glob, or go online to read the hub dataset")
    return Input("hub", spec)


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


@dataclass(frozen=True)
class TokenizerInfo:
    """What preprocessing needs of a tokenizer, as plain data (workers rebuild it from `json`)."""

    spec: str
    json: str = field(repr=False)
    """The tokenizer.json text."""
    sha256: str
    vocab_sha256: str
    """sha256 of the (token, id) pairs: the same vocabulary whatever the file's formatting."""
    vocab_size: int
    bos_token: str | None
    bos_id: int | None
    """Put before every document; None when data.add_bos=false."""
    eos_token: str | None
    eos_id: int | None


def _token_string(value: object) -> str | None:
    """A tokenizer_config.json special token: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tokenizer_files(spec: str) -> tuple[Path, dict]:
    """tokenizer.json and the tokenizer_config.json beside it ({} if none)."""
    path = Path(spec).expanduser()
    convert = (f"data.tokenizer={spec!r} is a sentencepiece model; convert it to tokenizer.json "
               "(transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) and point "
               "data.tokenizer at it")
    if path.is_file():
        if path.suffix == ".model":
            raise ValueError(convert)
        return path, {}
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            if (path / "tokenizer.model").is_file():
                raise ValueError(convert)
            raise ValueError(f"data.tokenizer={spec!r} is a folder without tokenizer.json")
        return path / "tokenizer.json", _read_json(path / "tokenizer_config.json")
    if not _looks_like_hub(spec) or hub_offline():
        raise ValueError(f"data.tokenizer={spec!r} does not exist locally"
                         + (" and the Hugging Face hub is offline" if hub_offline() else "")
                         + "; give a tokenizer.json file or a folder holding one")
    return _hub_tokenizer_files(spec)


def _hub_tokenizer_files(name: str) -> tuple[Path, dict]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        file = Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as e:  # any hub failure is one message
        raise ValueError(f"data.tokenizer={name!r}: cannot fetch tokenizer.json from the hub "
                         f"({type(e).__name__}: {e})") from e
    try:
        config = _read_json(Path(hf_hub_download(name, "tokenizer_config.json")))
    except EntryNotFoundError:
        config = {}
    return file, config


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    return value if isinstance(value, dict) else {}


def _special(tok, which: str, explicit: str | None, config: dict, names: tuple[str, ...],
             spec: str) -> tuple[str, int]:
    """The BOS or EOS token and id: data.<which>_token, tokenizer_config.json, the usual names."""
    key = f"data.{which}_token"
    if explicit is not None:
        tid = tok.token_to_id(explicit)
        if tid is None:
            raise TokenizerMismatch(f"{key}={explicit!r} is not in the vocabulary of "
                                    f"data.tokenizer={spec!r}; pick a token it has")
        return explicit, tid
    for name in (_token_string(config.get(f"{which}_token")), *names):
        if name is not None and (tid := tok.token_to_id(name)) is not None:
            return name, tid
    raise TokenizerMismatch(f"data.add_{which}=true but data.tokenizer={spec!r} has no "
                            f"{which.upper()} token (tokenizer_config.json names none, and none "
                            f"of {', '.join(names)} is in the vocabulary); set {key}=TOKEN or "
                            f"data.add_{which}=false")


def load_tokenizer(data: DataConfig) -> TokenizerInfo:
    """Read data.tokenizer and resolve the BOS/EOS tokens that data.add_bos/add_eos need."""
    from tokenizers import Tokenizer

    file, config = _tokenizer_files(data.tokenizer)
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"data.tokenizer={data.tokenizer!r}: {file} is not a readable "
                         f"tokenizer.json ({e})") from e
    bos = (_special(tok, "bos", data.bos_token, config, BOS_NAMES, data.tokenizer)
           if data.add_bos else (None, None))
    eos = (_special(tok, "eos", data.eos_token, config, EOS_NAMES, data.tokenizer)
           if data.add_eos else (None, None))
    vocab = json.dumps(sorted(tok.get_vocab(with_added_tokens=True).items())).encode()
    return TokenizerInfo(spec=data.tokenizer, json=text, sha256=hashlib.sha256(raw).hexdigest(),
                         vocab_sha256=hashlib.sha256(vocab).hexdigest(),
                         vocab_size=tok.get_vocab_size(with_added_tokens=True),
                         bos_token=bos[0], bos_id=bos[1], eos_token=eos[0], eos_id=eos[1])
