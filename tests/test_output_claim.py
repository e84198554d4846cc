"""lm_human_preference_details/output_claim.py: the output directory's lock on a filesystem without file locks, and
a released lock.

Elsewhere, end to end through the scripts: one run per --output_dir (a run beside a live one, two runs started at the
same instant, a killed run's lock) in tests/test_output_dir_lock.py; used output directories, --resume auto and
--overwrite_output_dir in tests/test_resume.py."""

import errno
import os

from lm_human_preference_details import output_claim
from tests.planted import lock_record


def test_a_filesystem_without_file_locks_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(output_claim.fcntl, "flock", no_locks)
    for _ in range(2):
        assert not output_claim.lock_output_dir(str(tmp_path / "lustre"))  # not held: interrupted saves stay untouched
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    where = tmp_path / "lustre"
    assert f"--output_dir '{where}' is on a filesystem without file locks (Function not implemented)" in err
    output_claim.release_output_dir_locks()


def test_a_released_lock_leaves_the_output_dir_as_it_found_it(tmp_path):
    new, used = tmp_path / "new", tmp_path / "used"
    used.mkdir()
    for directory in (new, used):
        output_claim.lock_output_dir(str(directory))
        assert lock_record(directory)["pid"] == os.getpid()
    output_claim.lock_output_dir(str(new))  # held already by this process: nothing to do
    output_claim.release_output_dir_locks()
    assert not new.exists() and os.listdir(used) == []
