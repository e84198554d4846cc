"""One run per --output_dir: process 0 of a run holds an advisory lock on OUTPUT_DIR/.lock, so a second run there
(started beside a live one, or at the same instant) stops with one line naming the holder, while a killed run's lock
never blocks the run that continues it."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lm_human_preference_details import checkpoint, output_claim
from tests.planted import REPO, lock_record, run_script, script_env
from tests.test_resume import policy_flags, policy_world, script_command  # noqa: F401 (fixture)

LAUNCHER = """
import os, sys, time
sys.path.insert(0, {repo!r})
import train_policy
from lm_human_preference_details import cli
ready, go = sys.argv[1:3]
open(ready, "w").close()
while not os.path.exists(go):  # both runs leave this loop within a millisecond of each other
    time.sleep(0.001)
cli.run(train_policy.main, train_policy.parse, sys.argv[3:])
"""


def wait_for(condition, timeout: float, what: str) -> None:
    """Poll `condition` every 10 ms until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_run_beside_a_live_one_stops_naming_it_and_a_killed_runs_lock_blocks_nobody(
    tmp_path,
    tiny_model_dir,
    policy_world,  # noqa: F811
):
    out = tmp_path / "run"
    long_run = policy_flags(tiny_model_dir, policy_world, out, "--ppo.total_episodes", "80000")
    log = open(tmp_path / "live.log", "w")
    live = subprocess.Popen(
        script_command("train_policy.py", [*long_run, "--save_interval", "0"]),
        cwd=REPO,
        env=script_env(),
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        wait_for(lambda: lock_record(out) is not None or live.poll() is not None, 300, "the live run's lock")
        assert lock_record(out)["pid"] == live.pid, open(tmp_path / "live.log").read()[-3000:]
        # the same command with --resume auto beside it: one line naming the live run, nothing trained or written
        second = subprocess.run(
            script_command("train_policy.py", [*long_run, "--resume", "auto"]),
            cwd=REPO,
            env=script_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
        assert errors[0].startswith(
            f"error: another run (train_policy.py, pid {live.pid} on host {socket.gethostname()}, started "
        )
        assert f"holds --output_dir '{out}'" in errors[0] and "choose another --output_dir" in errors[0]
        assert "PPO updates" not in second.stdout and live.poll() is None
    finally:
        os.killpg(live.pid, signal.SIGKILL)  # preempted: its lock file stays, unlocked by the OS
        live.wait()
        log.close()
    assert os.path.exists(out / output_claim.LOCK_FILE)
    short = policy_flags(tiny_model_dir, policy_world, out, "--ppo.total_episodes", "8", "--resume", "auto")
    resumed = run_script("train_policy.py", *short)
    assert "--resume auto found no checkpoint" in resumed.stdout  # killed before its first checkpoint
    assert [step for step, _ in checkpoint.list_checkpoints(str(out))] == [1]
    assert not os.path.exists(out / output_claim.LOCK_FILE)  # released at the end of the run


@pytest.mark.slow
def test_two_runs_started_at_the_same_instant_on_one_output_dir_let_exactly_one_proceed(
    tmp_path,
    tiny_model_dir,
    policy_world,  # noqa: F811
):
    out = tmp_path / "run"
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    flags = policy_flags(tiny_model_dir, policy_world, out, "--ppo.total_episodes", "8")
    go = tmp_path / "go"
    runs, logs = [], [open(tmp_path / f"run{i}.log", "w+") for i in range(2)]
    for i, log in enumerate(logs):
        command = [sys.executable, str(launcher), str(tmp_path / f"ready{i}"), str(go), *flags]
        runs.append(subprocess.Popen(command, cwd=REPO, env=script_env(), stdout=log, stderr=log))
    wait_for(lambda: all((tmp_path / f"ready{i}").exists() for i in range(2)), 300, "both runs to start")
    go.touch()
    results = [(run.wait(timeout=300), (log.seek(0), log.read())[1]) for run, log in zip(runs, logs)]
    for log in logs:
        log.close()
    assert sorted(code for code, _ in results) == [0, 2], results
    (_, stopped) = next(result for result in results if result[0] == 2)
    errors = [line for line in stopped.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another run" in errors[0], stopped[-3000:]
    # one run's TensorBoard logs only
    events = [name for _, _, names in os.walk(out / "tb") for name in names if name.startswith("events.")]
    assert len(events) == 1, events
