"""Ctrl-C and SIGTERM: a real signal to a real training script stops it after the current update or step with a
checkpoint and one line; `--resume auto` then finishes the run exactly as an uninterrupted one; a second signal stops
at once; the human labeler ends on Ctrl-C as on `q`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train_policy
import train_reward
from lm_human_preference_details import checkpoint
from tests import test_label_generation, test_resume
from tests.planted import REPO, script_env
from tests.test_label_generation import generate_flags
from tests.test_resume import (
    final_training_state,
    max_metric_difference,
    max_weight_difference,
    policy_flags,
    reward_flags,
    saved_files,
    scalars,
    script_command,
)

pytestmark = pytest.mark.usefixtures("single_thread")
policy_world = test_resume.policy_world
reward_world = test_resume.reward_world
labels_world = test_label_generation.world


def signal_after(command: list[str], marker: str, signum: int, repeat: int = 1, timeout: float = 300):
    """Start `command`, send `signum` (`repeat` times) once `marker` appears in its output or exists as a path; ->
    (exit code, output, seconds from the first signal to the exit)."""
    env = {**script_env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    seen, deadline = [], time.time() + timeout
    if os.path.isabs(marker):
        while not os.path.exists(marker) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
    else:
        for line in proc.stdout:
            seen.append(line)
            if marker in line or time.time() > deadline:
                break
    sent = time.time()
    for _ in range(repeat):
        proc.send_signal(signum)
        time.sleep(0.05)
    rest = proc.stdout.read()
    proc.wait()
    return proc.returncode, "".join(seen) + rest, time.time() - sent


def last_line(output: str) -> str:
    """The last non-empty line of a run's output."""
    return [line for line in output.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_policy_sigint_saves_and_resume_auto_finishes_like_an_uninterrupted_run(
    tmp_path, tiny_model_dir, policy_world, capsys
):
    # 4 updates, checkpoints only at the end: whatever update the signal lands in, its checkpoint is the stop's own
    sizes = ("--ppo.total_episodes", "32", "--save_interval", "0")
    train_policy.main(train_policy.parse(policy_flags(tiny_model_dir, policy_world, tmp_path / "whole", *sizes)))
    stopped = tmp_path / "stopped"
    flags = policy_flags(tiny_model_dir, policy_world, stopped, *sizes)
    code, output, _ = signal_after(script_command("train_policy.py", flags), "update 0", signal.SIGINT)
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output
    (step, path), *_ = checkpoint.list_checkpoints(str(stopped))
    assert 1 <= step < 4 and len(checkpoint.list_checkpoints(str(stopped))) == 1
    assert last_line(output) == (
        f"stopped by SIGINT after update {step} of 4; checkpoint {path}; continue with the same command and "
        "--resume auto"
    )
    capsys.readouterr()
    train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    assert f"resuming from {path} after {step} of 4" in capsys.readouterr().out
    assert max_metric_difference(scalars(stopped), scalars(tmp_path / "whole"), 0) <= 1e-6
    names = ("model.safetensors", "value_head.safetensors")
    assert max_weight_difference(saved_files(stopped, names), saved_files(tmp_path / "whole", names)) <= 1e-6
    assert max_weight_difference(final_training_state(stopped), final_training_state(tmp_path / "whole")) <= 1e-6


@pytest.mark.slow
def test_reward_sigterm_saves_and_resume_auto_finishes_like_an_uninterrupted_run(
    tmp_path, tiny_model_dir, reward_world
):
    train_reward.main(train_reward.parse(reward_flags(tiny_model_dir, reward_world, tmp_path / "whole")))
    # a checkpoint every step; the signal comes once the first is on disk
    stopped = tmp_path / "stopped"
    flags = reward_flags(tiny_model_dir, reward_world, stopped, "--save_interval", "1", "--keep_checkpoints", "0")
    first = checkpoint.step_dir(str(stopped), 1)
    code, output, _ = signal_after(script_command("train_reward.py", flags), first, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    step, path = checkpoint.list_checkpoints(str(stopped))[-1]
    assert 1 <= step < 6 and not os.path.exists(stopped / "reward_model.json")
    assert last_line(output) == (
        f"stopped by SIGTERM after step {step} of 6; checkpoint {path}; continue with the same command and "
        "--resume auto"
    )
    train_reward.main(train_reward.parse([*flags, "--resume", "auto"]))
    assert max_metric_difference(scalars(stopped), scalars(tmp_path / "whole"), 0) <= 1e-6
    model = ("model.safetensors",)
    assert max_weight_difference(saved_files(stopped, model), saved_files(tmp_path / "whole", model)) <= 1e-6
    assert (stopped / "reward_model.json").read_text() == (tmp_path / "whole" / "reward_model.json").read_text()


def test_second_ctrl_c_stops_at_once(tmp_path):
    # a process waiting in a long step with the scripts' handler: only the second signal can end it quickly
    code = (
        "import time; from lm_human_preference_details import cli; "
        f"cli.StopSignal('update', {str(tmp_path)!r}).install(); print('training', flush=True); time.sleep(120)"
    )
    exit_code, output, seconds = signal_after([sys.executable, "-c", code], "training", signal.SIGINT, 2)
    assert exit_code == 128 + signal.SIGINT and "Traceback" not in output, output
    assert output.splitlines()[1:] == [
        "SIGINT: stopping after the current update with a checkpoint; press Ctrl-C again to stop at once",
        f"SIGINT again: stopped at once; continue from the last checkpoint in {tmp_path} with the same command and "
        "--resume auto",
    ]
    assert seconds < 20


def test_a_process_that_cannot_finish_its_step_exits_after_its_patience(tmp_path):
    # torchrun SIGTERMs the survivors of a failed process: one that never reaches the next reduction (its peers are
    # gone) must not wait for torchrun's SIGKILL, and exits once --dist_timeout (the patience) has passed
    code = (
        "import time; from lm_human_preference_details import cli; "
        f"cli.StopSignal('update', {str(tmp_path)!r}, patience=1.0).install(); print('training', flush=True); "
        "time.sleep(120)"
    )
    exit_code, output, seconds = signal_after([sys.executable, "-c", code], "training", signal.SIGTERM)
    assert exit_code == 128 + signal.SIGTERM and "Traceback" not in output, output
    assert output.splitlines()[-1] == (
        "SIGTERM 1 s ago, and the update has not finished (--dist_timeout): stopped at once; continue from the last "
        f"checkpoint in {tmp_path} with the same command and --resume auto"
    )
    assert 1.0 <= seconds < 20


@pytest.mark.slow
def test_human_labeler_ctrl_c_at_the_prompt_stops_as_q_does(tmp_path, labels_world):
    output = tmp_path / "human.json"
    flags = generate_flags(labels_world, output, "--labeler", "human", "--num_queries", "4", "--num_labels", "3")
    env = {**script_env(), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(REPO / "label_generation.py"), *flags]
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    seen = b""
    for prompts in (1, 2):  # answer the first row, then Ctrl-C at the second prompt
        while seen.count(b"best response [0-2]") < prompts and proc.poll() is None:
            seen += os.read(proc.stdout.fileno(), 4096)
        if prompts == 1:
            proc.stdin.write(b"2\n")
            proc.stdin.flush()
    time.sleep(0.2)  # the labeler waits for the answer
    proc.send_signal(signal.SIGINT)
    seen += proc.stdout.read()
    proc.wait()
    text = seen.decode()
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
    assert "stopped: 1 of 4 rows" in text
    assert [row["best"] for row in json.loads(output.read_text())] == [2]
