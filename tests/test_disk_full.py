"""A full disk at every writer: what each library really raises on a full filesystem (a small tmpfs the tests mount
and fill), how `files.write_error` recognizes it, and what the scripts do with it: one `error:` line (exit 2) that
says disk full, names --output_dir, says what is intact and how to continue; the previous checkpoint and model whole,
nothing partial left, no thread's traceback.

Elsewhere: evaluate.py's results in tests/test_evaluation.py, label_generation.py's label file in
tests/test_label_generation.py, the label server's judgements in tests/test_labelserver.py.
"""

import dataclasses
import errno
import json
import os
import shutil
import struct
import threading
import types

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException

import train_policy
import train_reward
import train_sft
from lm_human_preference_details import checkpoint, files, ppo_plumbing, resumable, tracking
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm, load_reward_model
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import tiny_gpt2, write_queries
from tests.full_disk import MiB, fill, grow, small_filesystem
from tests.planted import write_policy_planted_labels, write_query_file
from tests.test_checkpoint import OneProcessAccelerator
from tests.test_train_policy import save_reward_model
from tests.test_train_sft import write_pairs
from tests.test_user_errors import run_cli
from tests.test_validation import tree

pytestmark = pytest.mark.usefixtures("single_thread")

FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
"""torch 2.13's zip writer, when a write stops short"""


def chained(error: BaseException, context: BaseException) -> BaseException:
    """`error` raised while `context` was handled, as torch's zip writer raises its RuntimeError."""
    error.__context__ = context
    return error


def empty(directory) -> None:
    """Remove everything in `directory`."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


# ---------------------------------------------------------------- what each writer raises, and how it is recognized


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no process group
def test_what_each_writer_raises_on_a_full_disk_is_recognized(tmp_path, tokenizer):
    weights = {"w": torch.zeros(256 * 1024)}  # 1 MiB
    writers = {
        "torch.save, to a path": lambda d: torch.save(weights, os.path.join(d, "a.pt")),
        "torch.save, to a file": lambda d: checkpoint.save_torch(weights, os.path.join(d, "a.pt")),
        "safetensors": lambda d: safetensors.torch.save_file(weights, os.path.join(d, "a.safetensors")),
        "save_pretrained": lambda d: tiny_gpt2().save_pretrained(os.path.join(d, "model")),
        "tokenizer": lambda d: tokenizer.save_pretrained(os.path.join(d, "tokenizer")),
        "json": lambda d: json.dump({"x": "y" * MiB}, open(os.path.join(d, "a.json"), "w")),
        "torch.distributed.checkpoint": lambda d: dcp.save(weights, checkpoint_id=os.path.join(d, "sharded")),
    }
    raised = {}
    with small_filesystem(tmp_path / "disk", 4) as disk:
        for name, write in writers.items():
            fill(disk, leave=64 * 1024)  # small files (a config) fit, the weights do not
            with pytest.raises(BaseException) as error:  # noqa: PT011 (what each raises is the question)
                write(disk)
            raised[name] = (error.value, files.write_error(error.value, disk))  # before the partial file goes
            empty(disk)
    for name, (error, cause) in raised.items():
        assert cause is not None and cause.errno == errno.ENOSPC, (name, error)
    # what they are: torch's RuntimeError keeps the errno only when it wrote to a file object
    error = raised["torch.save, to a path"][0]
    assert type(error) is RuntimeError and "unexpected pos" in str(error)
    assert str(error.__context__) == "basic_ios::clear: iostream error"  # no errno: the filesystem's free space tells
    error = raised["torch.save, to a file"][0]
    assert type(error) is RuntimeError and "unexpected pos" in str(error) and error.__context__.errno == errno.ENOSPC
    full_text = "Error while serializing: I/O error: No space left on device (os error 28)"
    for name in ("safetensors", "save_pretrained"):
        assert type(raised[name][0]) is SafetensorError and str(raised[name][0]) == full_text
    assert (
        type(raised["tokenizer"][0]) is Exception
        and str(raised["tokenizer"][0]) == "No space left on device (os error 28)"
    )
    assert type(raised["json"][0]) is OSError and raised["json"][0].errno == errno.ENOSPC
    error = raised["torch.distributed.checkpoint"][0]
    assert type(error) is CheckpointException and not isinstance(error, Exception)
    failure = error.failures[0][0]
    assert "unexpected pos" in str(failure) and failure.__context__.errno == errno.ENOSPC
    assert all(files.is_disk_full(error) for name, (error, _) in raised.items() if name != "torch.save, to a path")


def test_each_form_of_a_failed_write_is_recognized_and_nothing_else(tmp_path, monkeypatch):
    forms = {
        "torch, to a file": chained(RuntimeError(TORCH_SHORT_WRITE), FULL),
        "safetensors": SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        "tokenizers": Exception("No space left on device (os error 28)"),
        "open().write": OSError(errno.ENOSPC, "No space left on device"),
        "a quota": OSError(errno.EDQUOT, "Disk quota exceeded"),
        "torch.distributed.checkpoint": CheckpointException("ranks: [0]", {0: (chained(RuntimeError("x"), FULL), [])}),
        "files.write_atomic's OutputError": chained(files.OutputError("could not write 'a'"), FULL),
    }
    for name, error in forms.items():
        assert files.is_disk_full(error), name
    # torch to a file path: no errno; disk full when its filesystem has (almost) no space left
    short = chained(RuntimeError(TORCH_SHORT_WRITE), RuntimeError("basic_ios::clear: iostream error"))
    assert files.write_error(short, str(tmp_path)).errno == errno.EIO
    monkeypatch.setattr(files, "free_bytes", lambda path: 4096)
    assert files.write_error(short, str(tmp_path)).errno == errno.ENOSPC
    # another write error keeps its reason; an error that is no write is not one
    denied = files.write_error(Exception("Permission denied (os error 13)"))
    assert str(files.WriteFailed("the policy", "out", denied)).startswith(
        "could not write the policy in --output_dir 'out' (Permission denied); nothing partial was left. Fix that"
    )
    for error in (RuntimeError("CUDA error: out of memory"), ValueError("bad"), KeyboardInterrupt()):
        assert files.write_error(error) is None


# ---------------------------------------------------------------- the writers of a training run


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no process group
def test_a_full_disk_at_a_checkpoint_leaves_the_previous_one_whole_and_nothing_partial(tmp_path):
    accelerator, shared = OneProcessAccelerator(), {"weights": torch.randn(256 * 1024)}  # 1 MiB
    with small_filesystem(tmp_path / "disk", 8) as disk:
        out = os.path.join(disk, "run")
        step1, saves = checkpoint.step_dir(out, 1), checkpoint.BackgroundSaves()
        checkpoint.save_training_state(out, 1, accelerator, {"settings": {}}, shared, {"rng": 1}, 2, saves)
        saves.wait()
        filler = fill(disk, leave=256 * 1024)  # the process's file fits, state.pt not
        # state.pt is written in the background: its failure is raised in the training thread
        checkpoint.save_training_state(out, 2, accelerator, {"settings": {}}, shared, {"rng": 2}, 2, saves)
        with pytest.raises(files.WriteFailed) as failed:
            saves.wait()
        assert str(failed.value) == (
            f"disk full: could not write checkpoint training_state/step2 in --output_dir '{out}'; nothing partial was "
            "left. Free space there, then run the same command again."
        )
        assert os.listdir(checkpoint.state_dir(out)) == ["step1"] and checkpoint.find_damage(step1) is None
        assert str(failed.value.stopped_run(checkpoint.newest_checkpoint_intact(out))) == (
            f"disk full: could not write checkpoint training_state/step2 in --output_dir '{out}'; nothing partial was "
            f"left, and the newest checkpoint, '{step1}', is intact. Free space there, then run the same command with "
            "--resume auto."
        )
        # an --fsdp run's shards, written by torch.distributed.checkpoint in the training thread
        os.remove(filler)
        fill(disk, leave=512 * 1024)

        def shards(directory: str) -> None:
            dcp.save({"w": torch.randn(256 * 1024)}, checkpoint_id=os.path.join(directory, "sharded"))

        with pytest.raises(files.WriteFailed, match="^disk full: could not write checkpoint training_state/step2"):
            checkpoint.save_training_state(
                out, 2, accelerator, {"settings": {}}, shared, {"rng": 2}, 2, saves, write_shards=shards
            )
        assert os.listdir(checkpoint.state_dir(out)) == ["step1"] and checkpoint.find_damage(step1) is None


def test_a_full_disk_at_the_policys_save_leaves_the_previous_policy(tmp_path, tiny_model_dir):
    policy, tokenizer = PolicyWithValueHead(tiny_gpt2()), load_tokenizer(tiny_model_dir)
    with small_filesystem(tmp_path / "disk", 24) as disk:
        out = os.path.join(disk, "policy")
        args = with_run(train_policy.Args(), output_dir=out)
        ppo_plumbing.save_policy(policy, tokenizer, args, out)
        before = tree(out)
        fill(disk, leave=MiB)  # its configs fit, its weights not
        with torch.no_grad():
            policy.value_head.bias.fill_(1.0)
        with pytest.raises(files.WriteFailed) as failed:
            ppo_plumbing.save_policy(policy, tokenizer, args, out)
        assert str(failed.value) == (
            f"disk full: could not write the policy in --output_dir '{out}'; '{out}' is as it was before this save, "
            "with nothing partial left. Free space there, then run the same command again."
        )
        assert tree(out) == before  # no .partial-save, no .saving marker
        PolicyWithValueHead.load(out)


def whole_records(path) -> int:
    """The number of records of a TensorBoard event file; fails on a record cut short."""
    with open(path, "rb") as f:
        data = f.read()
    position, count = 0, 0
    while position < len(data):
        assert position + 12 <= len(data), "a record's header is cut short"
        (length,) = struct.unpack("<Q", data[position : position + 8])
        position += 12 + length + 4
        assert position <= len(data), "a record is cut short"
        count += 1
    return count


def test_a_full_disk_under_tensorboard_is_one_error_in_the_training_thread(tmp_path, monkeypatch):
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)
    with small_filesystem(tmp_path / "disk", 4) as disk:
        tracker = tracking.Tracker(disk, False, "p", None, "run", {"lr": 1e-3}, True)
        tracker.log({"loss": 0.0}, 0)
        tracker.flush()
        (events,) = os.listdir(os.path.join(disk, "tb"))
        path = os.path.join(disk, "tb", events)
        records = whole_records(path)
        fill(disk, leave=3000)  # a few records fit, then one is cut short
        failures = []
        for step in range(1, 100):
            try:
                tracker.log({f"loss{i}": float(step) for i in range(10)}, step)
                tracker.flush()
            except files.WriteFailed as e:
                failures.append(str(e))
        tracker.close()  # said once, not again
        assert thread_errors == []  # no traceback of TensorBoard's writer thread
        assert failures == [
            f"disk full: could not write the TensorBoard logs ({os.path.join('tb', events)}) in --output_dir '{disk}'; "
            "the points before it are whole in that file. Free space there, then run the same command again."
        ]
        assert whole_records(path) > records  # the record cut short was cut off


def test_a_tensorboard_that_keeps_its_event_file_elsewhere_logs_unguarded(tmp_path):
    elsewhere = types.SimpleNamespace(file_writer=types.SimpleNamespace(event_writer=types.SimpleNamespace()))
    assert tracking.guard_event_file(elsewhere) is None
    tracker = tracking.Tracker(str(tmp_path), False, "p", None, "run", {"lr": 1e-3}, True)
    tracker.events = None  # as with such a TensorBoard
    tracker.log({"loss": 0.0}, 0)
    tracker.close()
    (events,) = os.listdir(tmp_path / "tb")
    assert whole_records(tmp_path / "tb" / events) >= 2


def test_wandb_offline_on_a_full_disk_is_told_by_its_log(tmp_path, monkeypatch):
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    with small_filesystem(tmp_path / "disk", 4) as disk:
        os.symlink(tmp_path / "tb", os.path.join(disk, "tb"))  # TensorBoard's logs elsewhere: only wandb's fill up
        os.makedirs(tmp_path / "tb")
        tracker = tracking.Tracker(disk, True, "p", None, "run", {"lr": 1e-3}, True)
        tracker.log({"loss": 0.0}, 0)
        fill(disk, leave=64 * 1024)
        # wandb's service says nothing to the process: its log says it dropped records
        with pytest.raises(files.WriteFailed) as failed:
            for step in range(1, 200):
                tracker.log({f"loss{i}": float(step) for i in range(100)}, step)
            tracker.close()
        tracker.abandon()  # when log raised: wandb's run ends now, not in its exit handler on the full disk
    log = os.path.relpath(tracker.wandb_log[0], disk)
    assert str(failed.value) == (
        f"disk full: could not write wandb's run (its log {log} says so) in --output_dir '{disk}'; wandb left out the "
        "points it could not write. Free space there, then run the same command again."
    )


# ---------------------------------------------------------------- the scripts, end to end


def run(script, argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """`script`'s command line through cli.run, as `python script.py ARGV` runs it, in this process; any traceback a
    thread printed goes to stderr too; -> exit code, stdout, stderr."""
    threads = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: threads.append(f"Exception in thread: {hook.exc_value}"))
    code, out, err = run_cli(script, argv, capsys)
    return code, out, err + "".join(threads)


def assert_one_line(code: int, out: str, err: str, starts: str) -> str:
    """The run ended with exit code 2 and one `error:` line starting with `starts`, no traceback; -> the line."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, (out + err)[-4000:]
    assert "Traceback" not in out + err and "Exception in thread" not in err, (out + err)[-4000:]
    assert lines[0].startswith(starts), lines[0]
    return lines[0]


def whole_checkpoints(output_dir) -> list[int]:
    """The steps of the checkpoints in OUTPUT_DIR/training_state, each checked intact; fails on anything else there."""
    root = checkpoint.state_dir(str(output_dir))
    steps = checkpoint.list_checkpoints(str(output_dir))
    assert sorted(os.listdir(root)) == sorted(os.path.basename(path) for _, path in steps)  # nothing partial
    assert all(checkpoint.find_damage(path) is None for _, path in steps)
    return [step for step, _ in steps]


@pytest.fixture(scope="module")
def policy_world(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("full-disk-policy")
    queries = write_queries(root / "queries.txt")
    task = dataclasses.replace(
        train_policy.task_presets()["sentiment"].task,
        query_dataset=queries,
        query_length=16,
        response_length=8,
        start_text=None,
        end_text=None,
        truncate_token=None,
        truncate_text=None,
        truncate_after=0,
    )
    return {"queries": queries, "reward": save_reward_model(root / "reward", tiny_model_dir, task)}


def test_train_policy_on_a_full_disk_stops_at_a_checkpoint_and_resumes_once_space_is_freed(
    tmp_path, tiny_model_dir, policy_world, capsys, monkeypatch
):
    flags = [
        *("--base_model", tiny_model_dir, "--rewards.trained_model", policy_world["reward"]),
        *("--task.query_dataset", policy_world["queries"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "None"),
        *("--task.truncate_after", "0", "--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--ppo.noptepochs", "1"),
        *("--save_interval", "1", "--keep_checkpoints", "1"),
    ]
    # a checkpoint is 19.8 MB, the policy 10.1 MB: checkpoint 1 and the policy fit in 45 MiB, checkpoint 2 not
    with small_filesystem(tmp_path / "disk", 45) as disk:
        out = os.path.join(disk, "policy")
        argv = [*flags, "--output_dir", out]
        line = assert_one_line(*run(train_policy, argv, capsys, monkeypatch), "error: disk full: could not write ")
        steps = whole_checkpoints(out)
        newest = checkpoint.step_dir(out, steps[-1])
        assert line.endswith(
            f"the newest checkpoint, '{newest}', is intact. Free space there, then run the same command with "
            "--resume auto."
        )
        assert f"in --output_dir '{out}'" in line and steps == [1]
        grow(disk, 120)
        code, stdout, err = run(train_policy, [*argv, "--resume", "auto"], capsys, monkeypatch)
        assert code == 0, err[-4000:]
        assert f"resuming from {newest}" in stdout
        assert whole_checkpoints(out) == [2]
        PolicyWithValueHead.load(out)


def test_train_reward_on_a_full_disk_at_its_final_save_keeps_the_checkpoint_and_saves_on_resume(
    tmp_path, tokenizer, tiny_model_dir, capsys, monkeypatch
):
    corpus = write_query_file(tmp_path / "queries.txt", n=100)
    marker = tokenizer.encode(" happy")[0]
    labels = write_policy_planted_labels(tmp_path / "labels.json", tiny_model_dir, tokenizer, corpus, 16, 16, 8, marker)
    flags = [
        *("--base_model", tiny_model_dir, "--label_dataset", str(labels), "--task.query_dataset", str(corpus)),
        *("--task.query_length", "16", "--task.response_length", "8", "--labels.num_train", "16"),
        *("--batch_size", "8", "--lr", "1e-3", "--rollout_batch_size", "16", "--normalize_samples", "16"),
    ]
    # the one checkpoint (after the last step) is 19.7 MB: it fits in 24 MiB, the reward model (10.1 MB) then not
    with small_filesystem(tmp_path / "disk", 24) as disk:
        out = os.path.join(disk, "reward")
        argv = [*flags, "--output_dir", out]
        line = assert_one_line(*run(train_reward, argv, capsys, monkeypatch), "error: disk full")
        assert whole_checkpoints(out) == [2]
        assert line == (
            f"error: disk full: could not write the reward model in --output_dir '{out}'; '{out}' is as it was before "
            f"this save, with nothing partial left, and the newest checkpoint, '{checkpoint.step_dir(out, 2)}', is "
            "intact. Free space there, then run the same command with --resume auto."
        )
        assert not os.path.exists(os.path.join(out, "reward_model.json"))
        grow(disk, 48)
        code, _, err = run(train_reward, [*argv, "--resume", "auto"], capsys, monkeypatch)
        assert code == 0, err[-4000:]
        load_reward_model(out)


def test_train_sft_on_a_full_disk_at_its_summary_keeps_the_model_and_writes_it_on_resume(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    pairs = write_pairs(tmp_path / "pairs.jsonl", n=16)
    flags = ["--base_model", tiny_model_dir, "--dataset", pairs, "--batch_size", "8", "--lr", "1e-3"]
    real_write_summary = resumable.write_summary

    def write_summary_on_a_full_disk(output_dir, *args):  # the checkpoint and the model fit; then the disk is full
        filler = fill(output_dir)
        try:
            real_write_summary(output_dir, *args)
        finally:
            os.remove(filler)

    with small_filesystem(tmp_path / "disk", 40) as disk:
        out = os.path.join(disk, "sft")
        argv = [*flags, "--output_dir", out]
        monkeypatch.setattr(resumable, "write_summary", write_summary_on_a_full_disk)
        line = assert_one_line(*run(train_sft, argv, capsys, monkeypatch), "error: disk full")
        monkeypatch.setattr(resumable, "write_summary", real_write_summary)
        assert whole_checkpoints(out) == [2]
        assert line == (
            f"error: disk full: could not write the run's summary ({resumable.SUMMARY_FILE}) in --output_dir '{out}'; "
            f"nothing partial was left, and the newest checkpoint, '{checkpoint.step_dir(out, 2)}', is intact. Free "
            "space there, then run the same command with --resume auto."
        )
        assert not os.path.exists(os.path.join(out, resumable.SUMMARY_FILE))
        code, stdout, err = run(train_sft, [*argv, "--resume", "auto"], capsys, monkeypatch)
        assert code == 0, err[-4000:]
        assert resumable.read_summary(out) is not None
        load_causal_lm(out)
