"""Mistakes that would silently run another experiment stop with one line naming the flag, or warn: a reward model of
the other books task, a reward model passed as the policy's --base_model."""

import os
import shutil

import pytest

from lm_human_preference_details.ppo_plumbing import check_reward_model_task_name
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task
from train_policy import RewardHParams, main


@pytest.fixture(scope="module")
def sentiment_reward_model(tmp_path_factory, tiny_model_dir, query_file):
    """A reward model as train_reward.py --task sentiment saves it (task name and label file recorded)."""
    # sentiment and descriptiveness share every task setting: only the recorded name tells them apart
    assert tiny_task(query_file, "sentiment") == tiny_task(query_file, "descriptiveness")
    return save_reward_model(
        tmp_path_factory.mktemp("sentiment-rm"),
        tiny_model_dir,
        tiny_task(query_file),
        task_name="sentiment",
        label_dataset="sentiment/offline_5k.json",
    )


def test_reward_model_of_the_other_books_task_stops_the_policy(
    tmp_path, sentiment_reward_model, tiny_model_dir, query_file
):
    args = tiny_args(tmp_path / "policy", tiny_model_dir, sentiment_reward_model, query_file, preset="descriptiveness")
    with pytest.raises(ValueError) as error:
        main(args)
    message = str(error.value)
    assert (
        "trained for --task sentiment on labels 'sentiment/offline_5k.json', this run is --task descriptiveness"
        in message
    )
    assert "--rewards.allow_task_mismatch" in message and "--rewards.trained_model" in message
    assert not os.path.exists(tmp_path / "policy" / "args.json")  # stopped before training


def test_task_name_check_allows_the_mismatch_on_request_and_warns_for_old_reward_models():
    rewards = RewardHParams(trained_model="rm")
    assert check_reward_model_task_name({"task_name": "sentiment"}, "sentiment", rewards) is None
    # a reward model saved before the name was recorded: a warning, not an error
    assert "records no task name" in check_reward_model_task_name({}, "descriptiveness", rewards)
    rewards.allow_task_mismatch = True
    warning = check_reward_model_task_name({"task_name": "sentiment"}, "descriptiveness", rewards)
    assert warning.startswith("--rewards.allow_task_mismatch: ") and "--task sentiment, this run is" in warning


def test_reward_model_as_base_model_stops_with_the_flags(tmp_path, sentiment_reward_model, query_file):
    args = tiny_args(tmp_path / "policy", sentiment_reward_model, sentiment_reward_model, query_file)
    with pytest.raises(ValueError) as error:
        main(args)
    assert "--base_model" in str(error.value) and "is a reward model" in str(error.value)
    assert "--rewards.trained_model" in str(error.value)
    # its classifier config alone (reward_model.json lost in a copy) tells it apart from a language model
    copy = tmp_path / "copy"
    shutil.copytree(sentiment_reward_model, copy, ignore=shutil.ignore_patterns("reward_model.json"))
    args.base_model = str(copy)
    with pytest.raises(ValueError, match="is a reward model"):
        main(args)
