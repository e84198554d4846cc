"""The experiments `--task NAME` selects, as OAI's launch.py binds them: for each training script, the flag values
that differ from its defaults (the defaults are each script's `Args`: OAI's sentiment experiment). The command line's
own flags then override any of them.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py
"""

import dataclasses
from typing import Any, TypeVar

from lm_human_preference_details.tasks import NPLUS_TASKS, TASKS

A = TypeVar("A")

TRL_TASK = dataclasses.replace(NPLUS_TASKS["nplus_tldr"], penalty_mode="subtract")
"""the successor recipe's TL;DR task with TRL's missing_eos_penalty: a response without EOS scores its reward - 1
(--task.penalty_reward_value -1, subtracted), not -1"""

POLICY: dict[str, dict[str, Any]] = {
    # books: launch.py's _books_task, sentiment and descriptiveness (they differ only in the reward model's labels)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L119-L151
    "sentiment": {"task": TASKS["sentiment"]},
    "descriptiveness": {"task": TASKS["descriptiveness"]},
    # tldr / cnndm: fixed kl_coef (their adaptive_kl lines are commented out), batch 32, lr 2e-6. OAI binds
    # `rewards.whiten=False`, a key that does not exist; the intent is ppo.whiten_rewards=False (spec H2), which the
    # 4-episode per-process minibatch also requires (P17).
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L153-L187
    **{
        name: {
            "task": TASKS[name],
            "rewards.kl_coef": kl_coef,
            "rewards.adaptive_kl.enabled": False,
            "ppo.batch_size": 32,
            "ppo.lr": 2e-6,
            "ppo.whiten_rewards": False,
        }
        for name, kl_coef in (("tldr", 0.03), ("cnndm", 0.01))
    },
    # the successor recipe's PPO run (docs/nplus.md#preset): the policy and the reference from the SFT model, a critic
    # from the reward model, responses that end at EOS, a fixed k1 KL penalty of 0.05, no reward whitening, torch AdamW
    # (eps 1e-5, weight decay 0.01) at lr 3e-6, 512 episodes per update in one minibatch, 4 epochs, 1e6 episodes
    # (nplus N8, N16, N21, N22, N25)
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/sbatches/ppo.sbatch#L40-L57
    "nplus_tldr": {
        "task": NPLUS_TASKS["nplus_tldr"],
        "base_model": "models/sft",
        "rewards.kl_coef": 0.05,
        "rewards.adaptive_kl.enabled": False,
        "rewards.kl_estimator": "k1",
        "ppo.batch_size": 512,
        "ppo.lr": 3e-6,
        "ppo.whiten_rewards": False,
        "ppo.value_model": "reward",
        "use_tensorflow_adam": False,
        "weight_decay": 0.01,
    },
}
"""train_policy.py's experiments"""

# TRL's PPOTrainer (v0.29.1) as its TL;DR example runs it (docs/migrating-from-trl.md#switch): the successor
# recipe's run with every setting in which TRL's code differs, so that one update equals TRL's on the same inputs.
# A response without EOS loses 1 from its score (missing_eos_penalty 1.0); the critic's head has no bias (TRL's
# value model reads `score`, a Linear without one); rewards and advantages whitened with the unbiased variance
# (masked_whiten) over each process's batch; each micro-batch's loss a mean over its own tokens, one optimizer
# step per epoch over TRL's 4 micro-batches of 16 per process (16 x 4 x 8 processes = 512); AdamW with
# transformers' defaults (eps 1e-8, no weight decay) at PPOConfig's lr 3e-6
# https://github.com/huggingface/trl/blob/617406a4e69551c115c145114497999618d24f3c/examples/scripts/ppo/ppo_tldr.py#L62-L79
# https://github.com/huggingface/trl/blob/617406a4e69551c115c145114497999618d24f3c/trl/experimental/ppo/ppo_trainer.py#L753-L842
POLICY["trl_tldr"] = {
    **POLICY["nplus_tldr"],
    "task": TRL_TASK,
    "ppo.whiten_variance": "unbiased",
    "ppo.whiten_group_size": 0,
    "ppo.gradient_accumulation_steps": 4,
    "ppo.loss_means": "micro_batch",
    "ppo.value_head_bias": False,
    "weight_decay": 0.0,
    "eps": 1e-8,
}

REWARD: dict[str, dict[str, Any]] = {
    # sentiment / descriptiveness: 5k offline labels of each (launch.py#L49-L80)
    **{
        name: {"task": TASKS[name], "label_dataset": f"{name}/offline_5k.json"}
        for name in ("sentiment", "descriptiveness")
    },
    # tldr / cnndm: 46k online labels, batch 16, lr 2.5e-5, rollouts 128
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L82-L111
    **{
        name: {
            "task": TASKS[name],
            "label_dataset": f"{name}/online_45k.json",
            "labels.num_train": 46_000,
            "batch_size": 16,
            "lr": 2.5e-5,
            "rollout_batch_size": 128,
        }
        for name in ("tldr", "cnndm")
    },
    # the successor recipe's reward model (docs/nplus.md#preset): from the SFT model, on TL;DR preference pairs (chosen
    # vs rejected, each response ending with EOS), 1450 batches of 64, torch AdamW (eps 1e-5, weight decay 0.01) at lr
    # 3e-6 (nplus N8, N11, N12)
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/reward.py#L78-L82
    "nplus_tldr": {
        "task": NPLUS_TASKS["nplus_tldr"],
        "base_model": "models/sft",
        "label_dataset": "trl-lib/tldr-preference",
        # SFD cuts the pairs to 92,832 and trains floor(92,832 / 64) = 1450 whole batches: the first 92,800 pairs
        "labels.type": "best_of_2",
        "labels.num_train": 92_800,
        "batch_size": 64,
        "lr": 3e-6,
        # DEVIATION (nplus-reward-normalization): N+ trains without a normalization and afterwards subtracts the mean
        # score of the SFT data's reference summaries (nplus N14); here the reward model is normalized after training
        # as OAI's is, to mean 0 and std 1 on the SFT policy's samples (cut at EOS)
        "normalize_before": False,
        "use_tensorflow_adam": False,
        "weight_decay": 0.01,
    },
}
"""train_reward.py's experiments"""
# the TRL preset's reward model: the successor recipe's, trained for the TRL task (reward_model.json records the task
# that the policy run checks; the penalty itself applies in PPO only)
REWARD["trl_tldr"] = {**REWARD["nplus_tldr"], "task": TRL_TASK}


def with_setting(settings: A, name: str, value: Any) -> A:
    """`settings` (nested dataclasses) with the field of dotted `name` (e.g. "ppo.lr") set to a copy of `value`."""
    head, _, rest = name.partition(".")
    if rest:
        value = with_setting(getattr(settings, head), rest, value)
    elif dataclasses.is_dataclass(value):
        value = dataclasses.replace(value)  # every preset gets its own task settings
    return dataclasses.replace(settings, **{head: value})


def build(args_type: type[A], experiments: dict[str, dict[str, Any]]) -> dict[str, A]:
    """One `args_type` per experiment: its defaults with the experiment's settings, `task_id` its name."""
    presets = {}
    for name, settings in experiments.items():
        args = args_type(task_id=name)
        for setting, value in settings.items():
            args = with_setting(args, setting, value)
        presets[name] = args
    return presets
