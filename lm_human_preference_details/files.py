"""Outputs written atomically, so that a kill or a full disk never leaves a half-written one, and the error raised
when one cannot be written: a file (a temporary file, then a rename), a directory (fsync'ed in a temporary sibling,
then renamed into place), a model directory's files (each moved into place by a rename, under a marker file that the
project's loaders refuse, so a half-replaced model is never loaded silently)."""

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

SAVING_MARKER = ".saving"
"""present in a model directory while its files are being replaced; the project's loaders refuse such a directory"""


class OutputError(OSError):
    """An output cannot be written (no permission, read-only, disk full); nothing partial was left behind."""


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
        reason = "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise OutputError(f"could not write '{path}' ({flag}): {reason}; it is unchanged. Free space or fix it.") from e


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
    SAVING_MARKER, so no file is ever half written and a kill between two renames leaves a marked directory; on an
    error in the block the temporary directory is deleted and `output_dir` is left as it was."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, ".partial-save")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    marker = os.path.join(output_dir, SAVING_MARKER)
    with open(marker, "w", encoding="utf-8") as f:
        f.write("a save of this model was interrupted; its files may come from two saves\n")
        os.fsync(f.fileno())
    fsync_dir(output_dir)
    for name in sorted(os.listdir(tmp)):
        source, target = os.path.join(tmp, name), os.path.join(output_dir, name)
        if os.path.isdir(source):
            publish_directory(source, target)
        else:
            os.replace(source, target)
    fsync_dir(output_dir)
    os.remove(marker)
    fsync_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)


def check_complete_save(directory: str, flag: str) -> None:
    """ValueError when `directory` holds a model whose save was interrupted (SAVING_MARKER is present)."""
    if os.path.exists(os.path.join(directory, SAVING_MARKER)):
        raise ValueError(
            f"'{directory}' ({flag}) holds a model whose save was interrupted, so its files may come from two saves; "
            f"rerun the training script with --resume auto to write it again, or use a checkpoint of "
            f"{os.path.join(directory, 'training_state')}."
        )
