"""Outputs written atomically, so that a kill or a full disk never leaves a half-written one, and the error raised
when one cannot be written: a file (a temporary file, then a rename), a directory (fsync'ed in a temporary sibling,
then renamed into place), a model directory's files (each moved into place by a rename, under a marker file that the
project's loaders refuse, so a half-replaced model is never loaded silently)."""

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

SAVING_MARKER = ".saving"
"""present in a model directory while its files are being replaced; the project's loaders refuse such a directory"""


class OutputError(OSError):
    """An output cannot be written (no permission, read-only, disk full); nothing partial was left behind."""


# ---------------------------------------------------------------- what a failed write raises

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""a full filesystem, or the user's quota on it used up"""
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""how Rust's io::Error ends its text: safetensors' SafetensorError ("Error while serializing: I/O error: No space left
on device (os error 28)") and the tokenizers' Exception ("No space left on device (os error 28)") carry no errno"""
_TORCH_SHORT_WRITE = ("unexpected pos", "file write failed")
"""the RuntimeError of torch's zip writer when a write to a file path stops short ("[enforce fail at
inline_container.cc:672] . unexpected pos 576 vs 534"); its errno is lost (a file object's write keeps it:
`checkpoint.save_torch`)"""
SHORT_WRITE_FULL_BYTES = 1 << 20
"""a short torch write with less free space than this on the filesystem ran out of space"""


def free_bytes(path: str) -> int | None:
    """Bytes a process can still write on the filesystem of `path` (or of its nearest existing parent); None when
    that cannot be told."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        stat = os.statvfs(existing)
    except OSError:
        return None
    return (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize


def write_error(error: BaseException, path: str | None = None) -> OSError | None:
    """The OSError behind a failed write, wherever the writing library put it, None when `error` is no failed write:
    the error itself or one it chains (torch's zip writer raises RuntimeError "unexpected pos ..." from the file
    object's OSError), the failure of each process in torch.distributed.checkpoint's CheckpointException, or the
    errno in the text of Rust's io::Error (safetensors, tokenizers). A short write of torch to a file path (no errno)
    is ENOSPC when the filesystem of `path` has almost no space left, EIO otherwise."""
    pending, seen, short = [error], set(), None
    while pending:
        e = pending.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        if match := _RUST_OS_ERROR.search(str(e)):
            number = int(match.group(1))
            return OSError(number, os.strerror(number))
        if isinstance(e, RuntimeError) and any(text in str(e) for text in _TORCH_SHORT_WRITE):
            short = short or e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            pending += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
        pending += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    if short is None:
        return None
    free = free_bytes(path) if path is not None else None
    if free is not None and free < SHORT_WRITE_FULL_BYTES:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return OSError(errno.EIO, f"the write stopped short ({str(short).strip()})")


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed because its filesystem is full (or the quota used up)."""
    cause = write_error(error)
    return cause is not None and cause.errno in DISK_FULL_ERRNOS


def reason(error: OSError) -> str:
    """A failed write's reason in a few words: "disk full", or the system's text."""
    return "disk full" if error.errno in DISK_FULL_ERRNOS else error.strerror or str(error)


class WriteFailed(OutputError):
    """`what` could not be written into `output_dir` (`cause`: the system's error); `kept`: what its writer left on
    disk (nothing partial); `retry`: how to write it once the cause is fixed. A training script ends with
    `stopped_run`'s line instead, which adds the newest checkpoint and --resume auto."""

    def __init__(
        self,
        what: str,
        output_dir: str,
        cause: OSError,
        kept: str = "nothing partial was left",
        retry: str = "run the same command again",
    ):
        self.what, self.output_dir, self.cause, self.kept = what, output_dir, cause, kept
        self.disk_full = cause.errno in DISK_FULL_ERRNOS
        super().__init__(f"{self.headline()}; {kept}. {self.fix()}, then {retry}.")

    def headline(self) -> str:
        """`disk full: could not write WHAT in --output_dir 'DIR'` (another error: its text at the end)."""
        where = f"could not write {self.what} in --output_dir '{self.output_dir}'"
        return f"disk full: {where}" if self.disk_full else f"{where} ({reason(self.cause)})"

    def fix(self) -> str:
        """What the user does first."""
        return "Free space there" if self.disk_full else "Fix that"

    def stopped_run(self, intact: str) -> OutputError:
        """The line that ends a training run: the headline, what is left and `intact` (the newest checkpoint), and
        how to continue."""
        return OutputError(
            f"{self.headline()}; {self.kept}, and {intact}. {self.fix()}, then run the same command with --resume auto."
        )


@contextlib.contextmanager
def failed_write(what: str, output_dir: str, path: str | None = None) -> Iterator[None]:
    """Within it, an error of a write (`write_error`, torch.distributed.checkpoint's BaseException included) becomes
    WriteFailed of `what` in `output_dir`; `path`: where it wrote (whose free space tells a short torch write)."""
    try:
        yield
    except WriteFailed:
        raise
    except BaseException as e:
        cause = write_error(e, path or output_dir)
        if cause is None:
            raise
        raise WriteFailed(what, output_dir, cause) from e


def write_atomic(path: str, write: Callable[[Any], None], flag: str = "the output") -> None:
    """`write(file)` into `path` through a temporary file and a rename, so readers never see a half-written file; on
    failure (e.g. disk full) the temporary file is removed, `path` is unchanged, and OutputError says why."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        message = f"could not write '{path}' ({flag}): {reason(e)}; it is unchanged. Free space or fix it."
        raise OutputError(message) from e


def write_json_atomic(path: str, obj: Any) -> None:
    """json.dump to `path` through a temporary file and a rename, so readers never see a half-written file."""
    write_atomic(path, lambda f: json.dump(obj, f, indent=2))


# ---------------------------------------------------------------- directories


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path` (and `path` itself), so a rename after it publishes whole files."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def fsync_dir(path: str) -> None:
    """fsync a directory's entries (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary_sibling(path: str, tag: str) -> str:
    """`.NAME.TAG` beside `path`: on the same filesystem, so that a rename moves it into place atomically."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{tag}")


def publish_directory(tmp: str, path: str) -> None:
    """fsync `tmp`, then rename it to `path` (an existing `path` is moved aside first and deleted after)."""
    fsync_tree(tmp)
    old = temporary_sibling(path, "old")
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(output_dir: str) -> Iterator[str]:
    """Yield a temporary directory; its entries then replace those of `output_dir` one rename each, under
    SAVING_MARKER, so no file is ever half written and a kill between two renames leaves a marked directory. On an
    error (in the block, or while the files are fsync'ed or moved) the temporary directory is deleted; before the
    first rename `output_dir` is left as it was, after it the marker stays."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, ".partial-save")
    marker = os.path.join(output_dir, SAVING_MARKER)
    marked = os.path.exists(marker)  # an earlier interrupted save's marker stays until a save completes
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        with open(marker, "w", encoding="utf-8") as f:
            f.write("a save of this model was interrupted; its files may come from two saves\n")
            os.fsync(f.fileno())
        fsync_dir(output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not marked:
            with contextlib.suppress(OSError):
                os.remove(marker)
        raise
    try:
        for name in sorted(os.listdir(tmp)):
            source, target = os.path.join(tmp, name), os.path.join(output_dir, name)
            if os.path.isdir(source):
                publish_directory(source, target)
            else:
                os.replace(source, target)
        fsync_dir(output_dir)
        os.remove(marker)
        fsync_dir(output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_complete_save(directory: str, flag: str) -> None:
    """ValueError when `directory` holds a model whose save was interrupted (SAVING_MARKER is present)."""
    if os.path.exists(os.path.join(directory, SAVING_MARKER)):
        raise ValueError(
            f"'{directory}' ({flag}) holds a model whose save was interrupted, so its files may come from two saves; "
            f"rerun the training script with --resume auto to write it again, or use a checkpoint of "
            f"{os.path.join(directory, 'training_state')}."
        )
