"""Config discovery: `lctrain keys` lists every key of the schema with its type, default,
allowed values and docstring; `--cfg` prints the resolved configuration and runs nothing. The
command table: one entry per command, each module's `run(args)`, imported only when it runs."""

import dataclasses
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import yaml

from lctrain import cli
from lctrain.commands import CommandArgs
from lctrain.config.schema import LctrainConfig
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


def test_keys_lists_every_field_with_its_docstring(capsys):
    code, out, _ = run_cli(["keys"], capsys)
    assert code == 0
    root = LctrainConfig()
    for section in dataclasses.fields(LctrainConfig):
        for f in dataclasses.fields(getattr(root, section.name)):
            assert f"\n{section.name}.{f.name}: " in "\n" + out, (section.name, f.name)
    # a line from a docstring, with the choices and the default beside the key, and a
    # registry's entries each with its summary, from the entry
    assert "parallel.attention: str = 'ring'  [ulysses | ring | usp | allgather]" in out
    assert "Context-parallel attention: one of the registry" in out
    assert "\n      ring: K/V blocks passed around the cp ranks" in out
    assert "\n      documents: each packed row split by its own documents" in out
    code, out, _ = run_cli(["keys", "deepspeed"], capsys)
    assert code == 0 and out.startswith("deepspeed.zero_stage: int = 1  [>= 1]")
    assert "parallel." not in out
    code, _, err = run_cli(["keys", "paralel"], capsys)
    assert code == 2 and "unknown section 'paralel'" in err


def test_cfg_prints_the_resolved_config_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr("lctrain.training.loop.train", _refuse)
    code, out, _ = run_cli(["train", "+recipe=tiny", "parallel.pp=2", "train.steps=7", "--cfg"],
                         capsys)
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["parallel"]["pp"] == 2 and cfg["train"]["steps"] == 7
    assert cfg["parallel"]["cp"] == 2  # the recipe's
    code, _, err = run_cli(["plan", "+recipe=tiny", "--cfgg"], capsys)
    assert code == 2 and "unknown flag --cfgg" in err


def test_flags_that_would_do_nothing_are_refused_with_the_fix(capsys, monkeypatch):
    """A switch given a value, a flag of another command, and --trace with the layout search:
    each was ignored (exit 0, the plain plan) or refused without saying where it belongs."""
    monkeypatch.setattr("lctrain.commands.plan.trace_plan", _refuse)
    code, _, err = run_cli(["plan", "+recipe=tiny", "--trace=true"], capsys)
    assert code == 2 and "--trace is a switch and takes no value; write --trace alone" in err
    code, _, err = run_cli(["train", "+recipe=tiny", "--trace"], capsys)
    assert code == 2 and "(--trace belongs to lctrain plan)" in err, err
    code, _, err = run_cli(["plan", "+recipe=tiny", "plan.search=true", "--trace"], capsys)
    assert code == 2 and "then trace the layout it picks" in err, err
    code, _, err = run_cli(["plan", "+recipe=tiny", "plan.search=true", "plan.trace=true"],
                           capsys)
    assert code == 2 and "plan.search=true" in err, err


def test_the_first_error_is_the_cause(capsys, tmp_path):
    """A missing model.init_from is the one problem named (not the experts of the defaults'
    llama it would replace); an unknown recipe or model preset gets the closest names, not
    Hydra's search path."""
    code, _, err = run_cli(["plan", "+recipe=tiny", f"model.init_from={tmp_path}/none",
                            "parallel.ep=2"], capsys)
    assert code == 2 and f"model.init_from={tmp_path}/none is not a directory" in err, err
    assert "experts" not in err and err.count("\n  - ") == 1, err
    code, _, err = run_cli(["plan", "+recipe=llama256k"], capsys)
    assert code == 2 and "unknown recipe +recipe=llama256k (did you mean llama-256k?)" in err
    assert "search path" not in err
    code, _, err = run_cli(["plan", "model=llama3-8bb"], capsys)
    assert code == 2 and "(did you mean llama3-8b?)" in err, err


def _refuse(*args, **kwargs):
    raise AssertionError("--cfg must not run anything")


def test_every_command_module_has_one_run_signature():
    modules = {m for c in cli.COMMANDS.values() for m in (c.module, *c.routes.values())}
    assert "lctrain.commands.calibrate" in modules and len(modules) == len(cli.COMMANDS) + 1
    for name in modules:
        run = importlib.import_module(name).run
        params = list(inspect.signature(run).parameters.values())
        assert [p.name for p in params] == ["args"], name
        assert params[0].annotation in (CommandArgs, "CommandArgs"), name
    for command in cli.COMMANDS.values():
        assert set(command.routes) | command.composes_itself <= command.flags
        assert command.composes or not (command.routes or command.composes_itself)


def test_usage_lists_every_command_its_flags_and_the_exit_codes(capsys):
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for name, command in cli.COMMANDS.items():
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert all(flag in line for flag in command.flags), line
    assert "Exit codes: 0 ok, 1 run failure (or data error), 2 configuration error, 3 run dir " \
           "in use by a live job." in out


def test_preprocess_and_keys_start_without_torch():
    code = ("import json, sys\nfrom lctrain.cli import main\ncodes = []\n"
            "for argv in (['preprocess'], ['keys', 'data']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n"
            "        codes.append(e.code)\n"
            "print(json.dumps([codes, 'torch' in sys.modules,\n"
            "                  'lctrain.commands.preprocess' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    codes, torch_loaded, ran_preprocess = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [2, 0] and ran_preprocess and not torch_loaded
    assert "preprocess.output is not set" in done.stderr  # preprocess's own check
