"""Every lctrain name the repository imports resolves where it is imported from: `from lctrain.X
import name` and `module_alias.name` read through `from lctrain.X import module as alias` or
`import lctrain.X as alias`, in lctrain, tests, bench and tools. A module split along its seams
(lctrain.training.checkpoint into checkpoint and checkpoint_format, lctrain.data.ingest into
inputs, ingest and tokenizer) keeps re-exporting what others import from the old place; this
finds a forgotten one without running bench or tools. No processes, no ranks."""

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("lctrain", "tests", "bench", "tools")
                 for p in (REPO / folder).rglob("*.py"))


def _imported(tree: ast.AST):
    """(line, module, name, module_known) for every lctrain name the file imports, and every
    name it reads off an alias of an lctrain import (which need not be a module)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lctrain"):
            for a in node.names:
                yield node.lineno, node.module, a.name, True
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names
                            if a.name.startswith("lctrain") and a.asname})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            yield node.lineno, aliases[node.value.id], node.attr, False


def _problem(module: str, name: str, module_known: bool) -> str | None:
    """Why `module.name` does not resolve (None: it does)."""
    try:
        owner = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not module_known and e.name != module.partition(".")[0]:
            return None  # an alias of a function or class, not of a module: nothing to check
        return f"{type(e).__name__}: {e}"
    except ImportError as e:  # the module imports a name from where it no longer is
        return f"ImportError: {e}"
    if hasattr(owner, name):
        return None
    try:
        importlib.import_module(f"{module}.{name}")  # a submodule its package did not import
    except ModuleNotFoundError as e:
        return f"{module} has no {name}" if e.name == f"{module}.{name}" else f"{e}"
    except ImportError as e:
        return f"ImportError: {e}"
    return None


def test_every_imported_lctrain_name_resolves():
    missing = []
    for path in SOURCES:
        for line, module, name, known in _imported(ast.parse(path.read_text())):
            if (problem := _problem(module, name, known)) is not None:
                missing.append(f"{path.relative_to(REPO)}:{line}: {module}.{name}: {problem}")
    assert len(SOURCES) > 100
    assert not missing, "names imported from where they no longer are:\n" + "\n".join(missing)
