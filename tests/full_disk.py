"""A real full filesystem for the tests: a small tmpfs mounted in the test's directory (as root, or through `sudo -n`
where the user may, as on CI; the tests that need one skip with the reason where mounting is not permitted), filled up
to ENOSPC."""

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

MiB = 1 << 20


def _as_root() -> list[str]:
    """What runs a command as root: nothing for root, `sudo -n` for a user who may use it without a password."""
    if os.geteuid() == 0 or shutil.which("sudo") is None:
        return []
    return ["sudo", "-n"] if subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0 else []


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_as_root(), "mount", *args], capture_output=True, text=True)


@contextlib.contextmanager
def small_filesystem(path, mib: int) -> Iterator[str]:
    """A tmpfs of `mib` MiB mounted at `path` (created), unmounted at the end; skips the test where it cannot be
    mounted."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("a full filesystem is a small tmpfs, and this machine has no mount command")
    owner = f"uid={os.getuid()},gid={os.getgid()}"  # the test's user writes there, under sudo too
    done = _mount("-t", "tmpfs", "-o", f"size={mib}m,{owner}", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"a full filesystem is a small tmpfs, which cannot be mounted here: {done.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run([*_as_root(), "umount", "-l", str(path)], capture_output=True)


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
