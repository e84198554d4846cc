"""Programmatic rewards (--rewards.trained_model vader | classifier:... | python:FILE.py:FUNCTION): what a function
sees, OAI's semantics around it (truncation, filter penalty), normalization, bad functions, and that PPO raises them."""

import dataclasses
import json
import os
import re
import shutil
import textwrap

import pytest
import torch

from lm_human_preference_details import checkpoint, resumable
from lm_human_preference_details.rewards import (
    PythonReward,
    RewardModelReward,
    check_reward_source,
    load_reward,
    reward_input_path,
)
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import QUERY_TEXTS
from tests.planted import REPO
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task
from train_policy import main

PAD = 50257
WORD_REWARD = f"python:{REPO / 'demo' / 'word_reward.py'}:word_count"

pytestmark = pytest.mark.usefixtures("single_thread")


def reward_file(tmp_path, body: str, name: str = "reward.py") -> str:
    """A Python reward file holding `body`; returns its path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def no_filter_args(output_dir, model_dir: str, query_file: str, spec: str, **ppo):
    """tiny_args without truncation (the small-vocabulary model never samples '.'): every score is the reward's."""
    args = tiny_args(output_dir, model_dir, spec, query_file, **ppo)
    args.task = dataclasses.replace(args.task, truncate_token=None, truncate_text=None, truncate_after=0)
    return args


# ---------------------------------------------------------------- PPO raises a programmatic reward


@pytest.mark.parametrize(
    ("spec", "updates", "normalize_samples", "margin"),
    [(WORD_REWARD, 4, 64, 1.5), ("vader", 5, 0, 0.4)],
    ids=["python-word-count-normalized", "vader"],
)
def test_ppo_raises_a_programmatic_reward(
    spec, updates, normalize_samples, margin, tmp_path, small_vocab_model_dir, query_file
):
    # the small-vocabulary model samples 14 words nearly uniformly, ' happy' among them (1 in 14); PPO at a high lr
    # with a light fixed KL penalty learns to say it more. The score of each update is that of its rollouts, before
    # its optimisation: update 0 scores the initial policy.
    args = no_filter_args(tmp_path, small_vocab_model_dir, query_file, spec, batch_size=16, lr=1e-2)
    args.ppo.total_episodes = 16 * updates
    args.rewards.kl_coef, args.rewards.adaptive_kl.enabled = 0.05, False
    args.rewards.normalize_samples = normalize_samples
    args.run.log_interval = 100
    history = main(args)
    scores = [stats["objective/score"] for stats in history]
    # 16 episodes per update: the initial std of one update's mean is ~0.12 (VADER) and ~0.25 (normalized count), so
    # the margins are > 3 standard errors of the difference between the first update and the last two
    assert sum(scores[-2:]) / 2 - scores[0] > margin, scores
    saved = json.loads((tmp_path / "args.json").read_text())["rewards"]
    assert saved["trained_model"] == spec
    if normalize_samples:
        normalization = saved["normalization"]
        assert normalization["samples"] == normalize_samples
        # ' happy' in 8 words sampled from 14: mean 8/14, std sqrt(8 * 1/14 * 13/14) (binomial), within noise
        assert abs(normalization["mean"] - 8 / 14) < 0.25 and 0.5 < normalization["std"] < 1.0, normalization
        assert normalization["gain"] == pytest.approx(1 / normalization["std"])
        assert normalization["bias"] == pytest.approx(-normalization["mean"] / normalization["std"])
        assert abs(scores[0]) < 0.75  # the initial policy's normalized score: mean 0, std 1 / sqrt(16)
    else:
        assert saved["normalization"] is None


# ---------------------------------------------------------------- what the function sees; OAI's semantics around it


def test_python_reward_sees_raw_queries_and_truncated_responses_and_failing_ones_get_the_penalty(
    tmp_path, small_vocab_model_dir, small_vocab_words, query_file
):
    record = tmp_path / "seen.json"
    path = reward_file(
        tmp_path,
        f"""
        import json

        def length(queries, responses):
            with open({str(record)!r}, "w") as f:
                json.dump({{"queries": queries, "responses": responses}}, f)
            return [float(len(response.split())) for response in responses]
        """,
    )
    spec = f"python:{path}:length"
    args = tiny_args(tmp_path / "policy", small_vocab_model_dir, spec, query_file, total_episodes=16, batch_size=16)
    # truncate after the first ' the' at index >= 2; the policy sees a prefix that the reward never does (spec G4)
    args.task = dataclasses.replace(
        args.task, truncate_token=small_vocab_words["the"], truncate_text=None, truncate_after=2, query_prefix="PREFIX:"
    )
    (stats,) = main(args)
    seen = json.loads(record.read_text())
    assert len(seen["queries"]) == len(seen["responses"]) == 16
    assert all("PREFIX" not in query and query.strip() and query in " ".join(QUERY_TEXTS) for query in seen["queries"])
    words = [response.split() for response in seen["responses"]]
    qualifying = [next((i for i, w in enumerate(ws) if w == "the" and i >= 2), None) for ws in words]
    for ws, i in zip(words, qualifying):
        assert len(ws) == (i + 1 if i is not None else 8), ws  # nothing after the truncation token
    assert any(i is not None and i < 7 for i in qualifying) and None in qualifying  # both cases occurred
    # the function's score where the response passes the filter, OAI's penalty -1 where it does not (spec P3)
    expected = [float(len(ws)) if i is not None else -1.0 for ws, i in zip(words, qualifying)]
    assert stats["objective/score"] == pytest.approx(sum(expected) / 16)
    assert stats["debug/filter_pass_rate"] == pytest.approx(sum(i is not None for i in qualifying) / 16)


def test_vader_scores_the_decoded_response_and_a_directory_is_a_reward_model(tmp_path, tiny_model_dir, query_file):
    tokenizer = load_tokenizer(tiny_model_dir)
    vader = load_reward("vader", tokenizer, PAD, torch.device("cpu"))
    assert vader.metadata is None and vader.name == "vader"  # no reward-model checks (tokenizer, task) apply
    # VADER on decoded text: a happy response outscores a sad one; PADs are dropped before decoding
    queries = torch.tensor([tokenizer.encode(" She said")] * 2)
    happy, sad = tokenizer.encode(" happy happy"), tokenizer.encode(" sad sad")
    scores = vader(queries, torch.tensor([happy + [PAD], sad + [PAD]]))
    assert scores.shape == (2,) and scores[0] > 0.5 > -0.5 > scores[1]
    # DIR and reward_model:DIR name a reward model, whose metadata train_policy.py checks
    rm_dir = save_reward_model(tmp_path / "rm", tiny_model_dir, tiny_task(query_file))
    for spec in (rm_dir, f"reward_model:{rm_dir}"):
        reward = load_reward(spec, tokenizer, PAD, torch.device("cpu"))
        assert isinstance(reward, RewardModelReward) and reward.metadata["task"]["response_length"] == 8


def test_reward_flag_forms_and_the_inputs_they_read(tmp_path):
    assert reward_input_path("models/reward") == "models/reward"
    assert reward_input_path("reward_model:models/reward") == "models/reward"
    assert reward_input_path("classifier:models/sst2#POSITIVE") == "models/sst2"
    assert reward_input_path("python:rewards/mine.py:score") == "rewards/mine.py"
    assert reward_input_path("vader") is None
    with pytest.raises(FileNotFoundError, match="'models/nothing' .*vader.*classifier:.*python:FILE.py:FUNCTION"):
        load_reward("models/nothing", None, PAD, torch.device("cpu"))
    # normalization is for programmatic rewards only: train_reward.py normalized the reward model
    check_reward_source("vader", 256)
    check_reward_source(f"python:{tmp_path}/r.py:f", 0)
    with pytest.raises(ValueError, match="--rewards.normalize_samples .* already normalized"):
        check_reward_source("models/reward", 256)
    with pytest.raises(ValueError, match="--rewards.normalize_samples must be an integer >= 0"):
        check_reward_source("vader", -1)


# ---------------------------------------------------------------- bad reward functions: one line naming the function


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("raise KeyError('missing column')", r"raised KeyError: 'missing column'"),
        ("return [1.0] * (len(responses) - 1)", r"returned 2 scores of shape \(2,\) for 3 episodes"),
        ("return [[1.0]] * len(responses)", r"returned 3 scores of shape \(3, 1\) for 3 episodes"),
        (
            "return [1.0, float('nan'), 2.0]",
            r"returned the non-finite score nan for episode 1 \(response ' sad'\); it must",
        ),
        ("return [float('inf')] * 3", r"returned the non-finite score inf for episode 0 .* and 2 more"),
        ("return ['good', 'bad', 'ugly']", r"returned list \['good', 'bad', 'ugly'\], not numbers"),
        ("return None", r"returned NoneType None, not numbers"),
    ],
    ids=["raises", "too-few", "nested", "nan", "inf", "strings", "none"],
)
def test_bad_reward_function_is_one_line_naming_the_function_and_the_problem(tmp_path, tokenizer, body, problem):
    path = reward_file(tmp_path, f"def score(queries, responses):\n    {body}\n")
    spec = f"python:{path}:score"
    reward = load_reward(spec, tokenizer, PAD, torch.device("cpu"))
    queries = torch.tensor([tokenizer.encode(" Hello")] * 3)
    responses = torch.tensor([tokenizer.encode(" happy") + [PAD], tokenizer.encode(" sad") + [PAD], [PAD, PAD]])
    with pytest.raises(ValueError) as info:
        reward(queries, responses)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"reward function {spec} (--rewards.trained_model) ")
    assert re.search(problem, message), message


def test_good_reward_function_may_return_any_sequence_of_numbers(tmp_path, tokenizer):
    path = reward_file(tmp_path, "import numpy as np\ndef score(queries, responses):\n    return np.arange(2) + 0.5\n")
    reward = load_reward(f"python:{path}:score", tokenizer, PAD, torch.device("cpu"))
    assert isinstance(reward, PythonReward)
    scores = reward(torch.tensor([[11], [12]]), torch.tensor([[13, PAD], [PAD, PAD]]))
    assert scores.dtype == torch.float32 and scores.tolist() == [0.5, 1.5]
    reward.gain, reward.bias = 2.0, -1.0
    assert reward(torch.tensor([[11], [12]]), torch.tensor([[13, PAD], [PAD, PAD]])).tolist() == [0.0, 2.0]


@pytest.mark.parametrize(
    ("spec", "error", "problem"),
    [
        ("python:{dir}/absent.py:score", FileNotFoundError, r"reward file '.*absent.py' .* does not exist"),
        ("python:{dir}/reward.py:absent", ValueError, r"has no function 'absent' .*; its functions: helper, score"),
        ("python:{dir}/broken.py:score", ValueError, r"failed to import: SyntaxError"),
        ("python:{dir}/reward.py", ValueError, r"is not of the form python:FILE.py:FUNCTION"),
    ],
    ids=["missing-file", "missing-function", "syntax-error", "no-function-named"],
)
def test_missing_reward_file_or_function_is_one_line(tmp_path, tokenizer, spec, error, problem):
    reward_file(
        tmp_path, "def helper():\n    pass\n\ndef score(queries, responses):\n    return [0.0] * len(queries)\n"
    )
    reward_file(tmp_path, "def score(queries, responses)\n    return []\n", name="broken.py")
    with pytest.raises(error, match=problem) as info:
        load_reward(spec.format(dir=tmp_path), tokenizer, PAD, torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_bad_reward_function_stops_the_run_before_anything_is_saved(tmp_path, small_vocab_model_dir, query_file):
    path = reward_file(tmp_path, "def score(queries, responses):\n    return [float('nan')] * len(responses)\n")
    args = no_filter_args(tmp_path / "policy", small_vocab_model_dir, query_file, f"python:{path}:score")
    args.run.save_interval = 1
    with pytest.raises(ValueError, match=r"reward function python:.*reward.py:score .* non-finite score nan"):
        main(args)
    assert not os.path.exists(tmp_path / "policy" / "model.safetensors")
    assert not os.path.exists(tmp_path / "policy" / checkpoint.STATE_DIR)


# ---------------------------------------------------------------- normalization: saved and restored on --resume


def test_normalization_gain_and_bias_are_saved_and_restored_on_resume(tmp_path, small_vocab_model_dir, query_file):
    args = no_filter_args(tmp_path / "policy", small_vocab_model_dir, query_file, WORD_REWARD, total_episodes=16)
    args.rewards.normalize_samples, args.run.save_interval, args.run.keep_checkpoints = 16, 1, 0
    main(args)
    saved = json.loads((tmp_path / "policy" / "args.json").read_text())["rewards"]["normalization"]
    step1 = checkpoint.step_dir(str(tmp_path / "policy"), 1)
    meta_path = os.path.join(step1, checkpoint.META_FILE)
    meta = json.loads(open(meta_path).read())
    assert meta["reward_normalization"] == saved and saved["samples"] == 16 and saved["std"] > 0
    # a resumed run applies the checkpoint's gain and bias, not freshly measured ones: with gain 0 and bias 5 every
    # score of the resumed update is 5 (the run as a kill after checkpoint 1 left it)
    shutil.rmtree(checkpoint.step_dir(str(tmp_path / "policy"), 2))
    (tmp_path / "policy" / resumable.SUMMARY_FILE).unlink()
    meta["reward_normalization"] = {**saved, "gain": 0.0, "bias": 5.0}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    resumed = no_filter_args(tmp_path / "policy", small_vocab_model_dir, query_file, WORD_REWARD, total_episodes=16)
    resumed.rewards.normalize_samples, resumed.run.resume = 16, step1
    (stats,) = main(resumed)
    assert stats["objective/score"] == 5.0
    assert json.loads((tmp_path / "policy" / "args.json").read_text())["rewards"]["normalization"]["bias"] == 5.0


# ---------------------------------------------------------------- normalization against its formula


def test_normalization_is_population_moments_of_truncated_samples_and_the_reward_is_gain_times_score_plus_bias(
    tmp_path, tokenizer, small_vocab_model_dir, small_vocab_words, query_file
):
    # spec RS1, R4: normalize_reward scores what training scores (raw query, truncated response) and sets gain 1/std,
    # bias -mean/std (population std); the reward training adds is gain * score + bias: mean 0, std 1 on those samples
    import numpy as np

    from lm_human_preference_details import distributed
    from lm_human_preference_details.data import QueryStream, load_texts
    from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm
    from lm_human_preference_details.rewards import normalize_reward
    from lm_human_preference_details.tasks import encode_context_affixes
    from tests.fidelity import np_truncate

    path = reward_file(tmp_path, "def length(queries, responses):\n    return [float(len(r)) for r in responses]\n")
    reward = load_reward(f"python:{path}:length", tokenizer, PAD, torch.device("cpu"))
    the = small_vocab_words["the"]  # sampled in about 1 of 14 positions: some responses truncate, some do not
    task = dataclasses.replace(tiny_task(query_file), truncate_token=the, truncate_after=2)
    seen, raw = [], reward.raw
    reward.raw = lambda queries, responses: seen.append((queries, responses)) or raw(queries, responses)
    policy = PolicyWithValueHead(load_causal_lm(small_vocab_model_dir)).eval()
    stream = QueryStream(load_texts(query_file), tokenizer, task, 0, 1)
    affixes = encode_context_affixes(tokenizer, task)
    result = normalize_reward(reward, policy, stream, affixes, task, 24, 1, distributed.make_accelerator())
    del reward.raw  # the class's own again
    responses = torch.cat([r for _, r in seen]).numpy()
    assert responses.shape == (24, task.response_length)
    np.testing.assert_array_equal(responses, np_truncate(responses, the, 2, PAD))  # truncated ...
    assert 0 < (responses == PAD).any(1).sum() < 24  # ... where 'the' came at index >= 2 (the model never samples PAD)
    scores = torch.cat([raw(q, r) for q, r in seen]).double().numpy()
    mean, std = scores.mean(), scores.std()  # numpy std: population
    assert result["samples"] == 24 and (result["mean"], result["std"]) == pytest.approx((mean, std), rel=1e-5)
    assert (result["gain"], result["bias"]) == pytest.approx((1 / std, -mean / std), rel=1e-5)
    reward.gain, reward.bias = result["gain"], result["bias"]
    normalized = torch.cat([reward(q, r) for q, r in seen]).double().numpy()
    np.testing.assert_allclose(normalized, scores / std - mean / std, rtol=1e-5, atol=1e-5)
    assert (normalized.mean(), normalized.std()) == pytest.approx((0.0, 1.0), abs=1e-5)
