"""`lctrain preprocess`: every input format round-trips to the tokens a tokenizer gives directly,
bad rows are skipped and counted (or stop a strict run), and the output is byte-identical for
any worker count. Offline: tiny tokenizers are trained here."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tests train and fork

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from lctrain.config import LctrainConfig  # noqa: E402
from lctrain.data.ingest import DataError  # noqa: E402
from lctrain.data.inputs import resolve_inputs  # noqa: E402
from lctrain.data.preprocess import preprocess, validate_preprocess  # noqa: E402
from lctrain.data.shards import TokenStore  # noqa: E402
from lctrain.data.tokenizer import TokenizerMismatch, load_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "once upon a time there was",
             "café naïve über straße", "long context models read many tokens", "alpha beta gamma",
             "delta epsilon zeta", "good one good two fine", "the\nmat\n\npark"]
WORDS = " ".join(SENTENCES).split()


def train_tokenizer(specials: list[str]) -> Tokenizer:
    """A small BPE that keeps spaces and newlines apart; characters it never saw give no ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> tuple[Tokenizer, Path]:
    tokenizer = train_tokenizer(["<s>", "</s>"])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return tokenizer, path


def make_cfg(path, tokenizer, output, **keys) -> LctrainConfig:
    """A preprocess config; `keys` are data.* or preprocess.* fields by name."""
    cfg = LctrainConfig()
    cfg.data.path, cfg.data.tokenizer = str(path), str(tokenizer)
    cfg.preprocess.output, cfg.preprocess.workers = str(output), 1
    for key, value in keys.items():
        setattr(cfg.preprocess if hasattr(cfg.preprocess, key) else cfg.data, key, value)
    return cfg


def expected(tokenizer: Tokenizer, texts: list[str], bos=True, eos=True) -> list[list[int]]:
    head = [tokenizer.token_to_id("<s>")] if bos else []
    tail = [tokenizer.token_to_id("</s>")] if eos else []
    return [head + tokenizer.encode(t, add_special_tokens=False).ids + tail for t in texts]


def documents(path) -> list[list[int]]:
    store = TokenStore(path)
    return [store.read(i, 0, int(n)).tolist() for i, n in enumerate(store.doc_lengths)]


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))


def save_dataset(path: Path, texts: list[str]) -> None:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(path)


def all_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_every_format_round_trips(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer, tok_path = tok
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    parts = {  # file -> texts, in path order
        "a.jsonl": ["the cat sat", "café naïve über", "a dog ran in the park"],
        "b.json": ["once upon a time", "alpha beta"],
        "c.txt": ["the mat\nthe park\n"],
        "d.parquet": ["long context models", "read many tokens"],
        "e.arrow": ["delta zeta", "gamma epsilon"],
        "f": ["good one", "good two"],
        "g.jsonl.gz": ["fine fine", "the the"],
        "h.md": ["# alpha\n\nbeta gamma"],
        "sub/i.jsonl": ["straße"],
    }
    write_jsonl(corpus / "a.jsonl", parts["a.jsonl"])
    (corpus / "b.json").write_text("  \n" + json.dumps([{"text": t} for t in parts["b.json"]]))
    (corpus / "c.txt").write_text(parts["c.txt"][0])
    pq.write_table(pa.table({"text": parts["d.parquet"], "x": [1, 2]}), corpus / "d.parquet")
    save_dataset(tmp_path / "saved", parts["e.arrow"])
    shutil.copy(next((tmp_path / "saved").glob("*.arrow")), corpus / "e.arrow")
    save_dataset(corpus / "f", parts["f"])
    with gzip.open(corpus / "g.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in parts["g.jsonl.gz"]))
    (corpus / "h.md").write_text(parts["h.md"][0])
    write_jsonl(corpus / "sub" / "i.jsonl", parts["sub/i.jsonl"])
    (corpus / "LICENSE").write_text("not a corpus file")
    write_jsonl(corpus / ".hidden.jsonl", ["hidden"])

    texts = [t for texts in parts.values() for t in texts]
    summary = preprocess(make_cfg(corpus, tok_path, tmp_path / "out"), progress=False)
    assert documents(tmp_path / "out") == expected(tokenizer, texts)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    tokens = sum(map(len, expected(tokenizer, texts)))
    assert (summary.documents, summary.rows, summary.tokens) == (len(texts), len(texts), tokens)
    assert meta["summary"]["rows"] == meta["summary"]["documents"] == meta["num_documents"] == 16
    assert meta["summary"]["tokens"] == meta["num_tokens"] == tokens
    assert set(meta["summary"]["skipped"].values()) == {0}
    lengths = [len(d) for d in expected(tokenizer, texts)]  # by the power of two above each
    by_length = {1 << (n - 1).bit_length(): [0, 0] for n in lengths}
    for n in lengths:
        by_length[1 << (n - 1).bit_length()][0] += 1
        by_length[1 << (n - 1).bit_length()][1] += n
    assert meta["summary"]["by_length"] == [[u, *c] for u, c in sorted(by_length.items())]
    assert "documents by length: <= " in summary.render()
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tokenizer.get_vocab_size(True)
    assert (meta["bos_id"], meta["eos_id"]) == (tokenizer.token_to_id("<s>"),
                                                tokenizer.token_to_id("</s>"))
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
    assert meta["tokenizer"]["spec"] == str(tok_path) and meta["source"]["path"] == str(corpus)
    assert meta["source"]["inputs"] == {"arrow": 1, "disk": 1, "json": 1, "jsonl": 3,
                                        "parquet": 1, "text": 2}

    jsonl = parts["a.jsonl"] + parts["g.jsonl.gz"] + parts["sub/i.jsonl"]
    preprocess(make_cfg(f"{corpus}/**/*.jsonl*", tok_path, tmp_path / "glob"), progress=False)
    assert documents(tmp_path / "glob") == expected(tokenizer, jsonl)
    preprocess(make_cfg(f"{corpus}/f/*.arrow", tok_path, tmp_path / "saved-glob"), progress=False)
    assert documents(tmp_path / "saved-glob") == expected(tokenizer, parts["f"])
    preprocess(make_cfg(corpus / "b.json", tok_path, tmp_path / "one", workers=2), progress=False)
    assert documents(tmp_path / "one") == expected(tokenizer, parts["b.json"])

    import datasets  # a DatasetDict folder: data.split picks the split, a glob takes the folder

    splits = {"train": ["the cat"], "test": ["the mat", "a dog"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
                         ).save_to_disk(tmp_path / "dd")
    preprocess(make_cfg(f"{tmp_path}/dd/**", tok_path, tmp_path / "dd-out", split="test"),
               progress=False)
    assert documents(tmp_path / "dd-out") == expected(tokenizer, splits["test"])


def test_text_units_and_special_tokens(tok, tmp_path):
    tokenizer, tok_path = tok
    text = "alpha beta\ngamma\n\n\n  \ndelta epsilon\n\nzeta\n"
    (tmp_path / "p.txt").write_text(text)
    units = {"document": [text], "paragraph": ["alpha beta\ngamma", "delta epsilon", "zeta"],
             "line": ["alpha beta", "gamma", "delta epsilon", "zeta"]}
    for unit, texts in units.items():
        out = tmp_path / unit
        summary = preprocess(make_cfg(tmp_path / "p.txt", tok_path, out, text_unit=unit),
                             progress=False)
        assert documents(out) == expected(tokenizer, texts), unit
        meta = json.loads((out / "meta.json").read_text())
        assert meta["source"]["text_unit"] == unit and summary.documents == len(texts)
    assert summary.rows == 8 and summary.skipped["empty"] == 4  # line mode: blank lines count
    assert summary.examples["empty"] == [f"{tmp_path}/p.txt:{n}" for n in (3, 4, 5)]

    out = tmp_path / "plain"
    preprocess(make_cfg(tmp_path / "p.txt", tok_path, out, text_unit="line", add_bos=False,
                        add_eos=False), progress=False)
    assert documents(out) == expected(tokenizer, units["line"], bos=False, eos=False)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["bos_id"], meta["eos_id"], meta["add_bos"], meta["add_eos"]) == (
        None, None, False, False)
    out = tmp_path / "eos-as-bos"
    preprocess(make_cfg(tmp_path / "p.txt", tok_path, out, text_unit="line", bos_token="</s>"),
               progress=False)
    eos = tokenizer.token_to_id("</s>")
    assert documents(out)[0] == [eos, *tokenizer.encode("alpha beta", add_special_tokens=False).ids,
                                  eos]


BAD_LINES = {  # line 2 of a two-line file -> skip reason
    b'{"text": "broken"': "malformed_json",
    b"[1, 2]": "malformed_json",
    b'{"body": "the cat"}': "missing_field",
    b'{"text": null}': "not_a_string",
    b'{"text": 7}': "not_a_string",
    b'{"text": "  \\t "}': "empty",
    b"": "empty",
    b'{"text": "caf\xe9"}': "invalid_utf8",
    b'{"text": "a\\ud800b"}': "invalid_utf8",
}


def test_bad_rows_are_counted_or_stop_a_strict_run(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer, tok_path = tok
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [b'{"text": "good one"}', *BAD_LINES, b'{"text": "good two"}']
    (corpus / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    pq.write_table(pa.table({"text": ["fine", None]}), corpus / "bad.parquet")
    (corpus / "c.json").write_text(json.dumps([{"text": "the mat"}, "not an object"]))
    summary = preprocess(make_cfg(corpus, tok_path, tmp_path / "out"), progress=False)
    assert documents(tmp_path / "out") == expected(tokenizer, ["good one", "good two", "fine",
                                                               "the mat"])
    counts = {"malformed_json": 3, "missing_field": 1, "not_a_string": 3, "empty": 2,
              "invalid_utf8": 2, "no_tokens": 0}
    at = f"{corpus}/bad.jsonl:"
    examples = {"malformed_json": [at + "2", at + "3", f"{corpus}/c.json:row 1"],
                "missing_field": [at + "4"],
                "not_a_string": [at + "5", at + "6", f"{corpus}/bad.parquet:row 1"],
                "empty": [at + "7", at + "8"], "invalid_utf8": [at + "9", at + "10"],
                "no_tokens": []}
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())["summary"]
    assert summary.skipped == meta["skipped"] == counts
    assert summary.examples == meta["examples"] == examples
    assert summary.rows == meta["rows"] == 11 + 2 + 2 and meta["documents"] == 4

    for i, (line, reason) in enumerate(BAD_LINES.items()):  # in this process and in a pool
        (tmp_path / "bad.jsonl").write_bytes(b'{"text": "good"}\n' + line + b"\n")
        cfg = make_cfg(tmp_path / "bad.jsonl", tok_path, tmp_path / f"strict{i}", strict=True,
                       workers=1 + i % 2)
        with pytest.raises(DataError, match=f"bad.jsonl:2: {reason}.*data.strict=false"):
            preprocess(cfg, progress=False)
        assert not (tmp_path / f"strict{i}").exists()
    with pytest.raises(DataError, match=r"bad.parquet:row 1: not_a_string"):
        preprocess(make_cfg(corpus / "bad.parquet", tok_path, tmp_path / "s", strict=True),
                   progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".s", "s"))]

    (tmp_path / "euro.jsonl").write_text('{"text": "€€€"}\n{"text": 3}\n{"text": "the"}\n')
    summary = preprocess(make_cfg(tmp_path / "euro.jsonl", tok_path, tmp_path / "euro",
                                  add_bos=False, add_eos=False), progress=False)
    assert summary.skipped["no_tokens"] == 1 and summary.documents == 1
    with pytest.raises(DataError, match="euro.jsonl:1: no_tokens"):  # the first bad row in order
        preprocess(make_cfg(tmp_path / "euro.jsonl", tok_path, tmp_path / "e", add_bos=False,
                            add_eos=False, strict=True), progress=False)
    with pytest.raises(DataError, match="no valid document in 3 rows.*missing_field 3"):
        preprocess(make_cfg(tmp_path / "euro.jsonl", tok_path, tmp_path / "none",
                            text_field="body"), progress=False)
    assert not (tmp_path / "none").exists()


def test_vocabulary_beyond_uint16(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"<s>": 70_000, "</s>": 70_001}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "big.json"
    tokenizer.save(str(tok_path))
    write_jsonl(tmp_path / "c.jsonl", ["w69999 w3 w65536", "w65535 w1"])
    with pytest.raises(TokenizerMismatch, match="preprocess.dtype=uint16.*70002 tokens"):
        preprocess(make_cfg(tmp_path / "c.jsonl", tok_path, tmp_path / "u16", dtype="uint16"),
                   progress=False)
    assert not (tmp_path / "u16").exists()
    summary = preprocess(make_cfg(tmp_path / "c.jsonl", tok_path, tmp_path / "auto"),
                         progress=False)
    assert summary.dtype == "uint32" and summary.vocab_size == 70_002
    assert documents(tmp_path / "auto") == [[70_000, 69_999, 3, 65_536, 70_001],
                                            [70_000, 65_535, 1, 70_001]]


def test_output_is_byte_identical_for_any_workers_and_shards_hold_whole_documents(tok, tmp_path):
    tokenizer, tok_path = tok
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 12))) for _ in range(240)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", texts[:150])
    write_jsonl(corpus / "b.jsonl", texts[150:])
    runs = {"w1": dict(workers=1, batch_rows=16), "w2": dict(workers=2, batch_rows=16),
            "w2-again": dict(workers=2, batch_rows=16), "w2-b5": dict(workers=2, batch_rows=5)}
    for name, keys in runs.items():
        preprocess(make_cfg(corpus, tok_path, tmp_path / name, **keys), progress=False)
    reference = all_files(tmp_path / "w1")
    assert set(reference) == {"meta.json", "tokens-00000.bin", "docs-00000.npy"}
    for name in runs:
        assert all_files(tmp_path / name) == reference, name
    assert documents(tmp_path / "w1") == expected(tokenizer, texts)

    limit = 150
    for name, workers in (("sharded1", 1), ("sharded2", 2)):
        preprocess(make_cfg(corpus, tok_path, tmp_path / name, shard_tokens=limit,
                            workers=workers, batch_rows=7), progress=False)
    assert all_files(tmp_path / "sharded1") == all_files(tmp_path / "sharded2")
    assert documents(tmp_path / "sharded1") == expected(tokenizer, texts)
    shards, size = [[]], 0  # independent greedy split: a new shard once `limit` is reached
    for n in map(len, expected(tokenizer, texts)):
        if size >= limit:
            shards, size = [*shards, []], 0
        shards[-1].append(n)
        size += n
    meta = json.loads((tmp_path / "sharded1" / "meta.json").read_text())
    assert len(meta["shards"]) == len(shards) > 3
    for shard, lengths in zip(meta["shards"], shards):
        borders = np.load(tmp_path / "sharded1" / shard["docs"])
        assert np.diff(borders).tolist() == lengths
        assert (tmp_path / "sharded1" / shard["tokens"]).stat().st_size == 2 * sum(lengths)


def test_overwrite_replaces_only_when_asked(tok, tmp_path):
    tokenizer, tok_path = tok
    write_jsonl(tmp_path / "old.jsonl", ["the cat sat"])
    write_jsonl(tmp_path / "new.jsonl", ["a dog ran", "in the park"])
    out = tmp_path / "out"
    preprocess(make_cfg(tmp_path / "old.jsonl", tok_path, out), progress=False)
    old = all_files(out)
    cfg = make_cfg(tmp_path / "new.jsonl", tok_path, out)
    assert any("preprocess.overwrite=true" in p for p in validate_preprocess(cfg))
    with pytest.raises(ValueError, match="exists"):
        preprocess(cfg, progress=False)
    assert all_files(out) == old
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(DataError):
        preprocess(make_cfg(tmp_path / "bad.jsonl", tok_path, out, overwrite=True, strict=True),
                   progress=False)
    assert all_files(out) == old
    preprocess(make_cfg(tmp_path / "new.jsonl", tok_path, out, overwrite=True), progress=False)
    assert documents(out) == expected(tokenizer, ["a dog ran", "in the park"])
    with pytest.raises(ValueError, match="already a preprocessed token dataset.*data.source=tokens"):
        preprocess(make_cfg(out, tok_path, tmp_path / "again"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    problems = validate_preprocess(make_cfg(tmp_path / "new.jsonl", tok_path, tmp_path / "notes",
                                            overwrite=True))
    assert len(problems) == 1 and "not a preprocessed dataset" in problems[0]


def test_validate_preprocess_reports_every_problem():
    cfg = LctrainConfig()
    cfg.preprocess.workers, cfg.preprocess.shard_tokens, cfg.preprocess.batch_rows = -1, 0, 0
    cfg.data.format, cfg.data.text_unit, cfg.preprocess.dtype = "csv", "page", "int8"
    problems = validate_preprocess(cfg)
    for key in ("preprocess.output", "data.path", "data.tokenizer", "preprocess.workers=-1",
                "preprocess.shard_tokens=0", "preprocess.batch_rows=0", "data.format='csv'",
                "data.text_unit='page'", "preprocess.dtype='int8'"):
        assert sum(key in p for p in problems) == 1, (key, problems)
    assert len(problems) == 9


def test_inputs_and_tokenizers_are_resolved_or_rejected_clearly(tok, tmp_path):
    tokenizer, tok_path = tok
    cfg = LctrainConfig()
    for path, message in ((tmp_path / "missing/", "does not exist"),
                          ("someone/some-dataset", "does not exist locally.*offline"),
                          (tmp_path / "*.jsonl", "has nothing to read; expected .*\\.jsonl")):
        cfg.data.path = str(path)
        with pytest.raises(ValueError, match=message):
            resolve_inputs(cfg.data)
    (tmp_path / "data.csv").write_text("a,b\n")
    cfg.data.path = str(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="data.path=.*data.csv.*expected"):
        resolve_inputs(cfg.data)
    cfg.data.format = "text"
    assert [(i.kind, Path(i.path).name) for i in resolve_inputs(cfg.data)] == [("text", "data.csv")]

    special = train_tokenizer(["<doc>", "<end>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    special.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<doc>", "__type": "AddedToken"}, "eos_token": "<end>"}))
    cfg.data.tokenizer = str(folder)
    info = load_tokenizer(cfg.data)
    assert (info.bos_id, info.eos_id) == (special.token_to_id("<doc>"), special.token_to_id("<end>"))
    assert info.vocab_size == special.get_vocab_size(with_added_tokens=True)
    cfg.data.tokenizer = str(folder / "tokenizer.json")  # no tokenizer_config.json beside a file
    with pytest.raises(TokenizerMismatch, match="no BOS token.*data.bos_token=.*data.add_bos=false"):
        load_tokenizer(cfg.data)
    cfg.data.bos_token, cfg.data.eos_token = "<doc>", "<nope>"
    with pytest.raises(TokenizerMismatch, match="data.eos_token='<nope>' is not in the vocab"):
        load_tokenizer(cfg.data)
    cfg.data.add_eos = False
    assert load_tokenizer(cfg.data).eos_id is None

    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    for spec, message in ((tmp_path / "sp", "sentencepiece.*convert it to tokenizer.json"),
                          (tmp_path / "nope.json", "does not exist"),
                          (tmp_path / "data.csv", "not a readable tokenizer.json")):
        cfg.data.tokenizer = str(spec)
        with pytest.raises(ValueError, match=message):
            load_tokenizer(cfg.data)


def test_cli_preprocess(tok, tmp_path):
    tokenizer, tok_path = tok
    write_jsonl(tmp_path / "c.jsonl", ["the cat sat", "a dog ran"])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    base = [sys.executable, "-m", "lctrain.cli", "preprocess", f"data.tokenizer={tok_path}"]
    commands = {
        "ok": [f"data.path={tmp_path}/*.jsonl", f"preprocess.output={tmp_path}/out",
               "preprocess.workers=2"],
        "config": [f"data.path={tmp_path}/c.jsonl", "preprocess.workers=-1"],
        "strict": [f"data.path={tmp_path}/bad.jsonl", f"preprocess.output={tmp_path}/strict",
                   "data.strict=true"],
    }
    procs = {k: subprocess.Popen(base + v, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, v in commands.items()}
    done = {k: (p.wait(timeout=120), *p.communicate()) for k, p in procs.items()}

    rc, out, err = done["ok"]
    assert rc == 0, err
    assert "preprocessed 3 documents" in out and "rows read 4, skipped 1" in out
    assert f"not_a_string: 1  e.g. {tmp_path}/bad.jsonl:2" in out and "tokens/s" in out
    texts = ["fine", "the cat sat", "a dog ran"]
    assert documents(tmp_path / "out") == expected(tokenizer, texts)
    rc, out, err = done["config"]
    assert rc == 2 and "preprocess.workers=-1" in err and "preprocess.output is not set" in err
    rc, out, err = done["strict"]
    assert rc == 1 and f"lctrain: data error: {tmp_path}/bad.jsonl:2: not_a_string" in err
    assert "Traceback" not in err and not (tmp_path / "strict").exists()
