"""One job per run dir: a lock file, RUN_DIR/.lctrain.lock, taken before any rank exists and
held for the whole run, so that two jobs never write checkpoints into the same run dir.

The file holds its holder as JSON (host, pid, the pid's start time, boot id, pid namespace, Slurm
job id and start, since, and a random token naming this acquisition). It is made to work for
Slurm jobs on several nodes that share a file system, where flock/fcntl cannot be trusted (NFS):

- Take: `os.open(O_CREAT | O_EXCL)` of the lock file; exactly one contender creates it.
- Heartbeat: while held, a daemon thread sets the file's mtime every HEARTBEAT_S. Its age is
  measured against the mtime of a probe file created beside it, so both clocks are the file
  server's and the nodes' clocks may disagree.
- Stale: on the holder's own machine (same host name, boot id and pid namespace) at once when its
  pid is gone, a zombie, or now another process (the start time in /proc/PID/stat, field 22,
  differs); from anywhere else when no heartbeat came for STALE_AFTER_S (3 beats plus slack for
  NFS attribute caching and pauses). A live holder on this machine is never stale, however late.
  The boot id keeps two machines that share a host name (and a rebooted host, whose lock is long
  past its heartbeat by then) out of the pid check.
- Takeover of a stale lock: a contender first creates, with O_EXCL, a marker named after the
  stale lock's token (`.lctrain.lock.takeover-TOKEN-0`); the one that gets it reads the lock
  again, removes it only if it still holds that token, then removes the marker and goes back
  to the O_EXCL create, which exactly one contender wins. Renaming the stale file away instead
  would race: a slow contender could rename away the lock a faster one has just created. A
  marker left by a contender killed mid-takeover (a window of milliseconds) is passed over
  after TAKEOVER_S by the next attempt number, which again only one contender creates.
- Release: on any exit of the holding `with` block (normal, exception, SIGTERM/SIGUSR1 turned
  into a checkpoint and exit 0) the file is removed if it still holds our token. SIGKILL or a
  dead node leaves it behind: it is then stale as above.

A Slurm job that Slurm requeues (same job id, next SLURM_RESTART_COUNT) finds its previous
start's lock: on the same node it is stale at once (dead pid); on another node the new start
waits up to STALE_AFTER_S + HEARTBEAT_S for its heartbeat to stop, then takes it. The job id is
trusted only to wait instead of refusing, never to take a lock whose heartbeat is fresh: a start
Slurm gave up on (node failure) may still be running behind a network partition, job ids repeat
after MaxJobId wraps and across clusters that share a file system, and a user may start two
steps in one allocation. Residual race, inherent to heartbeat locks: a holder on another node
that stalls for longer than STALE_AFTER_S (and so is taken over) keeps running; its heartbeat
then sees the lock is no longer its own and warns, and it never removes the new holder's lock.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lctrain.config import ConfigError
from lctrain.rundir import LOCK as LOCK_FILE
from lctrain.rundir import RunDir

HEARTBEAT_S = 5.0
"""How often the holder refreshes the lock file's mtime."""
STALE_AFTER_S = 3 * HEARTBEAT_S + 15.0
"""A lock from another machine whose mtime is older than this is stale."""
TAKEOVER_S = 10.0
"""A takeover marker older than this was left by a contender that died mid-takeover."""


class RunDirLocked(Exception):
    """A live job holds the run dir. Not a ConfigError: nothing in the command line is wrong,
    the run dir is busy, so lctrain.cli prints it with its own exit code (3), which a wrapper
    can tell from a configuration error's 2 (wait, or pick another run dir)."""

    header = "the run dir is in use"

    def __init__(self, problem: str):
        self.problems = [problem]
        super().__init__(f"{self.header}: {problem}")


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: enough to tell whether it still runs, and to name it to a user."""

    host: str
    pid: int
    start_time: int | None
    """/proc/PID/stat field 22 (clock ticks after boot): guards against pid reuse."""
    boot_id: str
    pid_ns: str
    slurm_job_id: str | None
    slurm_cluster: str | None
    start: str
    """Which start of the job: SLURM_RESTART_COUNT.TORCHELASTIC_RESTART_COUNT."""
    since: str
    token: str

    @classmethod
    def this_process(cls) -> Holder:
        env, pid = os.environ, os.getpid()
        return cls(host=socket.gethostname(), pid=pid, start_time=_start_time(pid),
                   boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
                   pid_ns=_pid_namespace(), slurm_job_id=env.get("SLURM_JOB_ID") or None,
                   slurm_cluster=env.get("SLURM_CLUSTER_NAME") or None,
                   start=f"{env.get('SLURM_RESTART_COUNT') or 0}."
                         f"{env.get('TORCHELASTIC_RESTART_COUNT') or 0}",
                   since=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   token=uuid.uuid4().hex)

    @classmethod
    def from_json(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(host=str(d["host"]), pid=int(d["pid"]), start_time=d.get("start_time"),
                       boot_id=str(d.get("boot_id", "")), pid_ns=str(d.get("pid_ns", "")),
                       slurm_job_id=d.get("slurm_job_id"), slurm_cluster=d.get("slurm_cluster"),
                       start=str(d.get("start", "")), since=str(d.get("since", "?")),
                       token=str(d["token"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        """'host H, pid P, Slurm job J, since S'."""
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"host {self.host}, pid {self.pid}{job}, since {self.since}"

    def same_machine(self, other: Holder) -> bool:
        """Whether this holder's pid can be looked up here (same host, boot and pid namespace)."""
        return (self.host, self.boot_id, self.pid_ns) == (other.host, other.boot_id,
                                                          other.pid_ns)

    def is_predecessor_of(self, other: Holder) -> bool:
        """An earlier (or later) start of the same Slurm job (see the module docstring)."""
        return (self.slurm_job_id is not None and self.slurm_job_id == other.slurm_job_id
                and self.slurm_cluster == other.slurm_cluster and self.start != other.start)


@dataclass(frozen=True)
class LockState:
    """A lock file as a contender sees it."""

    holder: Holder | None
    """None: the file is not (yet) valid JSON."""
    age_s: float
    """Seconds since its last heartbeat."""
    stale: bool
    why: str
    """Why it is stale, or why it is held."""
    ident: str
    """Names this lock for the takeover marker (its token, or its inode for an unreadable one)."""


def inspect(run_dir: str | os.PathLike, now: float | None = None,
            stale_after_s: float = STALE_AFTER_S) -> LockState | None:
    """The run dir's lock, or None when there is none. Read-only unless `now` is None, when the
    file server's clock is read by creating (and removing) a probe file beside the lock."""
    path = RunDir(run_dir).lock
    try:
        fd = os.open(path, os.O_RDONLY)  # an open revalidates NFS's cached attributes
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        text = os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)
    if now is None:
        now = _fs_now(path.parent)
    age = max(0.0, now - st.st_mtime)
    holder = Holder.from_json(text)
    if holder is None:
        ident = f"u{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"
        return LockState(None, age, age > stale_after_s,
                         f"unreadable and {age:.0f} s old" if age > stale_after_s else
                         "being written", ident)
    stale, why = _judge(holder, age, stale_after_s)
    return LockState(holder, age, stale, why, holder.token)


def _judge(holder: Holder, age: float, stale_after_s: float) -> tuple[bool, str]:
    me = Holder.this_process()
    if holder.same_machine(me):
        if _alive(holder.pid, holder.start_time):
            return False, "its process is running on this machine"
        return True, f"pid {holder.pid} no longer runs on {holder.host}"
    if age > stale_after_s:
        return True, f"no heartbeat for {age:.0f} s (stale after {stale_after_s:.0f} s)"
    return False, f"heartbeat {age:.0f} s ago"


class RunLock:
    """A held lock: a daemon thread keeps its heartbeat; `release` (or leaving `with`) frees it."""

    def __init__(self, path: Path, holder: Holder, heartbeat_s: float = HEARTBEAT_S,
                 took_over: str | None = None):
        self.path, self.holder, self.heartbeat_s = path, holder, heartbeat_s
        self.took_over = took_over
        """What this acquisition replaced: 'host H, pid P, ...: why it was stale', or None."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lctrain-run-lock",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                current = _read_holder(self.path)
                if current is not None and current.token == self.holder.token:
                    os.utime(self.path)  # None: the file server's time
                    continue
            except FileNotFoundError:
                pass
            except OSError:
                continue  # a file-system hiccup: beat again next time
            # plain os.write: a lock held by this thread across fork would hang ranks
            os.write(2, (f"lctrain: warning: the run dir lock {self.path} is no longer this "
                         "job's (removed, or taken over after a missed heartbeat); another job "
                         "may be writing to this run dir\n").encode())
            return

    def release(self) -> None:
        """Remove the lock file if it is still ours (idempotent; a no-op in forked children)."""
        if os.getpid() != self.holder.pid or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 1)
        try:
            current = _read_holder(self.path)
            if current is not None and current.token == self.holder.token:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: str | os.PathLike, *, heartbeat_s: float = HEARTBEAT_S,
            stale_after_s: float = STALE_AFTER_S,
            log: Callable[[str], None] | None = None) -> RunLock:
    """Take the run dir's lock (creating the run dir), taking over a stale one; raises
    RunDirLocked naming the holder when a live job holds it."""
    run_dir = Path(run_dir)
    path = RunDir(run_dir).lock
    me = Holder.this_process()
    took_over, wait_until = None, None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            if _create(path, me):
                return RunLock(path, me, heartbeat_s, took_over)
            state = inspect(run_dir, stale_after_s=stale_after_s)
            if state is None:
                continue  # released in between
            if state.stale:
                if _take_over(path, state):
                    took_over = (f"{state.holder.describe() if state.holder else 'unreadable'}"
                                 f": {state.why}")
                continue
            if state.holder is not None and state.holder.is_predecessor_of(me):
                if wait_until is None:
                    wait_until = time.monotonic() + stale_after_s + heartbeat_s
                    if log:
                        log(f"lctrain: the run dir lock is held by this job's previous start "
                            f"({state.holder.describe()}, {state.why}); waiting up to "
                            f"{stale_after_s + heartbeat_s:.0f} s for its heartbeat to stop")
                if time.monotonic() < wait_until:
                    time.sleep(min(1.0, heartbeat_s))
                    continue
            raise RunDirLocked(locked_message(run_dir, state))
    except OSError as e:
        raise ConfigError([f"hydra.run.dir={run_dir}: cannot create its lock file {path}: {e}; "
                           "set hydra.run.dir to a writable directory"],
                          header="the run dir is not writable") from e


def locked_message(run_dir: Path, state: LockState) -> str:
    """The refusal: who holds the run dir, and what to do about it."""
    h = state.holder
    if h is None:
        return (f"hydra.run.dir={run_dir} is being locked by another lctrain job right now "
                f"({RunDir(run_dir).lock} is {state.why}); wait for it or set hydra.run.dir to "
                "another directory")
    scancel = f", or `scancel {h.slurm_job_id}`" if h.slurm_job_id else ""
    return (f"hydra.run.dir={run_dir} is in use by another lctrain job: {h.describe()} "
            f"({state.why}; lock file {RunDir(run_dir).lock}). Two jobs in one run dir would "
            f"overwrite each other's checkpoints: wait for it to end, stop it (`kill -TERM "
            f"{h.pid}` on {h.host}{scancel}: it checkpoints and exits), or set hydra.run.dir to "
            "another directory")


def _create(path: Path, me: Holder) -> bool:
    """O_EXCL-create the lock holding `me`; False when a lock exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(asdict(me), indent=1).encode() + b"\n")
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(path)  # ours, and unreadable: never leave it behind
        raise
    os.close(fd)
    return True


def _take_over(path: Path, state: LockState) -> bool:
    """Remove the stale lock `state` describes, if it is still there and no other contender is
    removing it; True when this call removed it (the caller then races to create it)."""
    marker = _claim(path, state.ident)
    if marker is None:
        time.sleep(0.02)  # another contender is at it
        return False
    try:
        again = inspect(path.parent, now=0.0)  # only its ident matters: no probe file
        if again is None or again.ident != state.ident:
            return False  # taken over and perhaps re-taken already
        os.unlink(path)
        for old in path.parent.glob(f"{path.name}.takeover-{state.ident}-*"):
            old.unlink(missing_ok=True)  # its lock is gone: no contender can use them
        return True
    except FileNotFoundError:
        return False
    finally:
        marker.unlink(missing_ok=True)


def _claim(path: Path, ident: str) -> Path | None:
    """O_EXCL-create the takeover marker of the lock `ident`; None when a live one exists."""
    for attempt in itertools.count():
        marker = path.with_name(f"{path.name}.takeover-{ident}-{attempt}")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return marker
        except FileExistsError:
            try:
                age = _fs_now(path.parent) - marker.stat().st_mtime
            except FileNotFoundError:
                return None  # its contender has just finished
            if age < TAKEOVER_S:
                return None
    raise AssertionError("unreachable")


def _read_holder(path: Path) -> Holder | None:
    with open(path) as f:
        return Holder.from_json(f.read())


def _fs_now(directory: Path) -> float:
    """The file server's current time: the mtime of a file created now (the local clock if the
    directory cannot be written)."""
    probe = directory / f"{LOCK_FILE}.now-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def _alive(pid: int, start_time: int | None) -> bool:
    """Whether `pid` on this machine still is the process that took the lock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    stat = _proc_stat(pid)
    if stat is None:
        return True  # it exists, and /proc cannot say more (hidepid, not Linux)
    state, started = stat
    return state not in ("Z", "X") and (start_time is None or started == start_time)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from /proc/PID/stat, or None."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and ')'
    return fields[0], int(fields[19])  # fields 3 and 22, counting from 1


def _start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
