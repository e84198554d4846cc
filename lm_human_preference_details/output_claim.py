"""A run's claim on its --output_dir: one run at a time writes there (process 0 holds an advisory lock on
OUTPUT_DIR/.lock for the whole run, released by `resumable.one_run_per_output_dir`), and a starting run finds what an
earlier run left there and decides: continue its checkpoint (--resume), replace it (--overwrite_output_dir) or stop."""

import contextlib
import datetime
import errno
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass

from lm_human_preference_details.checkpoint import (
    META_FILE,
    STATE_DIR,
    clean_interrupted_saves,
    damaged_message,
    find_damage,
    list_checkpoints,
    newest_intact_checkpoint,
)

try:
    import fcntl
except ImportError:  # Windows: no advisory lock on the output directory
    fcntl = None

LOCK_FILE = ".lock"
"""in OUTPUT_DIR while a run writes there: process 0 holds an advisory lock on it and records who it is"""
MODEL_MARKERS = ("config.json", "model.safetensors", "reward_model.json", "value_head.safetensors")
"""files that show a directory already holds a saved model"""


# ---------------------------------------------------------------- one run per output directory


@dataclass
class _HeldLock:
    """This process's lock on an output directory."""

    path: str
    """OUTPUT_DIR/.lock"""
    fd: int
    created: str | None
    """OUTPUT_DIR when the lock created it (removed again at release when the run left it empty)"""


_held_locks: dict[str, _HeldLock] = {}
"""the output directories this process holds, by real path"""
_unlocked_dirs: set[str] = set()
"""output directories on filesystems without file locks, already warned about"""
_NO_LOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
"""what flock raises on a filesystem without (cluster) file locks: Lustre mounted without -o flock, some FUSE ones"""


def _holder(fd: int) -> str:
    """Who holds the lock, from the lock file's record (waits a moment for a holder that is still writing it)."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return f"{record['script']}, pid {record['pid']} on host {record['host']}, started {record['started']}"
        except (ValueError, KeyError, OSError):
            time.sleep(0.05)
    return "its process did not say who it is"


def lock_output_dir(output_dir: str) -> bool:
    """Take the advisory lock on OUTPUT_DIR/.lock for this process (held until `release_output_dir_locks` or the
    process ends: the OS releases the lock of a killed process, so a crash never leaves it stuck). ValueError
    naming the holder when another run holds it; a warning, once, where the filesystem has no file locks.
    -> whether this process holds the lock (False without file locks)."""
    key = os.path.realpath(output_dir)
    if key in _held_locks:
        return True
    if fcntl is None:
        return False
    created = None if os.path.isdir(output_dir) else output_dir
    path = os.path.join(output_dir, LOCK_FILE)
    while True:
        os.makedirs(output_dir, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by a run releasing it: create it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(
                f"another run ({holder}) holds --output_dir '{output_dir}' (its {LOCK_FILE} is locked); wait for it "
                "to end, or choose another --output_dir."
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCK_ERRNOS:
                raise
            if key not in _unlocked_dirs:
                _unlocked_dirs.add(key)
                _warn_no_locks(output_dir, e)
            return False
        # a run releasing the lock unlinks the file: holding an unlinked file's lock excludes nobody, so try again
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        os.close(fd)
    record = {
        "script": os.path.basename(sys.argv[0]) or "python",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
    _held_locks[key] = _HeldLock(path, fd, created)
    return True


def _warn_no_locks(output_dir: str, error: OSError) -> None:
    """Say that nothing keeps a second run out of `output_dir`."""
    print(
        f"warning: --output_dir '{output_dir}' is on a filesystem without file locks ({error.strerror}), so nothing "
        "stops a second run from writing there at the same time; give each run its own --output_dir (see "
        "docs/reliability.md)",
        file=sys.stderr,
        flush=True,
    )


def release_output_dir_locks() -> None:
    """Release every output-directory lock this process holds: the lock file is unlinked, then unlocked, and an
    output directory that the lock created and the run left empty is removed."""
    for key in list(_held_locks):
        held = _held_locks.pop(key)
        with contextlib.suppress(OSError):
            os.unlink(held.path)
        os.close(held.fd)
        if held.created is not None:
            with contextlib.suppress(OSError):
                os.rmdir(held.created)


# ---------------------------------------------------------------- what an earlier run left, and the claim


def previous_run(output_dir: str) -> list[str]:
    """What in `output_dir` shows an earlier run: checkpoints, a saved model, TensorBoard logs."""
    found = [STATE_DIR] if list_checkpoints(output_dir) else []
    found += [name for name in (*MODEL_MARKERS, "tb") if os.path.exists(os.path.join(output_dir, name))]
    return found


def clear_previous_run(output_dir: str) -> None:
    """Delete an earlier run's checkpoints, policy snapshots and TensorBoard logs (for --overwrite_output_dir)."""
    for name in (STATE_DIR, "checkpoints", "tb"):
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def resolve_resume(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """The checkpoint directory to continue (--resume PATH, or `auto`: the newest intact one in output_dir, damaged
    newer ones moved aside), None for a fresh start; ValueError when a fresh run would overwrite another run's
    output_dir without `overwrite`, or when --resume PATH names a damaged checkpoint."""
    if resume == "auto":
        resume = newest_intact_checkpoint(output_dir)
        if resume is None and set(previous_run(output_dir)) - {"tb"}:
            raise ValueError(
                f"--resume auto: '{output_dir}' holds a run ({', '.join(previous_run(output_dir))}) but no checkpoint "
                f"in {STATE_DIR}/; pass --overwrite_output_dir to start again there, or choose another --output_dir."
            )
        return resume
    if resume is not None:
        if not os.path.isfile(os.path.join(resume, META_FILE)):
            raise FileNotFoundError(
                f"--resume '{resume}' is not a checkpoint ('{META_FILE}' is missing); pass a directory of "
                f"OUTPUT_DIR/{STATE_DIR}/ or --resume auto."
            )
        if (damage := find_damage(resume)) is not None:
            raise ValueError(damaged_message(damage))
        return resume
    found = previous_run(output_dir)
    if found and not overwrite:
        raise ValueError(
            f"--output_dir '{output_dir}' already holds another run ({', '.join(found)}); pass --resume auto to "
            "continue it, --overwrite_output_dir to replace it, or choose another --output_dir."
        )
    return None


def claim_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """Process 0's start in `output_dir`: take its lock (one run at a time), tidy what an interrupted checkpoint write
    left (only under the lock: without one, a live run may be writing it), then `resolve_resume`."""
    if lock_output_dir(output_dir) and (tidied := clean_interrupted_saves(output_dir)):
        print(tidied, flush=True)
    return resolve_resume(output_dir, resume, overwrite)
