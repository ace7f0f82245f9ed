"""Writing the run dir's files so that a fault never leaves a torn one: `write_atomic` replaces a
file whole (temp file, fsync, rename) or not at all, and every failure becomes a RunDirError
naming the file, the errno and what to do (free space, remount read-write, fix permissions, or
point hydra.run.dir / checkpoint.dir elsewhere). Used for config.yaml, metrics.jsonl's rewrite
on resume, the W&B id and every checkpoint file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path


class RunDirError(RuntimeError):
    """A file of the run dir (config.yaml, metrics.jsonl) could not be written: a full disk, a
    read-only file system, a directory this process may not write. The message names the file,
    the errno, what was kept and what to do."""


_FIXES = [  # (errnos, what to do about them, in directory {})
    ({errno.ENOSPC, errno.EDQUOT}, "free space on the disk holding {} (or raise the quota)"),
    ({errno.EROFS}, "remount the file system of {} read-write"),
    ({errno.EACCES, errno.EPERM}, "make {} writable by this user"),
]


def describe_os_error(error: OSError) -> str:
    """'No space left on device (errno 28, ENOSPC)': the reason, its number and its name."""
    if error.errno is None:
        return str(error)
    name = errno.errorcode.get(error.errno, "unknown")
    return f"{error.strerror or os.strerror(error.errno)} (errno {error.errno}, {name})"


def write_advice(errnos: set[int | None], directory: Path, setting: str) -> str:
    """What to do after writes in `directory` failed with these errnos: fix it, or point the
    setting that chose it (hydra.run.dir, checkpoint.dir) elsewhere."""
    fixes = [fix.format(directory) for codes, fix in _FIXES if codes & errnos] or [
        f"check the disk and the permissions of {directory}"]
    text = ", or ".join([*fixes, f"pick another {setting}"])
    return text[0].upper() + text[1:] + "."


def errnos_in(text: str) -> set[int | None]:
    """The errnos `describe_os_error` wrote into a message (errors travel between ranks as text)."""
    return {int(n) for n in re.findall(r"\(errno (\d+), E[A-Z0-9]+\)", text)}


def write_atomic(path: Path, data: str | bytes, setting: str = "hydra.run.dir") -> None:
    """Replace `path` by `data` all at once: written to a temporary file beside it, synced, then
    renamed over it, so a failed write (full disk, read-only directory) leaves the old file as it
    was and no temporary file behind. Raises RunDirError naming the file and what to do."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_synced(tmp, data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        kept = (f"the previous {path.name} is unchanged" if path.is_file() else
                f"{path.name} was not written")
        raise RunDirError(f"cannot write {path}: {describe_os_error(e)}; {kept}. "
                          f"{write_advice({e.errno}, path.parent, setting)}") from e


def write_synced(path: Path, data: bytes) -> None:
    """Write and fsync `path`; an OSError names the file even when write or fsync raised it."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
