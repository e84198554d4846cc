"""train_reward.py: unit checks of its helpers, then runs of the real script on a tiny model with planted labels."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import train_reward
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import Labels, get_label_type
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    load_causal_lm,
    load_reward_model,
    sample,
)
from lm_human_preference_details.settings import with_run
from tests.planted import (
    REPO,
    books_task,
    free_port,
    run_script,
    without_gpus,
    write_policy_planted_labels,
    write_query_file,
)

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
    best_of_4 = get_label_type("best_of_4")
    stats = train_reward.label_loss(best_of_4, rewards, torch.tensor([2]))
    assert torch.allclose(stats["loss"], expected)
    assert stats.keys() == {"loss", "error"} and stats["error"] is stats["loss"]
    # shift invariance: the bias parameter never gets a gradient from this loss (spec R3)
    assert torch.allclose(train_reward.label_loss(best_of_4, rewards + 3.0, torch.tensor([2]))["loss"], expected)
    # the mean over the rows of the step
    two_rows = torch.cat([rewards, rewards.flip(1)])
    other = -(rewards[0, 3] - torch.logsumexp(rewards[0], 0))
    assert torch.allclose(
        train_reward.label_loss(best_of_4, two_rows, torch.tensor([2, 0]))["loss"], (expected + other) / 2
    )


def test_scalar_rating_loss_and_statistics_match_numpy():
    # OAI label_types.py#L70-L77: MSE of reward vs score, the scores' population mean/var, Pearson r
    generator = torch.Generator().manual_seed(0)
    rewards, score = torch.randn(6, 1, generator=generator), torch.randn(6, generator=generator)
    stats = train_reward.label_loss(get_label_type("scalar_rating"), rewards, score)
    r, y = rewards[:, 0].double().numpy(), score.double().numpy()
    assert stats["loss"].item() == pytest.approx(np.mean((y - r) ** 2), rel=1e-5)
    assert stats["error"].item() == stats["loss"].item()
    assert stats["label_mean"].item() == pytest.approx(y.mean(), abs=1e-6)
    assert stats["label_var"].item() == pytest.approx(y.var(), rel=1e-5)  # numpy var: population
    assert stats["corr"].item() == pytest.approx(np.corrcoef(y, r)[0, 1], rel=1e-5)


def test_scalar_compare_loss_is_mse_of_the_reward_difference():
    # OAI label_types.py#L95-L102: predicted difference = r(sample1) - r(sample0)
    rewards = torch.tensor([[0.5, 2.0], [1.0, -1.0], [0.0, 0.0]])
    difference = torch.tensor([1.0, -1.0, 3.0])
    stats = train_reward.label_loss(get_label_type("scalar_compare"), rewards, difference)
    assert stats.keys() == {"loss", "error"}
    assert stats["loss"].item() == pytest.approx(((1.0 - 1.5) ** 2 + (-1.0 + 2.0) ** 2 + 3.0**2) / 3)


def test_normalization_targets_follow_the_label_type():
    # before training the reward is scaled to the labels: scores (rating), differences / 2 (compare), N(0, 1) (best)
    values = torch.tensor([1.0, 2.0, 4.0, 5.0])
    labels = Labels(torch.ones(4, 3, dtype=torch.long), torch.ones(4, 2, 2, dtype=torch.long), values)
    assert train_reward.normalization_target(get_label_type("scalar_rating"), labels) == pytest.approx(
        (3.0, 1.58113883)
    )
    assert train_reward.normalization_target(get_label_type("scalar_compare"), labels) == pytest.approx(
        (1.5, 0.790569415)
    )
    best = Labels(labels.query, labels.samples, torch.tensor([0, 1, 0, 1]))
    assert train_reward.normalization_target(get_label_type("best_of_2"), best) == (0.0, 1.0)


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
    tldr, sentiment = train_reward.task_presets()["tldr"], train_reward.task_presets()["sentiment"]
    assert (sentiment.labels.num_train, sentiment.batch_size, sentiment.lr, sentiment.rollout_batch_size) == (
        4992,
        32,
        5e-5,
        512,
    )
    assert (tldr.labels.num_train, tldr.batch_size, tldr.lr, tldr.rollout_batch_size) == (46000, 16, 2.5e-5, 128)
    assert tldr.label_dataset == "tldr/online_45k.json" and tldr.task.query_length == 500
    assert train_reward.task_presets()["descriptiveness"].label_dataset == "descriptiveness/offline_5k.json"


@pytest.mark.slow
def test_train_reward_learns_planted_preference_and_normalizes(tmp_path, tiny_model_dir, world, tokenizer):
    out = tmp_path / "rm"
    result = run_script("train_reward.py", *reward_flags(tiny_model_dir, world, out))
    assert "normalize before: mean" in result.stdout and "normalize after: mean" in result.stdout
    assert "Loading weights" not in result.stdout + result.stderr  # transformers' per-load bars are silenced
    reward_model, meta = load_reward_model(str(out))
    assert (meta["task_name"], meta["label_dataset"]) == ("sentiment", str(world["labels"]))  # checked by the policy
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
        task=books_task(query_dataset=str(world["corpus"]), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH),
        labels=train_reward.LabelHParams(num_train=64),
        batch_size=16,
        normalize_before=False,
        normalize_after=False,
    )
    args = with_run(args, output_dir=str(tmp_path / "rm"))
    result = train_reward.main(args)
    assert result["label_indices"] == np.random.RandomState(args.seed).permutation(64).tolist()  # spec R6, TV13


def test_gradient_accumulation_gives_the_same_update(tmp_path, tiny_model_dir, world):
    def train(accumulation: int) -> dict:
        args = train_reward.Args(
            base_model=tiny_model_dir,
            label_dataset=str(world["labels"]),
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
        args = with_run(args, output_dir=str(tmp_path / f"rm{accumulation}"))
        train_reward.main(args)
        return load_reward_model(args.run.output_dir)[0].state_dict()

    one, four = train(1), train(4)
    for name in one:
        assert torch.allclose(one[name], four[name], atol=1e-6), name
    assert not torch.allclose(one["head.weight"], RewardModel.from_base(tiny_model_dir).head.weight)


def test_gradient_checkpointing_and_bf16_runs_track_the_plain_run(tmp_path, tiny_model_dir, world, one_thread):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    small = tmp_path / "labels.json"  # 64 training rows and 16 held out keep the evaluations short
    small.write_text(json.dumps(json.loads(world["labels"].read_text())[:80]))

    def train(name: str, **flags) -> tuple[dict, list[float]]:
        args = reward_args(
            tmp_path / name,
            tiny_model_dir,
            world,
            small,
            labels=train_reward.LabelHParams(num_train=64),
            normalize_before=False,
            **flags,
        )
        train_reward.main(args)
        events = EventAccumulator(os.path.join(args.run.output_dir, "tb"))
        events.Reload()
        losses = [event.value for event in events.Scalars("train_reward/minibatch/loss")]
        return load_reward_model(args.run.output_dir)[0].state_dict(), losses

    plain, plain_losses = train("plain")
    checkpointed, checkpointed_losses = train("checkpointed", gradient_checkpointing=True)
    bf16, bf16_losses = train("bf16", bf16=True)
    assert len(plain_losses) == 4
    # gradient checkpointing: the same run (measured: bit-identical on CPU; tolerance 1e-6)
    assert checkpointed_losses == pytest.approx(plain_losses, abs=1e-6)
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, atol=1e-6, rtol=0, msg=name)
    # bf16 autocast of the trunk: the loss curve tracks float32's (tolerance 0.03 per step, as in test_modeling)
    assert bf16_losses == pytest.approx(plain_losses, abs=0.03) and bf16_losses != plain_losses
    assert max((bf16[name] - value).abs().max().item() for name, value in plain.items()) < 1e-2


def write_scalar_labels(world, path, kind: str, n: int) -> np.ndarray:
    """The world's best-of-4 rows as scalar labels: the planted best sample scores high; returns the label values."""
    rows, values = [], []
    for k, row in enumerate(json.loads(world["labels"].read_text())[:n]):
        best, other = row["best"], (row["best"] + 1 + k % 3) % 4
        if kind == "scalar_rating":
            index = best if k % 2 else other
            value = (1.0 if index == best else -1.0) + 0.25 * (k % 3)
            rows.append({"query": row["query"], "sample": row[f"sample{index}"], "score": value})
        else:
            first, second = (best, other) if k % 2 else (other, best)
            value = (2.0 if second == best else -2.0) + 0.5 * (k % 3)  # score1 - score0
            rows.append({"query": row["query"], "sample0": row[f"sample{first}"], "sample1": row[f"sample{second}"]})
            rows[-1]["difference"] = value
        values.append(value)
    path.write_text(json.dumps(rows))
    return np.array(values)


def reward_args(tmp_path, model_dir, world, label_file, **overrides) -> train_reward.Args:
    """A tiny in-process reward run: 16-token queries, 8-token responses."""
    task = books_task(query_dataset=str(world["corpus"]), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH)
    settings = dict(batch_size=16, lr=1e-3, rollout_batch_size=16, normalize_samples=16, normalize_after=False)
    settings.update(overrides)
    run = {key: settings.pop(key) for key in list(settings) if key in ("gradient_checkpointing", "bf16")}
    args = train_reward.Args(base_model=model_dir, label_dataset=str(label_file), task=task, **settings)
    return with_run(args, output_dir=str(tmp_path / "rm"), **run)


@pytest.mark.parametrize("kind", ["scalar_rating", "scalar_compare"])
def test_scalar_labels_train_with_oai_statistics_and_targets(tmp_path, tiny_model_dir, world, kind):
    values = write_scalar_labels(world, tmp_path / "labels.json", kind, 48)
    labels = train_reward.LabelHParams(type=kind, num_train=32)
    result = train_reward.main(reward_args(tmp_path, tiny_model_dir, world, tmp_path / "labels.json", labels=labels))
    # normalize_before targets the labels' scale: mean and population std of scores, or of differences / 2
    scales = values[:32] / (2.0 if kind == "scalar_compare" else 1.0)
    before = result["normalization"]["before"]
    assert (before["target_mean"], before["target_std"]) == pytest.approx((scales.mean(), scales.std()), rel=1e-6)
    assert before["gain"] == pytest.approx(scales.std() / before["std"], rel=1e-5)
    assert result["eval_after"]["rows"] == 16 and "accuracy" not in result["eval_after"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "rm" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    extra = {"label_mean", "label_var", "corr"} if kind == "scalar_rating" else set()
    assert {t for t in tags if t.startswith("train_reward/")} == {
        f"train_reward/minibatch/{k}" for k in {"loss", "error"} | extra
    }
    assert "eval/loss" in tags and "eval/accuracy" not in tags and "debug/accuracy" not in tags
    if kind == "scalar_rating":  # step 0's labels: the first 16 of rank 0's permutation (seed 1)
        first = values[np.random.RandomState(1).permutation(32)[:16]]
        logged = events.Scalars("train_reward/minibatch/label_mean")[0].value
        assert logged == pytest.approx(first.mean(), rel=1e-5)
        assert events.Scalars("train_reward/minibatch/label_var")[0].value == pytest.approx(first.var(), rel=1e-4)
    assert load_reward_model(str(tmp_path / "rm"))[1]["label_type"] == kind


def test_label_type_other_than_the_file_names_the_right_flag(tmp_path, tiny_model_dir, world):
    write_scalar_labels(world, tmp_path / "labels.json", "scalar_compare", 32)
    args = reward_args(tmp_path, tiny_model_dir, world, tmp_path / "labels.json")
    args.labels.num_train = 32
    with pytest.raises(ValueError, match="holds scalar_compare labels .* --labels.type scalar_compare"):
        train_reward.main(args)


@pytest.mark.floor
def test_normalize_samples_zero_skips_normalization(tmp_path, tiny_model_dir, world):
    # OAI's normalize() returns at once when normalize_samples is 0: gain and bias are not even reset
    args = reward_args(tmp_path, tiny_model_dir, world, world["labels"], normalize_samples=0, normalize_after=True)
    args.labels.num_train = 32
    result = train_reward.main(args)
    assert result["normalization"] == {"before": None, "after": None}
    # the best-of-N loss gives the bias no gradient (up to rounding): only a normalization moves it far from 0
    assert abs(result["bias"]) < 1e-6 and result["gain"] != 1.0


def test_debug_normalize_scores_fresh_samples_after_normalizing(tmp_path, tiny_model_dir, world, capsys):
    overrides = dict(normalize_samples=128, rollout_batch_size=64, debug_normalize=128)
    args = reward_args(tmp_path, tiny_model_dir, world, world["labels"], **overrides)
    args.labels.num_train = 16
    before = train_reward.main(args)["normalization"]["before"]
    # 128 fresh samples under the new gain/bias: close to the N(0, 1) target, but not the normalized sample itself
    assert abs(before["debug_mean"]) < 0.4 and abs(before["debug_std"] - 1) < 0.4, before
    assert (before["debug_mean"], before["debug_std"]) != pytest.approx((0.0, 1.0), abs=1e-4)
    assert "normalize before: after normalize" in capsys.readouterr().out


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
            base_model={tiny_model_dir!r}, label_dataset={str(world["labels"])!r},
            task=books_task(query_dataset={str(world["corpus"])!r}, query_length={QUERY_LENGTH},
                             response_length={RESPONSE_LENGTH}),
            labels=train_reward.LabelHParams(num_train=64), batch_size=16, lr=1e-3, rollout_batch_size=32,
            normalize_samples=32,
        )
        args.run.output_dir = {str(tmp_path / "rm")!r}
        result = train_reward.main(args)
        from accelerate import PartialState
        rank = PartialState().process_index
        torch.save(result["model"].state_dict(), {str(tmp_path)!r} + f"/weights{{rank}}.pt")
        json.dump({{"indices": result["label_indices"], "gain": result["gain"], "bias": result["bias"]}},
                  open({str(tmp_path)!r} + f"/rank{{rank}}.json", "w"))
    """)
    )
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
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


def test_reward_run_logs_each_statistic_by_its_formula(tmp_path, tiny_model_dir, world, monkeypatch):
    # spec §4.2, R4, R6, O5: per step, train_reward/minibatch/loss and error = the cross-entropy of the step's rewards
    # against its labels' best, debug/accuracy = the share whose best sample has the highest reward, debug/lr =
    # lr * (1 - labels done / num_train); normalize_before/* from what was measured, and --debug_normalize 16 (not
    # --normalize_samples 8) fresh samples after it
    from lm_human_preference_details import tracking

    logged, step_rewards, moments = [], [], []
    score, measure = train_reward.score_label_rows, train_reward.reward_moments
    monkeypatch.setattr(tracking.Tracker, "log", lambda self, metrics, step: logged.append((step, metrics)) or None)

    def recording_score(*args, **kwargs):
        rewards = score(*args, **kwargs)
        if torch.is_grad_enabled():  # a training step's micro-batch, not the held-out evaluation
            step_rewards.append(rewards.detach().double())
        return rewards

    def recording_moments(*args):
        out = measure(*args)
        moments.append((args[-1], out[0].item(), out[1].item(), out[2]))
        return out

    monkeypatch.setattr(train_reward, "score_label_rows", recording_score)
    monkeypatch.setattr(train_reward, "reward_moments", recording_moments)
    rows = json.loads(world["labels"].read_text())[:32]  # 24 to train on, 8 held out
    (tmp_path / "labels.json").write_text(json.dumps(rows))
    sizes = dict(batch_size=8, rollout_batch_size=8, normalize_samples=8, debug_normalize=16)
    args = reward_args(tmp_path, tiny_model_dir, world, tmp_path / "labels.json", lr=1e-2, **sizes)
    args.labels.num_train = 24
    train_reward.main(args)
    assert [(n, count) for n, _, _, count in moments] == [(8, 8), (16, 16)]
    _, mean, std, _ = moments[0]
    (normalized,) = [metrics for _, metrics in logged if "normalize_before/gain" in metrics]
    assert (normalized["normalize_before/mean"], normalized["normalize_before/std"]) == pytest.approx((mean, std))
    assert normalized["normalize_before/gain"] == pytest.approx(1 / std, rel=1e-5)
    assert normalized["normalize_before/bias"] == pytest.approx(-mean / std, rel=1e-5, abs=1e-6)
    assert (normalized["normalize_before/debug_mean"], normalized["normalize_before/debug_std"]) == (
        pytest.approx(moments[1][1]),
        pytest.approx(moments[1][2]),
    )
    best = torch.tensor([row["best"] for row in rows[:24]])
    order = np.random.RandomState(args.seed).permutation(24)
    steps = [metrics for _, metrics in logged if "train_reward/minibatch/loss" in metrics]
    assert len(steps) == len(step_rewards) == 3
    for step, (metrics, rewards) in enumerate(zip(steps, step_rewards)):
        label = best[order[8 * step : 8 * (step + 1)]]
        loss = (torch.logsumexp(rewards, 1) - rewards.gather(1, label[:, None])[:, 0]).mean().item()
        accuracy = (rewards.argmax(1) == label).double().mean().item()
        assert metrics["train_reward/minibatch/loss"] == pytest.approx(loss, rel=1e-5), step
        assert metrics["train_reward/minibatch/error"] == metrics["train_reward/minibatch/loss"]
        assert metrics["debug/accuracy"] == pytest.approx(accuracy), step
        assert metrics["debug/lr"] == pytest.approx(1e-2 * (1 - 8 * step / 24)), step
    assert len({metrics["debug/accuracy"] for metrics in steps}) > 1  # the accuracy moves: not a constant


def test_scalar_labels_normalize_after_training_to_mean_zero_std_one(tmp_path, tiny_model_dir, world):
    # spec R4: only normalize_before targets the labels' scale; normalize_after always targets N(0, 1), whatever the
    # label type (a scalar_rating file whose scores have mean ~2.3 and std ~1.3 tells the two apart)
    values = write_scalar_labels(world, tmp_path / "labels.json", "scalar_rating", 24)
    labels = train_reward.LabelHParams(type="scalar_rating", num_train=16)
    settings = dict(
        batch_size=8, rollout_batch_size=8, normalize_samples=8, normalize_before=False, normalize_after=True
    )
    result = train_reward.main(
        reward_args(tmp_path, tiny_model_dir, world, tmp_path / "labels.json", labels=labels, **settings)
    )
    after = result["normalization"]["after"]
    assert (values[:16].mean(), values[:16].std()) != pytest.approx((0.0, 1.0), abs=0.1)
    assert (after["target_mean"], after["target_std"]) == (0.0, 1.0)
    assert (result["gain"], result["bias"]) == pytest.approx(
        (1 / after["std"], -after["mean"] / after["std"]), rel=1e-5
    )


def test_reward_run_under_end_at_eos_trains_and_normalizes_on_responses_that_end_at_eos(
    tmp_path, tiny_model_dir, world, tokenizer, monkeypatch
):
    # nplus N3: each preference response ends with the EOS token; nplus N19: the normalization scores the policy's
    # samples cut at their first EOS, as PPO's reward will see them
    from lm_human_preference_details import modeling

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    corpus = world["corpus"].read_text().splitlines()
    pairs = [{"prompt": corpus[i].split(".")[0] + ".", "chosen": " happy", "rejected": " sad day"} for i in range(16)]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    trained, scored = [], []
    score = train_reward.score_label_rows
    monkeypatch.setattr(train_reward, "score_label_rows", lambda *a, **k: trained.append(a) or score(*a, **k))
    forward = modeling.RewardModel.forward

    def recording_forward(self, query_responses, *args, **kwargs):
        if not torch.is_grad_enabled():
            scored.append(query_responses[:, QUERY_LENGTH:].clone())
        return forward(self, query_responses, *args, **kwargs)

    monkeypatch.setattr(modeling.RewardModel, "forward", recording_forward)
    monkeypatch.setattr(train_reward, "sample", eos_in_the_middle(train_reward.sample, eos))
    args = reward_args(tmp_path, tiny_model_dir, world, tmp_path / "prefs.jsonl", batch_size=8)
    args.labels.type, args.labels.num_train = "best_of_2", 16
    args.task.end_at_eos, args.task.truncate_text, args.task.truncate_token = True, None, None
    train_reward.main(args)
    samples = torch.cat([a[2] for a in trained]) if trained else None  # (rows, 2, L) of score_label_rows
    assert samples is not None
    for row in samples.reshape(-1, samples.shape[-1]).tolist():
        real = [t for t in row if t != pad]
        assert real[-1] == eos and eos not in real[:-1]
    assert scored, "the normalization scored no samples"
    for responses in scored:
        for row in responses.tolist():
            if eos in row:
                assert set(row[row.index(eos) + 1 :]) <= {pad}, row


def eos_in_the_middle(sample, eos: int):
    """The sampler, with EOS written into every response's third token (so there is something after it to cut)."""

    def sampled(*args, **kwargs):
        responses, logprobs, values = sample(*args, **kwargs)
        responses = responses.clone()
        responses[:, 2] = eos
        return responses, logprobs, values

    return sampled
