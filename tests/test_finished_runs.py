"""A finished run is a result: the commands the project itself suggests (the same command again, --resume auto,
--allow_resume_changes, train_both.py run twice) report it and keep every file of it; a setting that changes what a
checkpoint holds is never let into it; a start that saved nothing leaves nothing that blocks its rerun, and a signal
before the first step says so in one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_policy
import train_reward
import train_sft
from lm_human_preference_details import checkpoint, cli, resumable
from tests.planted import REPO, file_digests, script_env
from tests.test_user_errors import one_error_line, policy_argv, reward_argv, run_cli, world, write_label_rows

__all__ = ["world"]  # the module-scoped fixture of tests/test_user_errors.py: a query file and reward models

pytestmark = pytest.mark.usefixtures("single_thread")

TWO_UPDATES = ("--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--save_interval", "1", "--keep_checkpoints", "0")
DIVERGING = (
    *("--ppo.total_episodes", "24", "--ppo.batch_size", "8", "--ppo.lr", "0.3", "--save_interval", "1"),
    *("--keep_checkpoints", "0", "--rewards.adaptive_kl.target", "3", "--divergence_updates", "2"),
)
"""a tiny run 80 nats from its reference at update 1 and 67 at update 2: diverged at update 2 (10 x target 3 = 30)"""
REWARD_TASK = ("--task.query_length", "16", "--task.response_length", "8", "--task.start_text", "None")
"""the label rows' lengths"""


@pytest.fixture(scope="module")
def finished_policy(tmp_path_factory, tiny_model_dir, world):
    """A finished 2-update policy run (a checkpoint after each update), and its command line."""
    output_dir = tmp_path_factory.mktemp("finished-policy") / "run"
    argv = policy_argv(tiny_model_dir, world, output_dir, *TWO_UPDATES)
    history = train_policy.main(train_policy.parse(argv))
    assert len(history) == 2
    return output_dir, argv


@pytest.fixture(scope="module")
def diverged_policy(tmp_path_factory, tiny_model_dir, world):
    """A finished 3-update policy run that diverged at update 2, and its command line."""
    output_dir = tmp_path_factory.mktemp("diverged-policy") / "run"
    argv = policy_argv(tiny_model_dir, world, output_dir, *DIVERGING)
    with pytest.raises(SystemExit) as stop:
        cli.run(train_policy.main, train_policy.parse, argv)
    assert stop.value.code == 3
    return output_dir, argv


def copy_run(output_dir: Path, destination: Path, argv: list[str]) -> list[str]:
    """A copy of a run's directory, and its command line pointed at the copy."""
    shutil.copytree(output_dir, destination)
    return [*argv[:-1], str(destination)]


# ---------------------------------------------------------------- the same command again


def test_a_finished_run_rerun_reports_its_result_and_keeps_every_file(finished_policy, tmp_path, capsys):
    argv = copy_run(*finished_policy[:1], tmp_path / "run", finished_policy[1])
    before = file_digests(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / resumable.SUMMARY_FILE).read_text())
    code, out, err = run_cli(train_policy, [*argv, "--resume", "auto"], capsys)
    assert code == 0, err
    assert "policy training already finished: kept as it is" in out and "update 0 -> 1" in " ".join(out.split())
    assert (
        file_digests(tmp_path / "run") == before
    )  # summary.json, the policy, the checkpoints, the logs: not a byte changed
    assert json.loads((tmp_path / "run" / resumable.SUMMARY_FILE).read_text()) == summary


def test_a_diverged_run_rerun_ends_diverged_again_and_keeps_its_record(diverged_policy, tmp_path, capsys):
    argv = copy_run(*diverged_policy[:1], tmp_path / "run", diverged_policy[1])
    before = file_digests(tmp_path / "run")
    code, out, err = run_cli(train_policy, [*argv, "--resume", "auto"], capsys)
    assert code == 3, err  # a scheduler that retries a failed job does not turn it into a clean one
    assert err.strip().splitlines()[-1].startswith("the run diverged at update 2")
    assert file_digests(tmp_path / "run") == before
    assert json.loads((tmp_path / "run" / resumable.SUMMARY_FILE).read_text())["diverged"]["update"] == 2


def test_a_divergence_seen_before_a_kill_is_reported_by_the_resumed_run(diverged_policy, tmp_path, capsys):
    # killed after update 1 (its checkpoint step2): 1 update above the limit in a row, one more makes it diverged
    argv = copy_run(*diverged_policy[:1], tmp_path / "run", diverged_policy[1])
    shutil.rmtree(checkpoint.step_dir(str(tmp_path / "run"), 3))
    (tmp_path / "run" / resumable.SUMMARY_FILE).unlink()
    code, out, err = run_cli(train_policy, [*argv, "--resume", "auto"], capsys)
    assert code == 3, err
    assert "diverged at update 2" in " ".join(out.split())
    assert json.loads((tmp_path / "run" / resumable.SUMMARY_FILE).read_text())["diverged"]["update"] == 2


def test_a_final_save_cut_short_is_completed_by_the_rerun(finished_policy, tmp_path, capsys):
    # killed after the last checkpoint, before summary.json: the rerun writes what the uninterrupted run wrote
    argv = copy_run(*finished_policy[:1], tmp_path / "run", finished_policy[1])
    summary_path = tmp_path / "run" / resumable.SUMMARY_FILE
    summary = json.loads(summary_path.read_text())
    summary_path.unlink()
    code, out, err = run_cli(train_policy, [*argv, "--resume", "auto"], capsys)
    assert code == 0, err
    assert json.loads(summary_path.read_text()) == summary
    code, out, err = run_cli(train_policy, [*argv, "--resume", "auto"], capsys)  # now it is finished
    assert code == 0 and "already finished" in out, err


# ---------------------------------------------------------------- settings a finished run or a checkpoint keeps


def test_a_finished_run_refuses_other_settings_even_with_allow_resume_changes(finished_policy, tmp_path, capsys):
    argv = copy_run(*finished_policy[:1], tmp_path / "run", finished_policy[1])
    before = file_digests(tmp_path / "run")
    code, _, err = run_cli(train_policy, [*argv, "--seed", "2", "--resume", "auto", "--allow_resume_changes"], capsys)
    line = one_error_line(code, err)
    assert "finished its 2 steps with other settings: seed: checkpoint 1, now 2" in line
    assert "kept as it is, --allow_resume_changes or not" in line and "another --output_dir" in line
    assert file_digests(tmp_path / "run") == before


def test_settings_the_checkpoint_holds_cannot_change_on_resume(finished_policy, tmp_path, capsys):
    argv = copy_run(*finished_policy[:1], tmp_path / "run", finished_policy[1])
    shutil.rmtree(checkpoint.step_dir(str(tmp_path / "run"), 2))  # killed after update 0: a run to continue
    (tmp_path / "run" / resumable.SUMMARY_FILE).unlink()
    for change in (("--lora.rank", "2"), ("--ppo.value_model", "policy")):
        code, _, err = run_cli(train_policy, [*argv, *change, "--resume", "auto", "--allow_resume_changes"], capsys)
        line = one_error_line(code, err)  # once a load_state_dict traceback
        assert f"{change[0]} cannot change on --resume, --allow_resume_changes or not" in line
        assert "another --output_dir" in line


def test_an_earlier_checkpoint_of_a_finished_run_resumes_only_into_another_directory(finished_policy, tmp_path, capsys):
    argv = copy_run(*finished_policy[:1], tmp_path / "run", finished_policy[1])
    before = file_digests(tmp_path / "run")
    step1 = checkpoint.step_dir(str(tmp_path / "run"), 1)
    code, _, err = run_cli(train_policy, [*argv, "--resume", step1], capsys)
    line = one_error_line(code, err)
    assert "checkpoint 1 of a run that finished its 2 updates" in line and "another --output_dir" in line
    assert file_digests(tmp_path / "run") == before
    code, _, err = run_cli(train_policy, [*argv[:-1], str(tmp_path / "branch"), "--resume", step1], capsys)
    assert code == 0, err
    assert file_digests(tmp_path / "run") == before


def test_finished_reward_and_sft_runs_rerun_report_and_keep_every_file(tmp_path, tiny_model_dir, world, capsys):
    labels = write_label_rows(tmp_path / "labels.json", 48, 16, 8, meta=False)
    argv = reward_argv(tiny_model_dir, world, labels, tmp_path / "reward", *REWARD_TASK, "--normalize_samples", "16")
    code, _, err = run_cli(train_reward, argv, capsys)
    assert code == 0, err
    before = file_digests(tmp_path / "reward")
    assert json.loads((tmp_path / "reward" / resumable.SUMMARY_FILE).read_text())["heldout_rows"] == 16
    code, out, err = run_cli(train_reward, [*argv, "--resume", "auto"], capsys)
    assert code == 0 and "reward training already finished: kept as it is" in out, err
    assert file_digests(tmp_path / "reward") == before  # once normalized again and saved again
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}:", "completion": f" answer {i}"}) + "\n" for i in range(16)))
    sft = [*("--base_model", tiny_model_dir, "--dataset", str(rows), "--batch_size", "8", "--lr", "1e-3")]
    sft += ["--output_dir", str(tmp_path / "sft")]
    code, _, err = run_cli(train_sft, sft, capsys)
    assert code == 0, err
    before = file_digests(tmp_path / "sft")
    code, out, err = run_cli(train_sft, [*sft, "--resume", "auto"], capsys)
    assert code == 0 and "supervised fine-tuning already finished: kept as it is" in out, err
    assert file_digests(tmp_path / "sft") == before


# ---------------------------------------------------------------- a start that saved nothing


def test_sigterm_before_the_first_step_says_nothing_was_saved_and_the_rerun_starts(tmp_path, tiny_model_dir, world):
    # train_reward.py normalizes before it trains: a long normalization, stopped by a scheduler's SIGTERM
    labels = write_label_rows(tmp_path / "labels.json", 32, 16, 8, meta=False)
    argv = reward_argv(
        tiny_model_dir, world, labels, tmp_path / "reward", *REWARD_TASK, "--normalize_samples", "100000"
    )
    env = {**script_env(), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "train_reward.py"), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "reward" / "tb").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # inside the normalization's sampling
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err.decode()
    last = err.decode().strip().splitlines()[-1]
    assert last == "stopped by SIGTERM before the first step: nothing of this run was saved; run the same command again"
    assert not os.path.exists(tmp_path / "reward")  # nothing left: no tb/, no lock, not even the directory
    quick = [*argv[: argv.index("--normalize_samples")], "--normalize_samples", "16", *argv[-2:]]
    rerun = subprocess.run([sys.executable, str(REPO / "train_reward.py"), *quick], env=env, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
