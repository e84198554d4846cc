"""A real full filesystem for the tests: a small tmpfs mounted in the test's directory (root, or CAP_SYS_ADMIN; the
tests that need one skip with the reason where mounting is not permitted), filled up to ENOSPC."""

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

MiB = 1 << 20


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def small_filesystem(path, mib: int) -> Iterator[str]:
    """A tmpfs of `mib` MiB mounted at `path` (created), unmounted at the end; skips the test where it cannot be
    mounted."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("a full filesystem is a small tmpfs, and this machine has no mount command")
    done = _mount("-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"a full filesystem is a small tmpfs, which cannot be mounted here: {done.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def grow(path, mib: int) -> None:
    """Give the tmpfs at `path` `mib` MiB (what a user does when they free space)."""
    done = _mount("-o", f"remount,size={mib}m", str(path))
    assert done.returncode == 0, done.stderr


def fill(directory, leave: int = 0) -> str:
    """Fill the filesystem of `directory` with one file, up to ENOSPC, then give `leave` bytes back; -> the file."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    block = b"\0" * MiB
    try:
        while True:
            os.write(fd, block)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    if leave:
        os.truncate(path, max(0, os.path.getsize(path) - leave))
    return path
