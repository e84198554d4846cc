"""Output files written atomically (a temporary file, then a rename), and the error raised when one cannot be."""

import errno
import json
import os
from collections.abc import Callable
from typing import Any


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
