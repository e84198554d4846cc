"""The pipeline as a user runs it: train_reward.py on planted labels, then train_policy.py against that reward model."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.planted import REPO, free_port, run_script, without_gpus, write_policy_planted_labels

QUERY_LENGTH, RESPONSE_LENGTH = 12, 8
BATCH, UPDATES, KL_TARGET = 32, 30, 2.0


def write_unique_corpus(path, n: int = 400):
    """One distinct passage per line, so that query streams can be compared by content."""
    path.write_text("\n".join(f"Passage {i} tells how the cat walked to the house in the morning." for i in range(n)))
    return path


@pytest.fixture(scope="module")
def trained_reward(tmp_path_factory, tokenizer, small_vocab_model_dir, small_vocab_words):
    """A reward model trained (by the real script) to prefer responses that contain ' happy'."""
    root = tmp_path_factory.mktemp("pipeline")
    corpus = write_unique_corpus(root / "queries.txt")
    labels = write_policy_planted_labels(
        root / "labels.json",
        small_vocab_model_dir,
        tokenizer,
        corpus,
        320,
        QUERY_LENGTH,
        RESPONSE_LENGTH,
        small_vocab_words["happy"],
        start_text=None,
        end_text=None,
    )
    run_script(
        "train_reward.py",
        "--base_model",
        small_vocab_model_dir,
        "--label_dataset",
        str(labels),
        "--task.query_dataset",
        str(corpus),
        "--task.query_length",
        str(QUERY_LENGTH),
        "--task.response_length",
        str(RESPONSE_LENGTH),
        "--task.start_text",
        "None",
        "--task.end_text",
        "None",
        "--task.truncate_token",
        "None",
        "--labels.num_train",
        "256",
        "--batch_size",
        "16",
        "--lr",
        "3e-3",
        "--rollout_batch_size",
        "128",
        "--normalize_samples",
        "512",
        "--output_dir",
        str(root / "rm"),
    )
    return {"root": root, "corpus": corpus, "rm": str(root / "rm")}


def policy_flags(model_dir: str, trained_reward: dict, output_dir, *extra: str) -> list[str]:
    return [
        "--base_model",
        model_dir,
        "--rewards.trained_model",
        trained_reward["rm"],
        "--task.query_dataset",
        str(trained_reward["corpus"]),
        "--task.query_length",
        str(QUERY_LENGTH),
        "--task.response_length",
        str(RESPONSE_LENGTH),
        "--task.start_text",
        "None",
        "--task.end_text",
        "None",
        "--task.truncate_token",
        "None",
        "--ppo.batch_size",
        str(BATCH),
        "--ppo.total_episodes",
        str(BATCH * UPDATES),
        "--ppo.lr",
        "1e-3",
        "--rewards.adaptive_kl.target",
        str(KL_TARGET),
        "--log_interval",
        "10",
        "--output_dir",
        str(output_dir),
        *extra,
    ]


def scalars(run_dir, tag: str) -> list[float]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [event.value for event in sorted(events.Scalars(tag), key=lambda e: e.step)]


@pytest.mark.slow
def test_policy_raises_the_learned_reward_with_the_kl_controller_in_charge(
    tmp_path, small_vocab_model_dir, trained_reward
):
    out = tmp_path / "policy"
    result = run_script(
        "train_policy.py",
        *policy_flags(
            small_vocab_model_dir, trained_reward, out, "--rewards.gold_model", f"reward_model:{trained_reward['rm']}"
        ),
    )
    assert "update 0" in result.stdout  # the sample table was printed
    assert "Loading weights" not in result.stdout + result.stderr  # transformers' per-load bars are silenced
    score, kl, kl_coef = (scalars(out, f"objective/{k}") for k in ("score", "kl", "kl_coef"))
    assert len(score) == UPDATES
    first, last = sum(score[:5]) / 5, sum(score[-5:]) / 5
    assert last - first > 0.5, (first, last)  # rewards are normalized to std 1: a rise of half a std
    assert all(map(torch.isfinite, map(torch.tensor, kl))) and max(kl) < 50
    # the coefficient follows kl_coef *= 1 + clip(kl/target - 1, -0.2, 0.2) * batch/horizon after every update
    for t in range(UPDATES - 1):
        error = min(max(kl[t] / KL_TARGET - 1, -0.2), 0.2)
        assert kl_coef[t + 1] == pytest.approx(kl_coef[t] * (1 + error * BATCH / 10000), rel=1e-6)
    assert (kl_coef[-1] > kl_coef[0]) == (sum(kl) / len(kl) > KL_TARGET)
    # the gold judge here is the reward model itself: gold equals the score wherever the filter is off
    assert scalars(out, "objective/gold_score") == pytest.approx(score, abs=1e-4)
    # the saved policy loads as a plain transformers model
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.n_layer == 2


@pytest.mark.slow
def test_two_processes_share_kl_coef_and_draw_disjoint_queries(tmp_path, small_vocab_model_dir, trained_reward):
    launcher = tmp_path / "launch.py"
    flags = policy_flags(
        small_vocab_model_dir,
        trained_reward,
        tmp_path / "policy",
        "--ppo.total_episodes",
        str(BATCH * 4),
        "--ppo.no_whiten_rewards",
    )
    launcher.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO)!r})
        import train_policy
        from lm_human_preference_details import data
        from lm_human_preference_details.cli import parse_args

        drawn, next_batch = [], data.QueryStream.next_batch
        def recording_next_batch(self, *args):
            queries = next_batch(self, *args)
            drawn.extend(queries.tolist())
            return queries
        data.QueryStream.next_batch = recording_next_batch
        args = parse_args(train_policy.Args, train_policy.task_presets(), "sentiment", "", {flags!r})[1]
        history = train_policy.main(args)
        from accelerate import PartialState
        rank = PartialState().process_index
        json.dump({{"kl_coef": [h["objective/kl_coef"] for h in history], "kl": [h["objective/kl"] for h in history],
                   "queries": drawn}}, open({str(tmp_path)!r} + f"/rank{{rank}}.json", "w"))
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
    assert len(ranks[0]["kl_coef"]) == 4
    assert ranks[0]["kl_coef"] == ranks[1]["kl_coef"] and ranks[0]["kl"] == ranks[1]["kl"]
    assert len(set(ranks[0]["kl_coef"])) > 1  # the adaptive controller did move, identically on both ranks
    queries = [set(map(tuple, r["queries"])) for r in ranks]
    assert len(queries[0]) == len(ranks[0]["queries"]) == 4 * BATCH // 2
    assert not queries[0] & queries[1]
