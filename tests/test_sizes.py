"""lm_human_preference_details/sizes.py: every per-process size computed once, and an error naming its flag."""

import dataclasses

import pytest

import train_policy
import train_reward
import train_sft
from lm_human_preference_details.sizes import (
    RewardSizes,
    SftSizes,
    ceil_div,
    derive_reward_sizes,
    derive_sft_sizes,
    derive_sizes,
    exact_div,
)


def policy_args(**ppo) -> train_policy.Args:
    args = train_policy.Args()
    args.ppo = dataclasses.replace(args.ppo, **ppo)
    return args


def reward_args(num_train: int = 64, **flags) -> train_reward.Args:
    return train_reward.Args(labels=train_reward.LabelHParams(num_train=num_train), **flags)


def test_policy_sizes_split_the_global_batch():
    args = policy_args(batch_size=64, nminibatches=2, gradient_accumulation_steps=4, whiten_rewards=False)
    sizes = derive_sizes(args, world=2)
    assert (sizes.world, sizes.batch, sizes.minibatch, sizes.micro) == (2, 32, 16, 4)
    # OAI's 8 ranks of 8 episodes: 4 virtual ranks per process, each whitening minibatches of 4
    assert (sizes.group, sizes.virtual_ranks, sizes.whiten_group, sizes.not_oai_ranks) == (8, 4, 4, None)
    assert derive_sizes(policy_args(total_episodes=1000, batch_size=64), world=1).nupdates == 16  # ceil(1000 / 64)


@pytest.mark.parametrize(
    "ppo, words",
    [
        (
            dict(batch_size=16, whiten_group_size=6),
            "--ppo.whiten_group_size 6 does not divide the episodes per process (16)",
        ),
        (dict(batch_size=64, nminibatches=4, whiten_group_size=24, whiten_rewards=False), "--ppo.whiten_group_size 24"),
        (
            dict(batch_size=64, nminibatches=3, whiten_group_size=16, whiten_rewards=False),
            "--ppo.nminibatches 3 does not divide the 64 episodes per process",
        ),
        (
            dict(batch_size=64, nminibatches=2, whiten_group_size=1, whiten_rewards=False),
            "--ppo.nminibatches 2 does not divide the episodes per virtual rank of --ppo.whiten_group_size 1 (1)",
        ),
    ],
)
def test_policy_size_that_does_not_divide_names_its_flag(ppo, words):
    with pytest.raises(ValueError) as error:
        derive_sizes(policy_args(**ppo), world=1)
    assert str(error.value).startswith(words)


def test_reward_sizes_split_labels_and_rollouts_over_processes():
    args = reward_args(num_train=64, batch_size=16, gradient_accumulation_steps=2, rollout_batch_size=8)
    assert derive_reward_sizes(args, world=4) == RewardSizes(world=4, batch=4, micro=2, steps=4, rollout_batch=2)


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(batch_size=6), "--batch_size 6 does not split over 4 processes; pass a multiple of 4."),
        (dict(gradient_accumulation_steps=3), "--gradient_accumulation_steps 3 does not divide the labels per process"),
        (dict(batch_size=24), "--batch_size 24 does not divide --labels.num_train (64)"),
        (dict(rollout_batch_size=10), "--rollout_batch_size 10 does not split over 4 processes; pass a multiple of 4."),
    ],
)
def test_reward_size_that_does_not_divide_names_its_flag(flags, words):
    args = reward_args(**{"batch_size": 16, "rollout_batch_size": 8, **flags})
    with pytest.raises(ValueError) as error:
        derive_reward_sizes(args, world=4)
    assert str(error.value).startswith(words)


def test_sft_sizes_split_the_batch_over_processes_and_the_pairs_into_whole_steps():
    args = train_sft.Args(batch_size=16, gradient_accumulation_steps=2)
    assert derive_sft_sizes(args, world=4, rows=70) == SftSizes(world=4, batch=4, micro=2, steps=4, left_over=6)


@pytest.mark.parametrize(
    "flags, words",
    [
        (dict(batch_size=6), "--batch_size 6 does not split over 4 processes; pass a multiple of 4."),
        (dict(gradient_accumulation_steps=3), "--gradient_accumulation_steps 3 does not divide the pairs per process"),
        (dict(batch_size=128), "--batch_size 128 is more than the 70 usable pairs of --dataset; pass at most 70"),
    ],
)
def test_sft_size_that_does_not_divide_names_its_flag(flags, words):
    args = train_sft.Args(**{"batch_size": 16, **flags})
    with pytest.raises(ValueError) as error:
        derive_sft_sizes(args, world=4, rows=70)
    assert str(error.value).startswith(words)


def test_exact_div_returns_quotient():
    assert exact_div(512, 8, "ppo.batch_size / world_size") == 64


def test_exact_div_error_names_both_numbers_and_what():
    with pytest.raises(ValueError) as excinfo:
        exact_div(510, 8, "ppo.batch_size / world_size")
    message = str(excinfo.value)
    assert "510" in message and "8" in message and "ppo.batch_size / world_size" in message


def test_exact_div_zero_divisor_raises_value_error():
    with pytest.raises(ValueError, match="labels.num_train"):
        exact_div(4, 0, "labels.num_train")


def test_ceil_div_rounds_up():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
