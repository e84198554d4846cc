"""train_reward.py --fsdp (FSDP2): 2 and 4 gloo processes train, evaluate, normalize, checkpoint and save the reward
model as the unsharded run with as many processes does (tiny GPT-2 and the Llama stand-in, with and without gradient
accumulation); a killed --fsdp run resumes to the uninterrupted one, and a checkpoint of 4 processes resumes on 2."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import train_reward
from lm_human_preference_details import checkpoint, resumable, reward_plumbing
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.modeling import load_reward_model
from lm_human_preference_details.resume_check import scalars
from lm_human_preference_details.settings import RewardRunSettings
from lm_human_preference_details.tokenizer import load_tokenizer
from tests import archs
from tests.planted import (
    REPO,
    books_task,
    free_port,
    script_env,
    without_gpus,
    write_policy_planted_labels,
    write_query_file,
)
from tests.test_multiprocess import kill_tree

LABEL_ROWS, NUM_TRAIN = 63, 32
"""31 held-out rows: the processes score unequal numbers of them (and of micro-batches with 4 processes)"""

LAUNCHER = """
import json, sys
sys.path.insert(0, {repo!r})
import train_reward
from lm_human_preference_details import cli

for argv in json.loads(sys.argv[1]):
    cli.run(train_reward.main, train_reward.parse, argv)
"""
"""one torchrun launch runs several reward trainings in a row (the processes start once)"""

CASES = {2: (("gpt2", 1), ("llama", 2)), 4: (("gpt2", 2), ("llama", 1))}
"""processes: (model, --gradient_accumulation_steps) of each pair of runs, unsharded and --fsdp: each model with and
without accumulation; 4 processes with micro-batches of 1 score 8 and 7 held-out rows"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer, tiny_model_dir) -> dict:
    """A query corpus, the tiny GPT-2 and the Llama stand-in with planted best-of-4 labels of each."""
    root = tmp_path_factory.mktemp("fsdp-reward")
    corpus = write_query_file(root / "queries.txt")
    llama = archs.save_family("llama", str(root / "llama"))
    llama_tokenizer = load_tokenizer(llama)
    models = {"gpt2": (tiny_model_dir, tokenizer), "llama": (llama, llama_tokenizer)}
    labels = {}
    for name, (model, tok) in models.items():
        marker = tok.encode(" happy", add_special_tokens=False)[0]
        labels[name] = write_policy_planted_labels(
            root / f"labels-{name}.json", model, tok, corpus, LABEL_ROWS, 16, 8, marker, start_text=None, end_text=None
        )
    return {"root": root, "corpus": str(corpus), "models": {k: v[0] for k, v in models.items()}, "labels": labels}


def reward_flags(world: dict, model: str, output_dir, *extra: str) -> list[str]:
    """A tiny run: normalize on 16 samples, 4 steps of 8 labels (evaluated every 2, checkpointed every 2), normalize."""
    return [
        *("--base_model", world["models"][model], "--label_dataset", str(world["labels"][model])),
        *("--task.query_dataset", world["corpus"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.truncate_after", "4", "--labels.num_train", str(NUM_TRAIN), "--batch_size", "8", "--lr", "1e-3"),
        *("--rollout_batch_size", "16", "--normalize_samples", "16", "--eval_interval", "2", "--save_interval", "2"),
        # a process that waits for the others more than 90 s stops the launch (a hang fails the test in bounded time)
        *("--keep_checkpoints", "0", "--dist_timeout", "90", *extra, "--output_dir", str(output_dir)),
    ]


def torchrun(processes: int, *args: str) -> list[str]:
    """torchrun on this machine's loopback with `processes` processes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [*command, "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]


def run(command: list[str], timeout: float = 300) -> str:
    """Run torchrun `command` in a user's offline shell with the GPUs hidden; its output. The test fails with the
    output when it fails, and when it runs past `timeout` (a hang: it and its workers are killed)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=without_gpus(script_env()), stdout=out, stderr=err, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
        out.seek(0), err.seek(0)
        output, errors = out.read(), err.read()
    assert proc.returncode == 0, (f"exit {proc.returncode}", output[-3000:], errors[-5000:])
    return output


def run_name(model: str, accumulation: int, fsdp: bool) -> str:
    """The output directory's name of one run of a launch."""
    return f"{model}-accum{accumulation}-{'fsdp' if fsdp else 'unsharded'}"


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory) -> Callable[[int], Path]:
    """-> launch(processes): the directory where one launch of that many processes trained each case of CASES
    unsharded and with --fsdp (launched once per module)."""
    launcher = world["root"] / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    directories = {}

    def launch(processes: int) -> Path:
        if processes not in directories:
            out = tmp_path_factory.mktemp(f"runs{processes}")
            argvs = []
            for model, accumulation in CASES[processes]:
                for fsdp in (False, True):
                    flags = ["--gradient_accumulation_steps", str(accumulation), *(["--fsdp"] if fsdp else [])]
                    argvs.append(reward_flags(world, model, out / run_name(model, accumulation, fsdp), *flags))
            run(torchrun(processes, str(launcher), json.dumps(argvs)))
            directories[processes] = out
        return directories[processes]

    return launch


def saved_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the saved reward model's safetensors files (the classifier, or trunk/ and its head)."""
    files = sorted(Path(directory).glob("*.safetensors")) + sorted(Path(directory).glob("trunk/*.safetensors"))
    assert files, os.listdir(directory)
    return {f"{file.relative_to(directory)}:{k}": v for file in files for k, v in load_file(file).items()}


def assert_close_metrics(sharded: dict, whole: dict, from_step: int = 0, skip: tuple[str, ...] = ()) -> int:
    """Every logged series of `whole` at steps >= from_step (but those starting with `skip`) in `sharded`, at the
    same steps, within rtol 1e-5; -> the number of series compared."""
    assert sharded.keys() == whole.keys(), set(sharded) ^ set(whole)
    compared = [tag for tag in whole if not tag.startswith(skip)]
    for tag in compared:
        assert [s for s, _ in sharded[tag]] == [s for s, _ in whole[tag]], tag
        pairs = np.array([(a, b) for (step, a), (_, b) in zip(sharded[tag], whole[tag]) if step >= from_step])
        np.testing.assert_allclose(
            pairs[:, 0] if len(pairs) else [], pairs[:, 1] if len(pairs) else [], rtol=1e-5, atol=1e-7, err_msg=tag
        )
    return len(compared)


def assert_close_json(sharded, whole, path: str = "") -> None:
    """Two JSON trees equal, floats within rtol 1e-5."""
    if isinstance(whole, dict):
        assert sharded.keys() == whole.keys(), path
        for key in whole:
            assert_close_json(sharded[key], whole[key], f"{path}.{key}")
    elif isinstance(whole, float):
        assert math.isclose(sharded, whole, rel_tol=1e-5, abs_tol=1e-7), (path, sharded, whole)
    else:
        assert sharded == whole, path


@pytest.mark.slow
@pytest.mark.parametrize("processes", sorted(CASES))
def test_fsdp_reward_runs_equal_unsharded_runs(runs, processes):
    for model, accumulation in CASES[processes]:
        whole, sharded = (runs(processes) / run_name(model, accumulation, fsdp) for fsdp in (False, True))
        metrics = scalars(sharded)
        assert len(metrics["train_reward/minibatch/loss"]) == 4 and len(metrics["eval/accuracy"]) == 4
        assert {"normalize_before/gain", "normalize_after/gain"} <= set(metrics)
        compared = assert_close_metrics(metrics, scalars(whole))
        # the saved model: the same files, the same weights, the same metadata, loaded alike
        assert sorted(os.listdir(sharded)) == sorted(os.listdir(whole))
        weights = saved_tensors(sharded), saved_tensors(whole)
        assert weights[0].keys() == weights[1].keys()
        worst = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[1])
        assert worst <= 1e-5
        for name in ("reward_model.json", "config.json", "trunk/config.json"):
            if os.path.exists(whole / name):
                assert_close_json(*(json.loads((d / name).read_text()) for d in (sharded, whole)))
        loaded = [load_reward_model(str(d))[0] for d in (sharded, whole)]
        assert (loaded[0].gain.item(), loaded[0].bias.item()) == pytest.approx(
            (loaded[1].gain.item(), loaded[1].bias.item()), rel=1e-5
        )
        # the checkpoints hold each process's shards, state.pt no weights
        step = checkpoint.step_dir(str(sharded), 4)
        assert len(list(Path(step, "sharded").glob("*.distcp"))) == processes
        assert "model" not in torch.load(os.path.join(step, "state.pt"), weights_only=True)
        print(f"{processes} processes, {model}, accumulation {accumulation}: {compared} series, weights {worst:.3g}")


def start_and_kill_all(command: list[str], output_dir: Path, kill_after: int, timeout: float = 300) -> int:
    """Start torchrun `command` and SIGKILL it and its workers (in sessions of their own) as soon as checkpoint
    `kill_after` appears, as a preempted machine; -> the newest checkpoint's step."""
    with open(output_dir.parent / f"{output_dir.name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=without_gpus(script_env()), stdout=log, stderr=log)
        target, deadline = checkpoint.step_dir(str(output_dir), kill_after), time.time() + timeout
        try:
            while not os.path.isdir(target) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.005)
        finally:
            kill_tree(proc.pid)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, (output_dir.parent / f"{output_dir.name}.log").read_text()[-3000:]
    return checkpoint.list_checkpoints(str(output_dir))[-1][0]


@pytest.mark.slow
def test_fsdp_reward_killed_and_resumed_equals_uninterrupted(runs, world, tmp_path):
    uninterrupted = runs(2) / run_name("gpt2", 1, True)
    killed = tmp_path / "killed"
    flags = reward_flags(world, "gpt2", killed, "--fsdp", "--save_interval", "1")
    command = torchrun(2, str(REPO / "train_reward.py"), *flags)
    resumed_from = start_and_kill_all(command, killed, kill_after=1)
    assert resumed_from < 4 and not os.path.exists(killed / "reward_model.json")
    output = run([*command, "--resume", "auto"])
    assert f"resuming from {checkpoint.step_dir(str(killed), resumed_from)}" in output
    assert_close_metrics(scalars(killed), scalars(uninterrupted), resumed_from)
    weights = saved_tensors(killed), saved_tensors(uninterrupted)
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[1]) <= 1e-5


@pytest.mark.slow
def test_fsdp_checkpoint_of_4_processes_resumes_on_2(runs, world, tmp_path):
    written = runs(4) / run_name("llama", 1, True)
    resumed = tmp_path / "resumed"
    shutil.copytree(written, resumed)
    # as if the 4 processes were stopped after step 2: the later checkpoint and the saved model gone
    shutil.rmtree(checkpoint.step_dir(str(resumed), 4))
    for path in resumed.iterdir():
        if path.name not in (checkpoint.STATE_DIR, "tb"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    flags = reward_flags(world, "llama", resumed, "--fsdp", "--gradient_accumulation_steps", "1", "--resume", "auto")
    output = run(torchrun(2, str(REPO / "train_reward.py"), *flags))
    assert f"resuming from {checkpoint.step_dir(str(resumed), 2)} after 2 of 4" in output
    assert re.search(r"processes\s+│ 2 ", output)
    assert "was written by 4 processes, this run has 2" in output and "reseeded" in output
    # the steps after the checkpoint are the 4 processes' (the same global batches); the samples that normalize the
    # model after training differ (each process's RNGs are reseeded), so gain and bias do
    assert_close_metrics(scalars(resumed), scalars(written), 2, skip=("normalize_after/",))
    weights = saved_tensors(resumed), saved_tensors(written)
    trained = [k for k in weights[1] if not k.endswith((":gain", ":bias"))]
    assert len(trained) > 10
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in trained) <= 1e-5
    assert len(list(Path(checkpoint.step_dir(str(resumed), 4), "sharded").glob("*.distcp"))) == 2


# ---------------------------------------------------------------- in-process checks


def test_another_process_count_resumes_only_under_fsdp():
    settings = {"seed": 1, "world_size": 4}
    resumed = checkpoint.Resumed("ckpt", 2, {"settings": settings}, {}, {})
    on_two = {**settings, "world_size": 2}
    with pytest.raises(ValueError, match="world_size: checkpoint 4, now 2"):
        resumable.check_resume_settings(
            resumed, on_two, resumable.resume_ignored(RewardRunSettings(fsdp=False), ()), False
        )
    assert (
        resumable.check_resume_settings(
            resumed, on_two, resumable.resume_ignored(RewardRunSettings(fsdp=True), ()), False
        )
        is None
    )


def test_query_stream_on_fewer_processes_continues_where_a_run_with_as_many_would(tmp_path, tokenizer):
    corpus = write_query_file(tmp_path / "queries.txt")
    task = books_task(query_dataset=str(corpus), query_length=16, response_length=8)
    texts = load_texts(str(corpus))

    def streams(world: int, per_process: int) -> list[QueryStream]:
        """Every process's stream after one global batch of world * per_process queries."""
        result = [QueryStream(texts, tokenizer, task, rank, world) for rank in range(world)]
        for stream in result:
            stream.next_batch(per_process)
        return result

    written = streams(4, 3)  # 4 processes drew 12 queries
    for rank, stream in enumerate(written):
        torch.save({"query_stream": stream.state_dict()}, tmp_path / checkpoint.RANK_FILE.format(rank=rank))
    for rank, uninterrupted in enumerate(streams(2, 6)):  # 2 processes drew the same 12
        stream = QueryStream(texts, tokenizer, task, rank, 2)
        local = {"query_stream": written[rank].state_dict()}
        resumed = checkpoint.Resumed(str(tmp_path), 2, {"world_size": 4}, {}, local)
        stream.load_state_dict(reward_plumbing.query_stream_state(resumed, stream))
        assert torch.equal(stream.next_batch(5), uninterrupted.next_batch(5))
    # as many processes as wrote it: each its own position
    stream = QueryStream(texts, tokenizer, task, 1, 4)
    resumed = checkpoint.Resumed(str(tmp_path), 2, {"world_size": 4}, {}, {"query_stream": written[1].state_dict()})
    stream.load_state_dict(reward_plumbing.query_stream_state(resumed, stream))
    assert torch.equal(stream.next_batch(2), written[1].next_batch(2))


def test_checkpoint_of_fsdp_run_resumes_only_with_fsdp(tmp_path, world):
    output_dir = tmp_path / "run"
    flags = reward_flags(world, "gpt2", output_dir, "--fsdp", "--normalize_samples", "0", "--eval_interval", "0")
    train_reward.main(train_reward.parse(flags))  # one process: the checkpoint holds DCP shards all the same
    assert os.path.isdir(os.path.join(checkpoint.step_dir(str(output_dir), 4), "sharded"))
    plain = [f for f in flags if f != "--fsdp"]
    # a run cut before its end (a finished run refuses any other setting first)
    shutil.rmtree(checkpoint.step_dir(str(output_dir), 4))
    (output_dir / resumable.SUMMARY_FILE).unlink()
    assert checkpoint.latest_checkpoint(str(output_dir)) is not None
    with pytest.raises(ValueError, match=r"written with --fsdp: resume it with --fsdp"):
        train_reward.main(train_reward.parse([*plain, "--resume", "auto", "--allow_resume_changes"]))
