"""Config discovery: `lctrain keys` lists every key of the schema with its type, default,
allowed values and docstring; `--cfg` prints the resolved configuration and runs nothing."""

import dataclasses

import pytest
import yaml

from lctrain import cli
from lctrain.config.schema import LctrainConfig


def _main(argv, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    captured = capsys.readouterr()
    return done.value.code, captured.out, captured.err


def test_keys_lists_every_field_with_its_docstring(capsys):
    code, out, _ = _main(["keys"], capsys)
    assert code == 0
    root = LctrainConfig()
    for section in dataclasses.fields(LctrainConfig):
        for f in dataclasses.fields(getattr(root, section.name)):
            assert f"\n{section.name}.{f.name}: " in "\n" + out, (section.name, f.name)
    # a line from a docstring, with the choices and the default beside the key
    assert "parallel.attention: str = 'ring'  [ulysses | ring | usp | allgather]" in out
    assert "Context-parallel attention: ulysses | ring | usp | allgather" in out
    code, out, _ = _main(["keys", "deepspeed"], capsys)
    assert code == 0 and out.startswith("deepspeed.zero_stage: int = 1  [>= 1]")
    assert "parallel." not in out
    code, _, err = _main(["keys", "paralel"], capsys)
    assert code == 2 and "unknown section 'paralel'" in err


def test_cfg_prints_the_resolved_config_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    code, out, _ = _main(["train", "+recipe=tiny", "parallel.pp=2", "train.steps=7", "--cfg"],
                         capsys)
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["parallel"]["pp"] == 2 and cfg["train"]["steps"] == 7
    assert cfg["parallel"]["cp"] == 2  # the recipe's
    code, _, err = _main(["plan", "+recipe=tiny", "--cfgg"], capsys)
    assert code == 2 and "unknown flag --cfgg" in err


def _refuse(*args, **kwargs):
    raise AssertionError("--cfg must not run anything")
