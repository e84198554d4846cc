"""lm_human_preference_details/files.py: outputs written atomically, a model directory whose save was interrupted
refused with the way out.

Elsewhere, end to end: a failed write of an output keeps the old one (tests/test_user_errors.py); a kill between two
file renames of the final policy leaves a directory that the loaders refuse, which --resume auto writes again
(tests/test_resume.py)."""

import json
import os

import pytest

from lm_human_preference_details import checkpoint, files


def test_atomic_files_keep_the_old_files_on_error(tmp_path):
    target = tmp_path / "model"
    with files.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 1}))
    with pytest.raises(RuntimeError), files.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 2}))
        raise RuntimeError("killed mid-write")
    assert json.loads((target / "a.json").read_text()) == {"v": 1}
    assert os.listdir(target) == ["a.json"]  # no partial directory, no marker


def test_a_model_whose_save_was_interrupted_is_refused_naming_its_checkpoints(tmp_path):
    model = tmp_path / "model"
    with files.atomic_files(str(model)) as tmp:
        open(os.path.join(tmp, "config.json"), "w").write("{}")
    files.check_complete_save(str(model), "--base_model")  # whole: accepted
    (model / files.SAVING_MARKER).touch()  # a kill between two of its renames
    with pytest.raises(ValueError) as excinfo:
        files.check_complete_save(str(model), "--base_model")
    message = str(excinfo.value)
    assert message.startswith(f"'{model}' (--base_model) holds a model whose save was interrupted")
    assert message.endswith(f"or use a checkpoint of {checkpoint.state_dir(str(model))}.")
