"""Where conf/ and recipes/ are: inside the installed package, or at the repository root."""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parents[1]  # the lctrain package


def _find(name: str) -> Path:
    for candidate in (_PKG / name, _PKG.parent / name):  # wheel install, then source checkout
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"lctrain cannot find its {name}/ folder next to {_PKG}; reinstall "
                            "lctrain (pip install .) or run from the repository")


def conf_dir() -> Path:
    return _find("conf")


def recipes_dir() -> Path:
    return _find("recipes")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))
