"""checkpoint.py: atomic writes, tidying what an interrupted save left, and the output directory's lock.

Elsewhere, end to end through the scripts: a killed and resumed run equals an uninterrupted one, a failed checkpoint
write keeps the previous one, changed settings and used output directories in tests/test_resume.py; damaged
checkpoints in tests/test_damaged_checkpoints.py; one run per --output_dir in tests/test_output_dir_lock.py; the save
on a stop signal in tests/test_stop_signal.py. The RNG states across devices and the background saves off the GPU are
in tests/test_gpu_resilience.py; the settings check of a task's truncation id (`setting_differences`) in
tests/test_tasks.py.
"""

import errno
import json
import os

import pytest

from lm_human_preference_details import checkpoint
from tests.planted import lock_record

# ---------------------------------------------------------------- atomic writes


def test_atomic_files_keep_the_old_files_on_error(tmp_path):
    target = tmp_path / "model"
    with checkpoint.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 1}))
    with pytest.raises(RuntimeError), checkpoint.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 2}))
        raise RuntimeError("killed mid-write")
    assert json.loads((target / "a.json").read_text()) == {"v": 1}
    assert os.listdir(target) == ["a.json"]  # no partial directory, no marker


# ---------------------------------------------------------------- what an interrupted save left


def test_a_cut_replace_gets_its_checkpoint_back(tmp_path, capsys):
    # killed between the two renames of a replace: step2 is gone, its previous copy is .step2.old
    root = checkpoint.state_dir(str(tmp_path))
    os.makedirs(os.path.join(root, ".step2.old"))
    assert checkpoint.clean_interrupted_saves(str(tmp_path)) == (
        f"{root}: restored step2 from its .old copy, left by a run stopped while it saved a checkpoint"
    )
    assert os.listdir(root) == ["step2"]
    assert checkpoint.clean_interrupted_saves(str(tmp_path)) is None


# ---------------------------------------------------------------- the output directory's lock


def test_a_filesystem_without_file_locks_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(checkpoint.fcntl, "flock", no_locks)
    for _ in range(2):
        assert not checkpoint.lock_output_dir(str(tmp_path / "lustre"))  # not held: interrupted saves stay untouched
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    where = tmp_path / "lustre"
    assert f"--output_dir '{where}' is on a filesystem without file locks (Function not implemented)" in err
    checkpoint.release_output_dir_locks()


def test_a_released_lock_leaves_the_output_dir_as_it_found_it(tmp_path):
    new, used = tmp_path / "new", tmp_path / "used"
    used.mkdir()
    for directory in (new, used):
        checkpoint.lock_output_dir(str(directory))
        assert lock_record(directory)["pid"] == os.getpid()
    checkpoint.lock_output_dir(str(new))  # held already by this process: nothing to do
    checkpoint.release_output_dir_locks()
    assert not new.exists() and os.listdir(used) == []
