"""lm_human_preference_details/evaluation.py and evaluate.py: episodes, KL, scores and statistics checked against direct
computations on tiny offline models; the command run as a user would."""

import dataclasses
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from evaluate import consumed_queries, held_out, main, parse, query_offset, run_normalization
from lm_human_preference_details import files, tracking
from lm_human_preference_details.data import QueryStream
from lm_human_preference_details.evaluation import (
    GOLD,
    KL,
    PASS,
    SCORE,
    Episodes,
    examples,
    heldout_queries,
    markdown,
    mean_and_stderr,
    sample_and_score,
    summarize,
    win_rate,
)
from lm_human_preference_details.labelers import Labeler
from lm_human_preference_details.modeling import PolicyWithValueHead, RewardModel, load_causal_lm
from lm_human_preference_details.rewards import RewardModelReward
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.tasks import TaskHParams
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.conftest import small_vocab_gpt2, tiny_gpt2
from tests.planted import run_script, write_query_file
from tests.test_train_policy import tiny_task
from train_policy import Args as PolicyArgs
from train_policy import main as policy_main

PAD = 50257
TEMPERATURE = 0.7


pytestmark = pytest.mark.usefixtures("single_thread")


class TruncatedLength(Labeler):
    """A judge scoring each response by its number of real (non-PAD) tokens: shows what the judges are given."""

    name = "length"

    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        return (responses != PAD).sum(-1).float()


def task(**fields) -> TaskHParams:
    """Short queries and responses; a prefix and a suffix so that contexts differ from queries."""
    defaults = dict(
        query_length=6, query_dataset="unused", response_length=8, truncate_after=4, temperature=TEMPERATURE
    )
    return TaskHParams(**{**defaults, "query_prefix": "Story:", "query_suffix": " Next:", **fields})


def context_rows(tokenizer, queries: torch.Tensor, settings: TaskHParams) -> list[list[int]]:
    """prefix + real query tokens + suffix of every row, PADs dropped (what a pads-invisible model attends to)."""
    prefix = tokenizer.encode(settings.query_prefix)
    suffix = tokenizer.encode(settings.query_suffix)
    return [prefix + [t for t in row if t != PAD] + suffix for row in queries.tolist()]


def direct_logprobs(lm, context: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the response tokens from one plain HF forward of the unpadded sequence."""
    with torch.no_grad():
        logits = lm(torch.tensor([context + response])).logits[0, len(context) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def random_queries(generator_seed: int, n: int, length: int, pad_tail: bool) -> torch.Tensor:
    """(n, length) ordinary word tokens; with pad_tail, rows end with 0..2 PADs (right padding)."""
    generator = torch.Generator().manual_seed(generator_seed)
    queries = torch.randint(300, 20000, (n, length), generator=generator)
    if pad_tail:
        for row in range(n):
            pads = row % 3
            if pads:
                queries[row, -pads:] = PAD
    return queries


# ---------------------------------------------------------------- KL


def test_kl_of_a_policy_against_itself_is_zero(tokenizer):
    policy = PolicyWithValueHead(tiny_gpt2(0))
    reward_model = RewardModelReward(RewardModel(tiny_gpt2(2).transformer), PAD)
    queries = random_queries(0, 6, 6, pad_tail=True)
    episodes = sample_and_score(
        policy, policy, queries, task(), tokenizer, reward_model, {}, torch.Generator().manual_seed(1), batch_size=4
    )
    assert episodes.responses.shape == (6, 8)
    # sampling-pass log-probs (KV cache) and the forward's agree to float rounding
    torch.testing.assert_close(episodes.metrics[KL], torch.zeros(6), atol=1e-4, rtol=0)


def test_kl_matches_a_direct_recomputation(tokenizer):
    lm, ref_lm = tiny_gpt2(0), tiny_gpt2(1)
    settings = task()
    queries = random_queries(3, 5, 6, pad_tail=True)
    episodes = sample_and_score(
        PolicyWithValueHead(lm),
        PolicyWithValueHead(ref_lm),
        queries,
        settings,
        tokenizer,
        RewardModelReward(RewardModel(tiny_gpt2(2).transformer), PAD),
        {},
        torch.Generator().manual_seed(0),
        batch_size=2,
    )
    expected = []
    for context, response in zip(context_rows(tokenizer, queries, settings), episodes.responses.tolist()):
        policy_lp = direct_logprobs(lm, context, response, TEMPERATURE)
        ref_lp = direct_logprobs(ref_lm, context, response, TEMPERATURE)
        expected.append((policy_lp - ref_lp).sum().item())
    expected = torch.tensor(expected, dtype=torch.float32)
    assert expected.abs().min() > 1e-2  # two different models: the check is not trivially 0 = 0
    torch.testing.assert_close(episodes.metrics[KL], expected, atol=2e-4, rtol=1e-4)


def test_sampling_is_paired_by_seed(tokenizer):
    policy = PolicyWithValueHead(tiny_gpt2(0))
    reward_model = RewardModelReward(RewardModel(tiny_gpt2(2).transformer), PAD)
    queries = random_queries(0, 4, 6, pad_tail=False)
    runs = [
        sample_and_score(
            policy, policy, queries, task(), tokenizer, reward_model, {}, torch.Generator().manual_seed(seed), 4
        )
        for seed in (5, 5, 6)
    ]
    assert torch.equal(runs[0].responses, runs[1].responses)
    assert not torch.equal(runs[0].responses, runs[2].responses)


# ---------------------------------------------------------------- scores, filter penalty, judges


def test_scores_are_the_reward_model_on_truncated_responses_with_the_filter_penalty(tokenizer, small_vocab_words):
    truncate_token, truncate_after, penalty = small_vocab_words["the"], 4, -1.5
    settings = task(truncate_token=truncate_token, truncate_after=truncate_after, penalty_reward_value=penalty)
    policy = PolicyWithValueHead(small_vocab_gpt2(list(small_vocab_words.values())))
    reward_model = RewardModel(tiny_gpt2(2).transformer)
    with torch.no_grad():
        reward_model.gain.fill_(1.7)
        reward_model.bias.fill_(-0.3)
    queries = random_queries(1, 24, 6, pad_tail=True)
    judges = {GOLD: TruncatedLength()}
    episodes = sample_and_score(
        policy,
        policy,
        queries,
        settings,
        tokenizer,
        RewardModelReward(reward_model, PAD),
        judges,
        torch.Generator().manual_seed(0),
        8,
    )
    expected_score, expected_pass, expected_length = [], [], []
    for query, response in zip(queries.tolist(), episodes.responses.tolist()):
        # first truncate_token at index >= truncate_after ends the response; without one the filter fails
        cut = next((i for i in range(truncate_after, len(response)) if response[i] == truncate_token), None)
        kept = response if cut is None else response[: cut + 1]
        tokens = [t for t in query if t != PAD] + kept  # raw query (no prefix/suffix) ⊕ truncated response
        with torch.no_grad():
            hidden = reward_model.trunk(torch.tensor([tokens])).last_hidden_state[0, -1]
            reward = (1.7 * reward_model.head(hidden) - 0.3).item()
        expected_pass.append(cut is not None)
        expected_score.append(reward if cut is not None else penalty)
        expected_length.append(len(kept))
    assert 0 < sum(expected_pass) < len(expected_pass)  # both cases occur
    assert episodes.metrics[PASS].tolist() == [float(p) for p in expected_pass]
    torch.testing.assert_close(episodes.metrics[SCORE], torch.tensor(expected_score), atol=1e-4, rtol=1e-4)
    assert episodes.metrics[GOLD].tolist() == [float(n) for n in expected_length]
    assert (episodes.truncated != PAD).sum(1).tolist() == expected_length


# ---------------------------------------------------------------- statistics


def test_mean_and_stderr_equal_numpy():
    values = np.random.default_rng(0).normal(size=37)
    stats = mean_and_stderr(torch.tensor(values, dtype=torch.float32))
    assert stats["mean"] == pytest.approx(values.mean(), abs=1e-6)
    assert stats["stderr"] == pytest.approx(values.std(ddof=1) / math.sqrt(37), rel=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        mean_and_stderr(torch.tensor([1.0]))


def test_win_rate_counts_ties_as_half():
    candidate = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.5])
    baseline = torch.tensor([0.0, 2.0, 5.0, 4.0, -1.0])
    # win, tie, loss, tie, win
    assert win_rate(candidate, baseline) == pytest.approx((1 + 0.5 + 0 + 0.5 + 1) / 5)
    assert win_rate(baseline, candidate) == pytest.approx((0 + 0.5 + 1 + 0.5 + 0) / 5)
    with pytest.raises(ValueError, match="paired"):
        win_rate(candidate, baseline[:3])


def hand_made_episodes(scores: list[float], gold: list[float], kl: list[float]) -> Episodes:
    """Episodes of 3 tokens per response with the given per-episode metrics."""
    n = len(scores)
    responses = torch.arange(n * 3).view(n, 3) + 400
    metrics = {SCORE: torch.tensor(scores), GOLD: torch.tensor(gold), KL: torch.tensor(kl), PASS: torch.ones(n)}
    return Episodes(responses=responses, truncated=responses, metrics=metrics)


def test_summarize_reports_mean_stderr_and_win_rates():
    base = hand_made_episodes([0.0, 1.0, 2.0, 1.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 0.0])
    trained = hand_made_episodes([1.0, 1.0, 3.0, 0.0], [0.5, 0.1, 0.9, 0.4], [2.0, 4.0, 3.0, 1.0])
    summary = summarize(base, trained)
    assert set(summary["metrics"]) == {SCORE, GOLD, KL, PASS}
    kl = summary["metrics"][KL]["trained"]
    assert kl["mean"] == pytest.approx(2.5)
    assert kl["stderr"] == pytest.approx(np.std([2, 4, 3, 1], ddof=1) / 2)
    assert summary["win_rate"] == pytest.approx({SCORE: (1 + 0.5 + 1 + 0) / 4, GOLD: (1 + 0 + 1 + 0.5) / 4})


def test_report_is_written_as_json_and_markdown(tmp_path, tokenizer):
    base = hand_made_episodes([0.0, 1.0, 2.0], [0.1, 0.2, 0.3], [0.0, -1e-6, 0.0])  # KL ~ -3e-7 reads +0.000
    trained = hand_made_episodes([1.0, 2.0, 3.0], [0.4, 0.5, 0.6], [1.0, 2.0, 3.0])
    queries = torch.tensor([[464, 3797, PAD], [32, 3290, 13], [40, PAD, PAD]])
    report = {
        "policy": "models/policy",
        "base_model": "gpt2",
        "gold": "vader",
        "seed": 1,
        "task": dataclasses.asdict(task()),
        "queries": {"dataset": "q.txt", "split": "train", "data_seed": 0, "skip": 16, "num": 3, "held_out": True},
        **summarize(base, trained),
        "examples": examples(tokenizer, queries, base, trained, 2),
    }
    files.write_json_atomic(str(tmp_path / "results.json"), report)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["win_rate"] == {SCORE: 1.0, GOLD: 1.0}
    assert saved["metrics"][GOLD]["trained"]["mean"] == pytest.approx(0.5)
    assert saved["examples"][0]["query"] == "The cat"
    assert saved["examples"][1]["trained"][SCORE] == 2.0 and len(saved["examples"]) == 2
    text = markdown(report)
    assert "| metric | base | trained | win rate (trained > base) |" in text
    assert "| gold score (vader) | +0.200 ± 0.058 | +0.500 ± 0.058 | 1.000 |" in text
    assert "| KL to the base model, nats | +0.000 ± 0.000 | +2.000 ± 0.577 |  |" in text
    assert "| The cat |" in text


# ---------------------------------------------------------------- held-out queries


def test_heldout_queries_continue_the_training_stream(tmp_path, tokenizer):
    texts = (write_query_file(tmp_path / "q.txt", n=40).read_text()).splitlines()
    settings = TaskHParams(query_length=16, query_dataset="q.txt", response_length=4, start_text=None)
    stream = QueryStream(texts, tokenizer, settings, 0, 1, data_seed=3)
    expected = stream.next_batch(30)[25:]
    queries, wrapped, _, distinct = heldout_queries(texts, tokenizer, settings, data_seed=3, skip=25, n=5)
    assert torch.equal(queries, expected) and not wrapped and distinct == 5
    _, wrapped, _, distinct = heldout_queries(texts, tokenizer, settings, data_seed=3, skip=25, n=20)
    assert wrapped and distinct == 20  # 45 queries of 40 texts: the 20 past query 25 are still 20 texts
    _, _, _, distinct = heldout_queries(texts, tokenizer, settings, data_seed=3, skip=25, n=50)
    assert distinct == 40  # 50 queries of 40 texts repeat 10 of them


@pytest.mark.slow
def test_more_queries_than_the_query_file_has_texts_is_refused_before_the_evaluation(tiny_run, tmp_path):
    # 64 queries of 10 texts: each text sampled 6-7 times, reported as "64 queries" with standard errors over n = 64
    _, policy, _, _ = tiny_run
    ten = write_query_file(tmp_path / "ten.txt", n=10)
    out = tmp_path / "eval"
    flags = ["--policy", policy, "--task.query_dataset", str(ten), "--batch_size", "8", "--output_dir", str(out)]
    result = run_script("evaluate.py", *flags, "--num_queries", "64", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[0] == (
        f"error: --num_queries 64 is more queries than --task.query_dataset '{ten}' (train) has: it holds 10 texts, "
        "so the stream would repeat each about 6.4 times and the report would count every repeat as another query "
        "(its standard errors too small); pass --num_queries 10 or fewer, or a query dataset with more texts."
    )
    assert not out.exists()  # refused before anything was sampled or written
    # the fix it names: every text once
    run_script("evaluate.py", *flags, "--num_queries", "10")
    report = json.loads((out / "results.json").read_text())
    assert report["queries"]["num"] == 10 and report["queries"]["held_out"] is True
    assert "10 queries of" in (out / "results.md").read_text()


def test_query_offset_skips_what_the_run_consumed():
    run = {"task": {"query_dataset": "q.txt"}, "data_seed": 0, "ppo": {"total_episodes": 100, "batch_size": 32}}
    assert consumed_queries(run) == 128  # ceil(100 / 32) updates of 32
    args = parse(["--task.query_dataset", "q.txt", "--policy", "p"])
    assert query_offset(args, [run]) == 128
    assert held_out(args, [run], 128, wrapped=False) is True
    assert held_out(args, [run], 128, wrapped=True) is False
    assert held_out(args, [run], 0, wrapped=False) is False
    assert held_out(args, [], 0, wrapped=False) is None
    other = parse(["--task.query_dataset", "other.txt", "--policy", "p"])
    assert query_offset(other, [run]) == 0 and held_out(other, [run], 0, wrapped=False) is True
    reseeded = parse(["--task.query_dataset", "q.txt", "--data_seed", "1", "--policy", "p"])
    assert query_offset(reseeded, [run]) == 0 and held_out(reseeded, [run], 500, wrapped=False) is False


# ---------------------------------------------------------------- the command


SHARPNESS = 5.0
"""how much sharper the saved policies' output distributions are than a random tiny model's: as a trained policy, they
differ from the base model by nats of KL per response for any sampling seed (near-uniform random models differ by
~0.1 nats, which 12 sampled queries estimated from -0.07 to 0.58 depending on the seed)"""


def save_tiny_run(
    path, model_dir: str, tokenizer, query_file: str, reward_dir: str, seed: int, episodes: int, run_dir=None
) -> str:
    """A policy directory as train_policy.py writes it: LM + value head, tokenizer, args.json (of run_dir's run)."""
    model = tiny_gpt2(seed)
    with torch.no_grad():  # ln_f feeds the tied LM head: logits SHARPNESS times the random model's
        model.transformer.ln_f.weight.mul_(SHARPNESS)
        model.transformer.ln_f.bias.mul_(SHARPNESS)
    PolicyWithValueHead(model).save(str(path))
    tokenizer.save_pretrained(str(path))
    args = with_run(PolicyArgs(base_model=model_dir, data_seed=0), output_dir=str(run_dir or path))
    args.task = dataclasses.replace(
        args.task, query_dataset=query_file, query_length=16, response_length=8, truncate_after=2
    )
    args.rewards.trained_model, args.rewards.gold_model = reward_dir, "vader"
    args.ppo.total_episodes, args.ppo.batch_size = episodes, 8
    tracking.save_args(args, str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir, tokenizer):
    root = tmp_path_factory.mktemp("eval-run")
    query_file = str(write_query_file(root / "queries.txt", n=60))
    reward_dir = root / "reward"
    metadata = {
        "tokenizer": tiny_model_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    RewardModel.from_base(tiny_model_dir).save(str(reward_dir), metadata)
    policy = save_tiny_run(root / "policy", tiny_model_dir, tokenizer, query_file, str(reward_dir), 1, 20)
    return root, policy, query_file, str(reward_dir)


def test_parse_takes_the_training_settings_from_args_json(tiny_run, tiny_model_dir):
    _, policy, query_file, reward_dir = tiny_run
    args = parse(["--policy", policy, "--num_queries", "4"])
    assert (args.base_model, args.reward_model, args.gold) == (tiny_model_dir, reward_dir, "vader")
    assert (args.task.query_dataset, args.task.query_length, args.task.truncate_after) == (query_file, 16, 2)
    assert parse(["--policy", policy, "--task.response_length", "5"]).task.response_length == 5
    preset = parse(["--policy", policy, "--task", "tldr"])
    assert preset.task.query_length == 500 and preset.base_model is None  # None: the run's, resolved in main


def test_bad_input_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="nothing to evaluate"):
        main(parse([]))
    with pytest.raises(FileNotFoundError, match="--policy directory"):
        main(parse(["--policy", str(tmp_path / "missing")]))
    with pytest.raises(FileNotFoundError, match="--checkpoints"):
        main(parse(["--checkpoints", str(tmp_path / "update*")]))
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
def test_evaluate_command_writes_results_and_the_gold_vs_kl_plot(tiny_run, tiny_model_dir, tokenizer):
    root, policy, query_file, reward_dir = tiny_run
    checkpoint_root = root / "kl_run"
    for seed, name in ((2, "update8"), (3, "update16")):
        path = checkpoint_root / "checkpoints" / name
        save_tiny_run(path, tiny_model_dir, tokenizer, query_file, reward_dir, seed, 16, run_dir=checkpoint_root)
    out = root / "eval"
    flags = [
        "--policy",
        policy,
        "--checkpoints",
        str(checkpoint_root / "checkpoints" / "update*"),
        "--num_queries",
        "12",
    ]
    result = run_script("evaluate.py", *flags, "--batch_size", "8", "--output_dir", str(out))
    report = json.loads((out / "results.json").read_text())
    assert set(report["metrics"]) == {SCORE, GOLD, KL, PASS}
    assert abs(report["metrics"][KL]["base"]["mean"]) < 1e-4 and report["metrics"][KL]["trained"]["mean"] > 0.01
    assert set(report["win_rate"]) == {SCORE, GOLD}
    # the policy's run consumed ceil(20 / 8) * 8 = 24 queries of the same stream: they are skipped
    assert report["queries"] == {
        "dataset": query_file,
        "split": "train",
        "data_seed": 0,
        "skip": 24,
        "num": 12,
        "held_out": True,
    }
    assert report["gold"] == "vader" and report["base_model"] == tiny_model_dir and len(report["examples"]) == 8
    assert report["task_id"] == "sentiment" and report["warnings"] == []  # vader judges sentiment
    # the base model's point, the run's checkpoints in natural order (one line: their args.json names the run
    # kl_run), then the policy
    curve = report["curve"]
    assert [p["policy"] for p in curve] == [os.path.basename(tiny_model_dir), "update8", "update16", "final"]
    assert [p["run"] for p in curve] == ["base", "kl_run", "kl_run", "policy"]
    assert all(p[KL]["mean"] > 0.01 for p in curve[1:]) and abs(curve[0][KL]["mean"]) < 1e-4
    assert curve[-1][GOLD] == report["metrics"][GOLD]["trained"] and curve[0][SCORE] == report["metrics"][SCORE]["base"]
    assert (out / "gold_vs_kl.png").stat().st_size > 10_000
    text = (out / "results.md").read_text()
    assert "win rate (trained > base)" in text and "## Gold score vs KL" in text
    assert "reward-model score" in result.stdout and "gold score vs KL" in result.stdout


@pytest.mark.slow
def test_a_gold_judge_of_another_thing_than_the_policys_task_is_said_and_reported(tiny_run, tmp_path):
    # vader scored a descriptiveness policy without a word that VADER measures sentiment
    _, policy, _, _ = tiny_run
    descriptive = tmp_path / "policy"
    shutil.copytree(policy, descriptive)
    run = json.loads((descriptive / "args.json").read_text())
    (descriptive / "args.json").write_text(json.dumps({**run, "task_id": "descriptiveness"}))
    out = tmp_path / "eval"
    flags = ["--policy", str(descriptive), "--num_queries", "4", "--batch_size", "4", "--output_dir", str(out)]
    result = run_script("evaluate.py", *flags)  # --gold vader: the run's gold judge, from its args.json
    warning = (
        "--gold vader measures positive sentiment, but --task descriptiveness is about physical descriptiveness, so "
        "its scores do not judge this task; pass a --gold of physical descriptiveness, such as reward_model:DIR of a "
        "train_reward.py --task descriptiveness run."
    )
    assert result.stdout.splitlines().count(f"warning: {warning}") == 2  # at the start and under the results
    report = json.loads((out / "results.json").read_text())
    assert report["task_id"] == "descriptiveness" and report["gold"] == "vader" and report["warnings"] == [warning]
    assert f"**Warning:** {warning}" in (out / "results.md").read_text().splitlines()


def crowded_curve() -> list[dict]:
    """The demo's gold-vs-KL points (seed 1): eight checkpoints and the final policy within 0.5 sqrt(nats)."""
    values = [(4, 1.14, 0.43, 0.63), (8, 1.30, 0.54, 0.70), (12, 1.58, 0.65, 0.79), (16, 1.38, 0.54, 0.65)]
    values += [(20, 1.65, 0.60, 0.71), (24, 1.66, 0.53, 0.65), (28, 1.62, 0.54, 0.66), ("final", 1.41, 0.52, 0.62)]
    points = [("base", "base_model", 0.0, -0.06, -0.01)]
    points += [("policy", f"update{u}" if u != "final" else "final", k, s, g) for u, k, s, g in values]
    return [
        {"run": run, "policy": name, KL: {"mean": k * k, "stderr": 0.01}, SCORE: {"mean": s, "stderr": 0.05},
         GOLD: {"mean": g, "stderr": 0.03}}
        for run, name, k, s, g in points
    ]  # fmt: skip


def test_gold_vs_kl_plot_labels_every_point_apart_and_explains_the_error_bars(tmp_path):
    import matplotlib.pyplot as plt

    from lm_human_preference_details.evaluation import gold_vs_kl_figure, plot_gold_vs_kl

    fig = gold_vs_kl_figure(crowded_curve(), "title")
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        labels = [text.get_text() for text in ax.texts]
        assert labels == ["base", "4", "8", "12", "16", "20", "24", "28", "final"]  # no "policy", no "update"
        boxes = [text.get_window_extent(renderer) for text in ax.texts]
        overlapping = [(a, b) for i, a in enumerate(labels) for j, b in enumerate(labels) if i < j
                       and boxes[i].overlaps(boxes[j])]  # fmt: skip
        assert not overlapping
        assert "standard error" in ax.get_ylabel() and "sqrt(KL" in ax.get_xlabel()
        assert "updates" in ax.get_legend().get_title().get_text()
    plt.close(fig)
    plot_gold_vs_kl(crowded_curve(), str(tmp_path / "gold_vs_kl.png"), "title")
    assert (tmp_path / "gold_vs_kl.png").stat().st_size > 10_000 and not list(tmp_path.glob("*.tmp.png"))


def test_train_policy_save_checkpoints_keeps_every_periodic_save(tmp_path, tiny_run, tiny_model_dir):
    _, _, query_file, reward_dir = tiny_run
    args = PolicyArgs(base_model=tiny_model_dir)
    args = with_run(args, output_dir=str(tmp_path / "run"), save_interval=1, print_samples=1, save_checkpoints=True)
    args.task = dataclasses.replace(
        args.task,
        query_dataset=query_file,
        query_length=16,
        response_length=4,
        start_text=None,
        end_text=None,
        truncate_after=2,  # the preset's 16 would fail every 4-token response: refused as a meaningless run
    )
    args.rewards.trained_model = reward_dir
    args.rewards.allow_task_mismatch = True  # the fixture's random reward model records no task
    args.ppo = dataclasses.replace(args.ppo, total_episodes=24, batch_size=8, noptepochs=1, lr=1e-3)
    policy_main(args)
    # 3 updates saved after each: the first two kept as checkpoints, the last is the policy itself
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["update1", "update2"]
    weights = []
    for directory in (tmp_path / "run" / "checkpoints" / "update1", tmp_path / "run" / "checkpoints" / "update2"):
        policy = PolicyWithValueHead.load(str(directory))
        assert json.loads((directory / "args.json").read_text())["output_dir"] == str(tmp_path / "run")
        weights.append(policy.lm.transformer.h[0].attn.c_attn.weight)
    final = PolicyWithValueHead.load(str(tmp_path / "run")).lm.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], final)


# ---------------------------------------------------------------- programmatic rewards as the proxy score

SMALL_VOCAB_REWARD = """
def score(queries, responses):
    # the query's word count shows that the function sees the raw query of each episode
    return [r.count(" happy") - r.count(" sad") + len(q.split()) / 100 for q, r in zip(queries, responses)]
"""


def passes_the_filter(response: str, truncate_after: int) -> bool:
    """Whether a truncated response of small-vocabulary words (one token each) has ' the' at index >= truncate_after."""
    return "the" in response.split()[truncate_after:]


def expected_scores(report: dict, side: str, reward, gain: float, bias: float) -> tuple[list[float], list[bool]]:
    """Every example's score on one side as training computes it: gain * reward + bias, or the filter penalty; and
    whether each response passed the filter."""
    examples, task = report["examples"], report["task"]
    passed = [passes_the_filter(e[side]["response"], task["truncate_after"]) for e in examples]
    raw = reward([e["query"] for e in examples], [e[side]["response"] for e in examples])
    scores = [gain * r + bias if ok else task["penalty_reward_value"] for r, ok in zip(raw, passed)]
    return scores, passed


def save_small_vocab_run(path, model_dir: str, query_file: str, spec: str, normalization: dict | None, the: int) -> str:
    """A policy directory as train_policy.py writes it after training against `spec` (with `normalization`): the
    small-vocabulary model, whose responses are words, and a task that truncates after ' the'."""
    PolicyWithValueHead(load_causal_lm(model_dir)).save(str(path), load_tokenizer(model_dir))
    args = with_run(PolicyArgs(base_model=model_dir, data_seed=0), output_dir=str(path))
    args.task = dataclasses.replace(tiny_task(query_file), truncate_token=the)
    args.rewards.trained_model, args.rewards.normalization = spec, normalization
    args.ppo.total_episodes, args.ppo.batch_size = 8, 8
    tracking.save_args(args, str(path))
    return str(path)


def test_vader_run_is_scored_by_vader_with_its_normalization_and_the_filter_penalty(
    tmp_path, small_vocab_model_dir, small_vocab_words
):
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    query_file = str(write_query_file(tmp_path / "queries.txt", n=40))
    normalization = {"gain": 2.0, "bias": -0.5, "mean": 0.25, "std": 0.5, "samples": 64}
    policy = save_small_vocab_run(
        tmp_path / "policy", small_vocab_model_dir, query_file, "vader", normalization, small_vocab_words["the"]
    )
    out = tmp_path / "eval"
    main(parse(["--policy", policy, "--num_queries", "16", "--batch_size", "16", "--examples", "16"]
               + ["--output_dir", str(out)]))  # fmt: skip
    report = json.loads((out / "results.json").read_text())
    assert report["reward_model"] == "vader"  # from args.json: no --reward_model flag
    assert report["reward_normalization"] == {**normalization, "args_json": os.path.join(policy, "args.json")}
    analyzer = SentimentIntensityAnalyzer()

    def vader(queries, responses):
        return [analyzer.polarity_scores(r)["compound"] for r in responses]

    for side in ("base", "trained"):
        expected, passed = expected_scores(report, side, vader, gain=2.0, bias=-0.5)
        assert 0 < sum(passed) < len(passed)  # both the reward and the penalty occur
        assert any(abs(s) > 0.1 for s, ok in zip(expected, passed) if ok)  # VADER is not 0 on every response
        assert [e[side][SCORE] for e in report["examples"]] == pytest.approx(expected, abs=1e-5)
        assert report["metrics"][SCORE][side]["mean"] == pytest.approx(sum(expected) / 16, abs=1e-5)
    text = (out / "results.md").read_text()
    assert "| reward score (vader), normalized |" in text and "gain 2 * score + bias -0.5" in text


def test_normalization_comes_from_the_first_run_trained_against_the_evaluated_reward():
    normalized = {"gain": 2.0, "bias": -0.5}
    runs = {
        "raw": None,
        "a": {"rewards": {"trained_model": "models/reward", "normalization": None}},
        "b": {"rewards": {"trained_model": "vader", "normalization": normalized}},
        "c": {"rewards": {"trained_model": "vader", "normalization": {"gain": 3.0, "bias": 0.0}}},
    }
    assert run_normalization("vader", runs) == {**normalized, "args_json": os.path.join("b", "args.json")}
    assert run_normalization("models/reward", runs) is None  # a reward model: train_reward.py normalized it
    assert run_normalization("python:r.py:f", runs) is None  # another reward than the runs were trained against
    assert run_normalization("vader", {"old": {"rewards": {"trained_model": "vader"}}}) is None  # before the field


def test_bad_reward_model_is_one_line(tmp_path, monkeypatch, tiny_run):
    _, policy, _, _ = tiny_run
    bad = {
        "models/nothing": r"--reward_model 'models/nothing': the reward-model directory 'models/nothing' does not "
        r"exist in the working directory .*; run evaluate.py where the training ran .*python:FILE.py:FUNCTION",
        "python:reward.txt:score": r"--reward_model 'python:reward.txt:score' is not of the form python:FILE.py:FUNC",
        "python:reward.py": r"is not of the form python:FILE.py:FUNCTION",
    }
    for spec, problem in bad.items():
        with pytest.raises((ValueError, FileNotFoundError), match=problem) as info:
            main(parse(["--policy", policy, "--reward_model", spec, "--dry_run"]))
        assert "\n" not in str(info.value)
    # a run trained against a reward file named relative to its working directory, evaluated from elsewhere
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    run = json.loads(open(os.path.join(policy, "args.json")).read())
    run["rewards"]["trained_model"] = "python:rewards/mine.py:score"
    relative = tmp_path / "relative"
    relative.mkdir()
    (relative / "args.json").write_text(json.dumps(run))
    with pytest.raises(FileNotFoundError) as info:
        main(parse(["--policy", str(relative)]))
    assert str(info.value) == (
        f"--reward_model 'python:rewards/mine.py:score' (the --rewards.trained_model of {relative}/args.json): the "
        f"reward file 'rewards/mine.py' does not exist in the working directory {tmp_path / 'elsewhere'}; run "
        "evaluate.py where the training ran (relative paths are read from there) or pass --reward_model DIR | vader "
        "| classifier:NAME_OR_DIR[#LABEL] | python:FILE.py:FUNCTION with an existing path."
    )
    assert os.listdir(relative) == ["args.json"]  # nothing written


@pytest.mark.slow
def test_policy_trained_against_a_python_reward_is_evaluated_by_that_reward(
    tmp_path, small_vocab_model_dir, small_vocab_words
):
    # the user's way: in one working directory, train against python:FILE.py:FUNCTION (a path relative to it, as
    # args.json records it) with normalization, then evaluate with no --reward_model
    (tmp_path / "reward.py").write_text(SMALL_VOCAB_REWARD)
    write_query_file(tmp_path / "queries.txt", n=40)
    task = ["--task.query_dataset", "queries.txt", "--task.query_length", "16", "--task.response_length", "8"]
    task += ["--task.start_text", "None", "--task.end_text", "None", "--task.truncate_after", "2"]
    task += ["--task.truncate_token", str(small_vocab_words["the"])]
    run_script(
        "train_policy.py",
        *("--base_model", small_vocab_model_dir, "--rewards.trained_model", "python:reward.py:score", *task),
        *("--rewards.normalize_samples", "16", "--ppo.total_episodes", "8", "--ppo.batch_size", "8"),
        *("--output_dir", "policy"),
        cwd=tmp_path,
    )
    flags = ["--policy", "policy", "--num_queries", "16", "--batch_size", "16", "--examples", "16"]
    result = run_script("evaluate.py", *flags, "--output_dir", "eval", cwd=tmp_path)
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    saved = json.loads((tmp_path / "policy" / "args.json").read_text())["rewards"]["normalization"]
    assert report["reward_model"] == "python:reward.py:score" and saved["samples"] == 16
    assert report["reward_normalization"] == {**saved, "args_json": os.path.join("policy", "args.json")}
    namespace = {}
    exec(SMALL_VOCAB_REWARD, namespace)
    for side in ("base", "trained"):
        expected, passed = expected_scores(report, side, namespace["score"], saved["gain"], saved["bias"])
        assert 0 < sum(passed) < len(passed)  # both the reward and the penalty occur
        assert [e[side][SCORE] for e in report["examples"]] == pytest.approx(expected, abs=1e-4)
        assert report["metrics"][SCORE][side]["mean"] == pytest.approx(sum(expected) / 16, abs=1e-4)
    assert "reward score (python:reward.py:score), normalized" in result.stdout
    assert f"The reward is normalized as in training ({os.path.join('policy', 'args.json')}): gain" in result.stdout
