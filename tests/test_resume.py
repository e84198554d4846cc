"""Resumable runs: a run killed with SIGKILL and resumed logs and saves what the uninterrupted run does; checkpoint
writes are atomic; changed settings and used output directories stop the run."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import train_policy
import train_reward
from lm_human_preference_details import checkpoint, devices, files, resume_check
from lm_human_preference_details.modeling import PolicyWithValueHead, load_reward_model
from lm_human_preference_details.resume_check import (  # noqa: F401 (imported from here by other test files)
    final_training_state,
    max_metric_difference,
    max_weight_difference,
    saved_files,
    scalars,
)
from tests.conftest import write_queries
from tests.planted import (
    REPO,
    free_port,
    run_script,
    script_env,
    without_gpus,
    write_policy_planted_labels,
    write_query_file,
)
from tests.test_train_policy import save_reward_model

# one intra-op thread, as the scripts get from OMP_NUM_THREADS=1: in-process and subprocess runs add up floats alike
pytestmark = pytest.mark.usefixtures("single_thread")

DETERMINISTIC = ("--deterministic",) if torch.cuda.is_available() else ()
"""the runs compared bit for bit need deterministic kernels on a GPU (CPU kernels are deterministic anyway)"""
# cuBLAS reads its workspace setting at its first call: set it before any test runs a model on a GPU
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", devices.CUBLAS_DETERMINISTIC[0])


@pytest.fixture(autouse=True)
def determinism_restored():
    """torch's deterministic-algorithms setting as it was before the test (--deterministic sets it process-wide)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(enabled)


@pytest.fixture(scope="module")
def policy_world(tmp_path_factory, tiny_model_dir):
    """A query file and a random reward model for the tiny policy task below."""
    root = tmp_path_factory.mktemp("resume-policy")
    queries = root / "queries.txt"
    write_queries(queries)
    task = dataclasses.replace(
        train_policy.task_presets()["sentiment"].task,
        query_dataset=str(queries),
        query_length=16,
        response_length=8,
        start_text=None,
        end_text=None,
        truncate_token=None,
        truncate_text=None,
        truncate_after=0,
    )
    return {"queries": str(queries), "reward": save_reward_model(root / "reward", tiny_model_dir, task)}


def policy_flags(model_dir: str, world: dict, output_dir, *extra: str) -> list[str]:
    """A tiny policy run: 4 updates of 8 episodes, a checkpoint every 2."""
    return [
        *("--base_model", model_dir, "--rewards.trained_model", world["reward"]),
        *("--task.query_dataset", world["queries"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "None"),
        *("--task.truncate_after", "0", "--ppo.total_episodes", "32", "--ppo.batch_size", "8", "--ppo.lr", "1e-3"),
        *("--ppo.noptepochs", "2", "--save_interval", "2", "--log_interval", "100", "--print_samples", "1"),
        *DETERMINISTIC,
        *extra,
        *("--output_dir", str(output_dir)),
    ]


@pytest.fixture(scope="module")
def reward_world(tmp_path_factory, tokenizer, tiny_model_dir):
    """A query corpus and 64 best-of-4 labels on samples of the tiny model."""
    root = tmp_path_factory.mktemp("resume-reward")
    corpus = write_query_file(root / "queries.txt", n=100)
    marker = tokenizer.encode(" happy")[0]
    labels = write_policy_planted_labels(root / "labels.json", tiny_model_dir, tokenizer, corpus, 64, 16, 8, marker)
    return {"corpus": str(corpus), "labels": str(labels)}


def reward_flags(model_dir: str, world: dict, output_dir, *extra: str) -> list[str]:
    """A tiny reward run: normalize, 6 steps of 8 labels (16 held out, evaluated every 2 steps), normalize."""
    return [
        *("--base_model", model_dir, "--label_dataset", world["labels"], "--task.query_dataset", world["corpus"]),
        *("--task.query_length", "16", "--task.response_length", "8", "--labels.num_train", "48"),
        *("--batch_size", "8", "--lr", "1e-3", "--rollout_batch_size", "16", "--normalize_samples", "16"),
        *("--eval_interval", "2", "--save_interval", "2", *DETERMINISTIC, *extra, "--output_dir", str(output_dir)),
    ]


def start_and_kill(command: list[str], output_dir, kill_after: int, delay: float, gpus: bool = True) -> int:
    """`resume_check.start_and_kill` in a user's fresh offline shell at the repository root (the GPUs hidden unless
    `gpus`)."""
    env = {**script_env(), "WANDB_SILENT": "true"}
    env = env if gpus else without_gpus(env)
    return resume_check.start_and_kill(command, output_dir, kill_after, delay, env, REPO)


def script_command(script: str, flags: list[str]) -> list[str]:
    """`python SCRIPT FLAGS` as a user runs it."""
    return [sys.executable, str(REPO / script), *flags]


def wandb_run_ids(output_dir) -> set[str]:
    """Ids of the offline wandb runs under output_dir/wandb (offline-run-DATE-ID)."""
    names = os.listdir(os.path.join(output_dir, "wandb"))
    return {name.rsplit("-", 1)[1] for name in names if name.startswith("offline-run-")}


@pytest.mark.slow
def test_policy_killed_and_resumed_equals_uninterrupted(tmp_path, tiny_model_dir, policy_world, monkeypatch):
    start = time.time()
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    train_policy.main(train_policy.parse(policy_flags(tiny_model_dir, policy_world, tmp_path / "whole")))
    # killed right after checkpoint 2 is on disk (while the policy is written beside it), wandb offline on
    killed = tmp_path / "killed"
    flags = policy_flags(tiny_model_dir, policy_world, killed, "--track")
    resumed_from = start_and_kill(script_command("train_policy.py", flags), killed, kill_after=2, delay=0.0)
    assert resumed_from == 2  # between two checkpoints
    result = run_script("train_policy.py", *flags, "--resume", "auto")
    assert f"resuming from {checkpoint.step_dir(str(killed), resumed_from)} after {resumed_from} of 4" in result.stdout
    whole, resumed = scalars(tmp_path / "whole"), scalars(killed)
    assert len(whole["objective/score"]) == 4 and len({v for _, v in whole["objective/kl_coef"]}) > 1
    metric_diff = max_metric_difference(resumed, whole, resumed_from)
    weight_diff = max_weight_difference(
        saved_files(killed, ("model.safetensors", "value_head.safetensors")),
        saved_files(tmp_path / "whole", ("model.safetensors", "value_head.safetensors")),
    )
    state_diff = max_weight_difference(final_training_state(killed), final_training_state(tmp_path / "whole"))
    print(
        f"policy resume after {resumed_from}: max |metric diff| {metric_diff:.3g}, weights {weight_diff:.3g}, "
        f"weights + Adam {state_diff:.3g}, {time.time() - start:.1f} s"
    )
    assert metric_diff <= 1e-6 and weight_diff <= 1e-6 and state_diff <= 1e-6
    assert len(wandb_run_ids(killed)) == 1  # the resumed run continued the killed run's wandb run
    assert [step for step, _ in checkpoint.list_checkpoints(str(killed))] == [2, 4]  # --keep_checkpoints 2


@pytest.mark.slow
def test_reward_killed_and_resumed_equals_uninterrupted(tmp_path, tiny_model_dir, reward_world):
    start = time.time()
    train_reward.main(train_reward.parse(reward_flags(tiny_model_dir, reward_world, tmp_path / "whole")))
    # killed a moment after checkpoint 2, between two checkpoints (during a training step)
    killed = tmp_path / "killed"
    flags = reward_flags(tiny_model_dir, reward_world, killed)
    resumed_from = start_and_kill(script_command("train_reward.py", flags), killed, kill_after=2, delay=0.05)
    assert not os.path.exists(killed / "reward_model.json")  # killed before the end
    run_script("train_reward.py", *flags, "--resume", "auto")
    whole, resumed = scalars(tmp_path / "whole"), scalars(killed)
    assert len(whole["train_reward/minibatch/loss"]) == 6 and len(whole["eval/accuracy"]) == 5  # 0, 2, 4, 6, 6
    metric_diff = max_metric_difference(resumed, whole, resumed_from)
    weight_diff = max_weight_difference(
        saved_files(killed, ("model.safetensors",)), saved_files(tmp_path / "whole", ("model.safetensors",))
    )
    state_diff = max_weight_difference(final_training_state(killed), final_training_state(tmp_path / "whole"))
    meta = [load_reward_model(str(path))[1] for path in (killed, tmp_path / "whole")]
    print(
        f"reward resume after {resumed_from}: max |metric diff| {metric_diff:.3g}, weights {weight_diff:.3g}, "
        f"weights + Adam {state_diff:.3g}, {time.time() - start:.1f} s"
    )
    assert metric_diff <= 1e-6 and weight_diff <= 1e-6 and state_diff <= 1e-6
    assert (meta[0]["gain"], meta[0]["bias"], meta[0]["eval_after"]) == (
        meta[1]["gain"],
        meta[1]["bias"],
        meta[1]["eval_after"],
    )


@pytest.mark.slow
def test_two_process_policy_resume_equals_uninterrupted(tmp_path, tiny_model_dir, policy_world):
    start = time.time()

    def torchrun(output_dir, *extra: str) -> list[str]:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(free_port()), str(REPO / "train_policy.py")]
        sizes = ("--ppo.batch_size", "16", "--ppo.total_episodes", "64", "--keep_checkpoints", "0")
        return [*command, *policy_flags(tiny_model_dir, policy_world, output_dir, *sizes), *extra]

    def run(command: list[str]) -> None:
        env = without_gpus(script_env())
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-5000:]

    run(torchrun(tmp_path / "whole"))
    # torchrun and both processes SIGKILLed at once after checkpoint 2, between two checkpoints, then resumed
    killed = tmp_path / "killed"
    resumed_from = start_and_kill(torchrun(killed), killed, kill_after=2, delay=0.05, gpus=False)
    assert resumed_from in (2, 3)  # the run has 4 updates: killed before its last checkpoint
    assert {"rng_rank0.pt", "rng_rank1.pt"} <= set(os.listdir(checkpoint.step_dir(str(killed), resumed_from)))
    run(torchrun(killed, "--resume", "auto"))
    metric_diff = max_metric_difference(scalars(killed), scalars(tmp_path / "whole"), resumed_from)
    names = ("model.safetensors", "value_head.safetensors")
    weight_diff = max_weight_difference(saved_files(killed, names), saved_files(tmp_path / "whole", names))
    print(
        f"2-process policy resume after {resumed_from}: max |metric diff| {metric_diff:.3g}, weights "
        f"{weight_diff:.3g}, {time.time() - start:.1f} s"
    )
    assert metric_diff <= 1e-6 and weight_diff <= 1e-6


# ---------------------------------------------------------------- in-process checks


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir, policy_world):
    """A finished 2-update policy run with a checkpoint after each update; -> its flags (less --output_dir)."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    flags = policy_flags(tiny_model_dir, policy_world, output_dir, "--ppo.total_episodes", "16", "--save_interval", "1")
    train_policy.main(train_policy.parse(flags))
    return output_dir, flags


def test_used_output_dir_stops_unless_resumed_or_overwritten(finished_run, tmp_path):
    output_dir, flags = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(output_dir, run_dir)
    flags = [*flags[:-2], "--output_dir", str(run_dir)]
    with pytest.raises(ValueError, match="already holds another run .*--resume auto.*--overwrite_output_dir"):
        train_policy.main(train_policy.parse(flags))
    # a finished run resumes to its end: nothing more to train, nothing logged twice
    assert train_policy.main(train_policy.parse([*flags, "--resume", "auto"])) == []
    assert [step for step, _ in scalars(run_dir)["objective/score"]] == [0, 1]
    history = train_policy.main(train_policy.parse([*flags, "--overwrite_output_dir", "--ppo.total_episodes", "8"]))
    assert len(history) == 1 and [step for step, _ in scalars(run_dir)["objective/score"]] == [0]
    assert [step for step, _ in checkpoint.list_checkpoints(str(run_dir))] == [1]


def test_resume_with_changed_settings_lists_them_and_override_continues(finished_run, tmp_path, capsys):
    output_dir, flags = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(output_dir, run_dir)
    shutil.rmtree(checkpoint.step_dir(str(run_dir), 2))
    (run_dir / "summary.json").unlink()  # as a kill after update 0 leaves the run: no summary yet
    changed = [*flags[:-2], "--output_dir", str(run_dir), "--resume", "auto", "--ppo.lr", "2e-3", "--seed", "7"]
    changed += ["--dist_timeout", "900", "--filter_warning_rate", "0.5"]  # these do not change what is computed
    with pytest.raises(ValueError, match="other settings") as stop:
        train_policy.main(train_policy.parse(changed))
    assert "seed: checkpoint 1, now 7" in str(stop.value) and "ppo.lr: checkpoint 0.001, now 0.002" in str(stop.value)
    assert "--allow_resume_changes" in str(stop.value) and "batch_size" not in str(stop.value)
    assert "dist_timeout" not in str(stop.value) and "filter_warning_rate" not in str(stop.value)
    history = train_policy.main(train_policy.parse([*changed, "--allow_resume_changes"]))
    assert len(history) == 1 and history[0]["elapsed/updates"] == 2
    assert "warning: --allow_resume_changes" in capsys.readouterr().out
    assert checkpoint.latest_checkpoint(str(run_dir)) == checkpoint.step_dir(str(run_dir), 2)


def test_checkpoint_older_than_a_setting_resumes_while_the_run_leaves_it_at_its_default(finished_run, tmp_path):
    # a checkpoint written before --lora.*, --task.truncate_text and --deterministic existed records none of them
    output_dir, flags = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(output_dir, run_dir)
    shutil.rmtree(checkpoint.step_dir(str(run_dir), 2))
    (run_dir / "summary.json").unlink()  # as a kill after update 0 leaves the run: no summary yet
    meta_path = os.path.join(checkpoint.step_dir(str(run_dir), 1), checkpoint.META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["settings"]["lora"], meta["settings"]["deterministic"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    # the run leaves every one of them at its default: without --deterministic, which runs on a GPU pass
    resume = [*(flag for flag in flags[:-2] if flag not in DETERMINISTIC), "--output_dir", str(run_dir)]
    resume += ["--resume", "auto"]
    with pytest.raises(ValueError, match="other settings") as stop:  # a new setting away from its default is a change
        train_policy.main(train_policy.parse([*resume, "--lora.alpha", "8"]))
    assert "lora.alpha: checkpoint None, now 8" in str(stop.value) and "lora.rank" not in str(stop.value)
    history = train_policy.main(train_policy.parse(resume))
    assert len(history) == 1 and history[0]["elapsed/updates"] == 2


def test_failed_checkpoint_write_leaves_the_previous_one_whole(finished_run, tmp_path, monkeypatch):
    output_dir, flags = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(output_dir, run_dir)
    step2 = run_dir / "training_state" / "step2"
    before = {name: (step2 / name).read_bytes() for name in ("state.pt", "checkpoint.json")}
    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):
        if os.path.basename(str(path)) == "state.pt":
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    # checkpoint 2 written again, failing after the per-process file: step2 stays as it was, no partial step dir
    monkeypatch.setattr(checkpoint.torch, "save", failing_save)
    accelerator = train_policy.distributed.make_accelerator()
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save_training_state(str(run_dir), 2, accelerator, {"settings": {}}, {"x": 1}, {"y": 2}, keep=2)
    assert {name: (step2 / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(run_dir / "training_state")) == [".step2.partial", "step1", "step2"]
    assert checkpoint.load_training_state(checkpoint.latest_checkpoint(str(run_dir)), 0).step == 2
    monkeypatch.undo()

    # the final policy: a kill between two of its file renames leaves the marker, which the loaders refuse
    policy = PolicyWithValueHead.load(str(run_dir))
    real_replace = os.replace
    moved = []

    def dying_replace(source, target):
        if moved:
            raise KeyboardInterrupt  # stands for the kill after the first file
        moved.append(target)
        real_replace(source, target)

    monkeypatch.setattr(files.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt), files.atomic_files(str(run_dir)) as tmp:
        policy.save(tmp)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="save was interrupted.*--resume auto"):
        PolicyWithValueHead.load(str(run_dir))
    # resuming the finished run writes the policy again, whole
    train_policy.main(train_policy.parse([*flags[:-2], "--output_dir", str(run_dir), "--resume", "auto"]))
    assert not (run_dir / files.SAVING_MARKER).exists()
    PolicyWithValueHead.load(str(run_dir))


@pytest.mark.parametrize("leftover", ["reward_model.json", "tb"])
def test_reward_run_into_used_output_dir_stops(tmp_path, tiny_model_dir, reward_world, leftover):
    used = tmp_path / "rm"
    used.mkdir()
    if leftover == "tb":
        (used / "tb").mkdir()
    else:
        (used / leftover).write_text("{}")
    with pytest.raises(ValueError, match=f"already holds another run \\({leftover}\\); pass --resume auto"):
        train_reward.main(train_reward.parse(reward_flags(tiny_model_dir, reward_world, used)))
    assert sorted(os.listdir(used)) == [leftover]
