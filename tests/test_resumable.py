"""lm_human_preference_details/resumable.py: process 0's decision whether and from where a run resumes.

Elsewhere, end to end through the scripts: a killed and resumed run equals an uninterrupted one, changed settings and
used output directories in tests/test_resume.py; the save on a stop signal in tests/test_stop_signal.py; a process
that cannot see process 0's checkpoint stops every process in tests/test_gpu_resilience.py; the number of processes,
which may change on --resume under --fsdp only, in tests/test_fsdp_reward.py; the settings check of a task's truncation
id (`setting_differences`) in tests/test_tasks.py."""

import re

from lm_human_preference_details import resumable
from lm_human_preference_details.settings import RunSettings
from tests.planted import fake_checkpoint


class OneProcess:
    """The part of an Accelerator that start_or_resume uses, for a one-process run; prints into `printed`."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self):
        self.printed: list[str] = []

    def print(self, text: str) -> None:
        self.printed.append(text)


def resume_args(output_dir, resume: str | None) -> RunSettings:
    return RunSettings(output_dir=str(output_dir), resume=resume)


def test_resume_auto_without_a_checkpoint_says_the_run_starts_fresh(tmp_path):
    accelerator = OneProcess()
    assert resumable.start_or_resume(resume_args(tmp_path / "mistyped", "auto"), {}, {}, (), accelerator, 4) is None
    assert len(accelerator.printed) == 1
    assert re.search(r"--resume auto found no checkpoint in '.*mistyped/training_state': the run starts fresh \(check "
                     r"--output_dir", accelerator.printed[0])  # fmt: skip
    fake_checkpoint(tmp_path / "run", 2, 1)
    resumed = resumable.start_or_resume(resume_args(tmp_path / "run", "auto"), {}, {}, (), accelerator, 4, "update")
    assert resumed.step == 2 and accelerator.printed[-1].startswith("resuming from")
    quiet = OneProcess()
    assert resumable.start_or_resume(resume_args(tmp_path / "new", None), {}, {}, (), quiet, 4) is None
    assert quiet.printed == []  # a fresh run that asked for none: nothing to say
