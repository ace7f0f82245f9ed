"""The tokenizer `lctrain preprocess` encodes with: data.tokenizer (a tokenizer.json file, a
folder holding one, or a hub model name) read into `TokenizerInfo`, plain data that the
tokenizer workers rebuild the tokenizer from, with the BOS and EOS tokens data.add_bos /
data.add_eos need (data.bos_token / data.eos_token, else tokenizer_config.json, else the usual
names). A setting that does not fit the tokenizer is a `TokenizerMismatch`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from lctrain.config import DataConfig
from lctrain.data.inputs import hub_offline, looks_like_hub

BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>")
EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class TokenizerMismatch(ValueError):
    """A data.* or preprocess.* setting that does not fit the tokenizer (a configuration error)."""


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
    if not looks_like_hub(spec) or hub_offline():
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
