"""The codebase keeps the shape docs/architecture.md describes: every module says what it owns and
is listed there, lctrain modules are imported at the top (an exception says why), nothing points
outside the repository, and every allowed-value list of the schema is enforced by validation. (The layer and
cycle rules are import-linter contracts in pyproject.toml, run by `lint-imports`.)"""

import ast
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from lctrain.config import LctrainConfig
from lctrain.config.validation import validate

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted((REPO / "lctrain").rglob("*.py"))


def _function_imports(tree: ast.AST):
    """(function, import) for every import of an lctrain module inside a function."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lctrain"):
                    yield fn, node
                elif isinstance(node, ast.Import) and any(a.name.startswith("lctrain")
                                                          for a in node.names):
                    yield fn, node


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_says_what_it_owns_and_imports_at_the_top(path):
    source = path.read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    assert doc and doc.splitlines()[0].strip(), f"{path}: the first line must say what it owns"
    lines = source.splitlines()
    for fn, node in _function_imports(tree):
        before = lines[fn.lineno:node.lineno - 1]  # the function's lines above the import
        assert any(line.strip().startswith("#") for line in before), (
            f"{path}:{node.lineno} imports an lctrain module inside {fn.name}() without a "
            "comment saying why it cannot be imported at the top")


def test_nothing_refers_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        path = REPO / name
        if path.suffix not in {".py", ".md", ".yaml", ".toml", ".txt", ""} or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if name == "tests/test_architecture.py":
            continue
        for needle in ("../shared", "DIGEST"):
            assert needle not in text, f"{name} refers to {needle}, outside the repository"


def listed_modules(doc: str) -> list[str]:
    """The modules of docs/architecture.md's "Every module" tree, as paths from the repository
    root. An entry line starts with `name.py` (or `a.py, b.py`) or a folder `name/`, indented two
    spaces per level below `lctrain/`; other lines continue a description (and must not start
    with a module's name)."""
    block = doc.split("## Every module", 1)[1].split("```")[1].splitlines()
    assert block[1] == "lctrain/", block[:2]
    folders, found = [], []
    for line in block[2:]:
        entry = re.match(r"( *)(\w+/|(?:\w+\.py, *)*\w+\.py)(?: |$)", line)
        if entry is None:
            continue
        indent, names = len(entry.group(1)), entry.group(2)
        depth = indent // 2 - 1
        assert indent % 2 == 0 and 0 <= depth <= len(folders), f"misplaced entry: {line!r}"
        folders = folders[:depth]
        if names.endswith("/"):
            folders.append(names[:-1])
        else:
            found += ["/".join(["lctrain", *folders, n]) for n in re.split(r", *", names)]
    return found


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def test_docs_list_every_module_and_only_modules_that_exist():
    listed = listed_modules((REPO / "docs" / "architecture.md").read_text())
    modules = [str(p.relative_to(REPO)) for p in MODULES
               if not (p.name == "__init__.py" and _only_a_docstring(p))]
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(set(modules) - set(listed)) == [], "add these to docs/architecture.md"
    assert sorted(set(listed) - {str(p.relative_to(REPO)) for p in MODULES}) == [], (
        "docs/architecture.md lists modules that do not exist")


def test_module_listing_parser():
    doc = ("## Every module\n```\nlctrain/\n  cli.py    what\n  data/\n    a.py, b.py  x\n"
           "                and more words\n    sub/\n      c.py\n  d.py\n```\n")
    assert listed_modules(doc) == ["lctrain/cli.py", "lctrain/data/a.py", "lctrain/data/b.py",
                                   "lctrain/data/sub/c.py", "lctrain/d.py"]
    with pytest.raises(AssertionError, match="misplaced entry"):  # deeper than its folder
        listed_modules(doc.replace("and more words", "e.py begins a continued line"))


def _choice_fields(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _choice_fields(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata:
            yield node, f, f"{prefix}{f.name}"


def test_every_allowed_value_list_is_enforced():
    fields = list(_choice_fields(LctrainConfig()))
    assert len(fields) >= 20
    for _, f, key in fields:
        cfg = LctrainConfig()
        section = cfg
        for part in key.split(".")[:-1]:
            section = getattr(section, part)
        bad = ["nonsense"] if isinstance(getattr(section, f.name), list) else "nonsense"
        setattr(section, f.name, bad)
        problems = validate(cfg, 1)
        assert any(p.startswith(key) and "nonsense" in p for p in problems), (key, problems)


def _distributed_imports(tree: ast.AST) -> list[str]:
    """Every torch.distributed module a module imports but its tensor submodule (DTensor
    parameters and their placements)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] if node.module != "torch" else [
                f"torch.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n.split(".")[:2] == ["torch", "distributed"]
            and n.split(".")[:3] != ["torch", "distributed", "tensor"]]


def test_the_model_holds_no_collective_and_no_process_group():
    """lctrain.models is single-device code: no torch.distributed but DTensor's module (the
    collectives and process groups are parallel/'s, which applies every parallelism from
    outside; import-linter keeps lctrain.comm out). The check fails on such an import."""
    found = {str(p.relative_to(REPO)): _distributed_imports(ast.parse(p.read_text()))
             for p in sorted((REPO / "lctrain" / "models").glob("*.py"))}
    assert {p: n for p, n in found.items() if n} == {}
    assert _distributed_imports(ast.parse("import torch.distributed as dist\n"
                                          "from torch.distributed.tensor import DTensor\n"
                                          "from torch import distributed")) == [
        "torch.distributed", "torch.distributed"]
