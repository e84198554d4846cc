"""train_reward.py: unit checks of its helpers, then runs of the real script on a tiny model with planted labels."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import train_reward
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import best_of_n_loss
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    load_causal_lm,
    load_reward_model,
    sample,
)
from tests.planted import REPO, books_task, run_script, write_policy_planted_labels, write_query_file

QUERY_LENGTH, RESPONSE_LENGTH = 16, 8
TASK_FLAGS = [
    "--task.query_length",
    str(QUERY_LENGTH),
    "--task.response_length",
    str(RESPONSE_LENGTH),
    "--task.truncate_after",
    "4",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer, tiny_model_dir):
    """A query corpus and 640 labels on base-policy samples (the best one holds ' happy'): 512 train, 128 held out."""
    root = tmp_path_factory.mktemp("reward-world")
    corpus = write_query_file(root / "queries.txt")
    marker = tokenizer.encode(" happy")[0]
    labels = write_policy_planted_labels(
        root / "labels.json", tiny_model_dir, tokenizer, corpus, 640, QUERY_LENGTH, RESPONSE_LENGTH, marker
    )
    return {"root": root, "corpus": corpus, "labels": labels}


def reward_flags(model_dir, world, output_dir, *extra):
    return [
        "--base_model",
        model_dir,
        "--label_dataset",
        str(world["labels"]),
        "--task.query_dataset",
        str(world["corpus"]),
        *TASK_FLAGS,
        "--labels.num_train",
        "512",
        "--batch_size",
        "16",
        "--lr",
        "3e-3",
        "--rollout_batch_size",
        "256",
        "--normalize_samples",
        "1024",
        "--output_dir",
        str(output_dir),
        *extra,
    ]


def test_best_of_n_loss_is_softmax_cross_entropy():
    rewards = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    expected = -(2.0 - torch.logsumexp(rewards[0], 0))
    assert torch.allclose(best_of_n_loss(rewards, torch.tensor([2])), expected)
    # shift invariance: the bias parameter never gets a gradient from this loss (spec R3)
    assert torch.allclose(best_of_n_loss(rewards + 3.0, torch.tensor([2])), expected)


def test_score_label_rows_matches_separate_forwards(tiny_model_dir, tokenizer):
    reward_model = RewardModel.from_base(tiny_model_dir)
    query = torch.randint(0, 1000, (2, 5))
    query[0, 3:] = tokenizer.pad_token_id
    samples = torch.randint(0, 1000, (2, 4, 3))
    batched = train_reward.score_label_rows(reward_model, query, samples, tokenizer.pad_token_id)
    with torch.no_grad():
        for b in range(2):
            for i in range(4):
                single = reward_model(torch.cat([query[b], samples[b, i]])[None], tokenizer.pad_token_id)
                assert torch.allclose(batched[b, i], single[0], atol=1e-5)


def test_presets_follow_oai_launch():
    tldr, sentiment = train_reward.oai_presets()["tldr"], train_reward.oai_presets()["sentiment"]
    assert (sentiment.labels.num_train, sentiment.batch_size, sentiment.lr, sentiment.rollout_batch_size) == (
        4992,
        32,
        5e-5,
        512,
    )
    assert (tldr.labels.num_train, tldr.batch_size, tldr.lr, tldr.rollout_batch_size) == (46000, 16, 2.5e-5, 128)
    assert tldr.label_dataset == "tldr/online_45k.json" and tldr.task.query_length == 500
    assert train_reward.oai_presets()["descriptiveness"].label_dataset == "descriptiveness/offline_5k.json"


@pytest.mark.slow
def test_train_reward_learns_planted_preference_and_normalizes(tmp_path, tiny_model_dir, world, tokenizer):
    out = tmp_path / "rm"
    result = run_script("train_reward.py", *reward_flags(tiny_model_dir, world, out))
    assert "normalize before: mean" in result.stdout and "normalize after: mean" in result.stdout
    reward_model, meta = load_reward_model(str(out))
    assert meta["eval_after"]["rows"] == 128
    assert meta["eval_after"]["accuracy"] >= 0.9, meta
    assert meta["eval_before"]["accuracy"] < 0.6, meta  # the random head knows nothing of the marker
    # TensorBoard events carry OAI's metric names
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train_reward/minibatch/loss",
        "train_reward/minibatch/error",
        "eval/accuracy",
        "normalize_after/std",
    } <= tags
    assert len(events.Scalars("train_reward/minibatch/loss")) == 512 // 16
    # fresh samples of the base policy score N(0, 1) under the normalized reward model
    task = books_task(query_dataset=str(world["corpus"]), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH)
    stream = QueryStream(load_texts(task.query_dataset), tokenizer, task, rank=0, world_size=1, data_seed=123)
    policy = PolicyWithValueHead(load_causal_lm(tiny_model_dir))
    generator = torch.Generator().manual_seed(7)
    queries = stream.next_batch(512)
    responses, _, _ = sample(policy, queries, RESPONSE_LENGTH, task.temperature, tokenizer.pad_token_id, generator)
    with torch.no_grad():
        scores = reward_model(torch.cat([queries, responses], 1), tokenizer.pad_token_id)
    assert abs(scores.mean().item()) < 0.15 and abs(scores.std(unbiased=False).item() - 1) < 0.15, scores


def test_label_order_is_rank_zero_permutation_of_seed(tmp_path, tiny_model_dir, world):
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(world["labels"]),
        output_dir=str(tmp_path / "rm"),
        task=books_task(query_dataset=str(world["corpus"]), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH),
        labels=train_reward.LabelHParams(num_train=64),
        batch_size=16,
        normalize_before=False,
        normalize_after=False,
    )
    result = train_reward.main(args)
    assert result["label_indices"] == np.random.RandomState(args.seed).permutation(64).tolist()  # spec R6, TV13


def test_gradient_accumulation_gives_the_same_update(tmp_path, tiny_model_dir, world):
    def train(accumulation: int) -> dict:
        args = train_reward.Args(
            base_model=tiny_model_dir,
            label_dataset=str(world["labels"]),
            output_dir=str(tmp_path / f"rm{accumulation}"),
            task=books_task(
                query_dataset=str(world["corpus"]), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH
            ),
            labels=train_reward.LabelHParams(num_train=32),
            batch_size=16,
            gradient_accumulation_steps=accumulation,
            lr=1e-3,
            normalize_before=False,
            normalize_after=False,
        )
        train_reward.main(args)
        return load_reward_model(args.output_dir)[0].state_dict()

    one, four = train(1), train(4)
    for name in one:
        assert torch.allclose(one[name], four[name], atol=1e-6), name
    assert not torch.allclose(one["head.weight"], RewardModel.from_base(tiny_model_dir).head.weight)


@pytest.mark.parametrize("problem", ["missing_field", "best_out_of_range", "too_few_rows"])
def test_malformed_label_file_stops_with_clear_error(tmp_path, tiny_model_dir, world, problem):
    rows = json.loads(world["labels"].read_text())[:64]
    if problem == "missing_field":
        del rows[3]["sample2"]
        expected = ["row 3", "sample2"]
    elif problem == "best_out_of_range":
        rows[5]["best"] = 4
        expected = ["row 5", "best"]
    else:
        expected = ["64", "512"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(rows))
    flags = reward_flags(tiny_model_dir, world, tmp_path / "rm")
    flags[flags.index("--label_dataset") + 1] = str(bad)
    with pytest.raises(AssertionError) as failure:
        run_script("train_reward.py", *flags, timeout=120)
    message = str(failure.value).split("\n", 1)[1]
    assert all(word in message for word in expected), message


def test_sizes_that_do_not_divide_stop_with_the_numbers(tmp_path, tiny_model_dir, world):
    flags = reward_flags(tiny_model_dir, world, tmp_path / "rm", "--batch_size", "24")
    with pytest.raises(AssertionError) as failure:
        run_script("train_reward.py", *flags, timeout=120)
    assert "512" in str(failure.value) and "24" in str(failure.value) and "num_train" in str(failure.value)


def test_missing_base_model_stops_with_clear_error(tmp_path, world):
    flags = reward_flags(str(tmp_path / "no-such-model"), world, tmp_path / "rm")
    with pytest.raises(AssertionError) as failure:
        run_script("train_reward.py", *flags, timeout=120)
    assert "no-such-model" in str(failure.value) and "--base_model" in str(failure.value)


def test_hub_base_model_fails_fast_offline(tmp_path, world):
    flags = reward_flags("gpt2", world, tmp_path / "rm")
    with pytest.raises(AssertionError) as failure:
        run_script("train_reward.py", *flags, timeout=60)
    assert "gpt2" in str(failure.value) and "--base_model" in str(failure.value) and "offline" in str(failure.value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_on_weights_and_shard_labels_like_oai(tmp_path, tiny_model_dir, world):
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import train_reward
        from tests.planted import books_task
        args = train_reward.Args(
            base_model={tiny_model_dir!r}, label_dataset={str(world["labels"])!r}, output_dir={str(tmp_path / "rm")!r},
            task=books_task(query_dataset={str(world["corpus"])!r}, query_length={QUERY_LENGTH},
                             response_length={RESPONSE_LENGTH}),
            labels=train_reward.LabelHParams(num_train=64), batch_size=16, lr=1e-3, rollout_batch_size=32,
            normalize_samples=32,
        )
        result = train_reward.main(args)
        from accelerate import PartialState
        rank = PartialState().process_index
        torch.save(result["model"].state_dict(), {str(tmp_path)!r} + f"/weights{{rank}}.pt")
        json.dump({{"indices": result["label_indices"], "gain": result["gain"], "bias": result["bias"]}},
                  open({str(tmp_path)!r} + f"/rank{{rank}}.json", "w"))
    """)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(launcher),
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    assert ranks[0]["gain"] == ranks[1]["gain"] and ranks[0]["bias"] == ranks[1]["bias"]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    # OAI: rank 0's permutation (seed 1), each step's 16 indices dealt rank-strided: indices[start:start+16][r::2]
    permutation = np.random.RandomState(1).permutation(64)
    for r in range(2):
        expected = np.concatenate([permutation[s : s + 16][r::2] for s in range(0, 64, 16)]).tolist()
        assert ranks[r]["indices"] == expected
