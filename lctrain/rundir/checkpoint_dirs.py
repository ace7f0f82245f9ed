"""The checkpoints under a run's checkpoint root, read without torch: each step's directory name
(step-NNNNNNNN), the manifest that makes it complete (the file names, sizes and sha256 of
everything it holds), which directories are complete, and what is wrong with one's files.
`lctrain.training.checkpoint`'s docstring lists every file a checkpoint holds.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

MANIFEST = "manifest.json"
STATE = "train_state.json"
_NAME = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories under `root` that have a manifest, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def damaged_files(path: Path, rank: int = 0, world: int = 1, hashes: bool = True) -> list[str]:
    """What is wrong with a checkpoint's files (this rank checks every world-th file)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return [f"{path / MANIFEST}: unreadable ({e})"]
    problems = []
    for i, (name, entry) in enumerate(sorted(files.items())):
        file = path / name
        if not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{file} holds {file.stat().st_size} bytes, not {entry['size']}")
        elif hashes and i % world == rank and sha256_file(file) != entry["sha256"]:
            problems.append(f"{file} does not match its sha256 (the file is corrupt)")
    return problems
