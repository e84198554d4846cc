"""PPO fine-tuning of GPT-2 against a learned reward model, as in openai/lm-human-preferences train_policy.py.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py

Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593), section 2.

All batch sizes are global (summed over processes) as in OAI; per-process sizes are derived and printed at start-up.
Run with the reward model that train_reward.py wrote to models/reward, on 8 GPUs or on 1:

    accelerate launch --num_processes 8 train_policy.py --task sentiment --rewards.trained_model models/reward
    python train_policy.py --task sentiment --ppo.gradient_accumulation_steps 8

On any number of processes the run whitens and reports statistics as OAI's 8 ranks did (--ppo.whiten_group_size).

`spec X` in the comments is docs/implementation-details.md#x, the section on OAI's detail X: spec P5 is
docs/implementation-details.md#p5 (a numbered one, spec §4.1, is that document's section 4.1).
"""

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
import torch
import tyro
from accelerate import Accelerator
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details import (
    cli,
    data,
    devices,
    distributed,
    kernels,
    labelers,
    lora,
    modeling,
    optim,
    ppo_plumbing,
    presets,
    resumable,
    rewards,
    settings,
    tasks,
    validation,
)
from lm_human_preference_details import sizes as sizing
from lm_human_preference_details.nplus import critic as nplus_critic
from lm_human_preference_details.nplus import end_at_eos
from lm_human_preference_details.tokenizer import load_tokenizer

# ---------------------------------------------------------------------------------------------------- hyperparameters
# Group and field names follow OAI's HParams, so `--ppo.lr` is OAI's `bind('ppo.lr', ...)`. Defaults are launch.py's
# sentiment experiment; `--task` picks another experiment (presets.py, OAI's launch.py). How the run writes, logs,
# saves and resumes is `run` (settings.py: --output_dir, --track, --resume, ...), as OAI's run group.
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L25-L58


@dataclass
class AdaptiveKLParams:
    enabled: bool = True
    """adapt kl_coef towards `target` (OAI: rewards.adaptive_kl='on'); disabled: kl_coef stays fixed (OAI tldr/cnndm)"""
    target: float = 6.0
    """target KL between rollout policy and reference policy, in nats per episode (OAI launch.py#L131)"""
    horizon: int = 10000
    """episodes over which a KL error is corrected; larger = slower adaptation (OAI train_policy.py#L28)"""


@dataclass
class RewardHParams:
    trained_model: str = "models/reward"
    """what the policy maximizes: the directory of a reward model written by train_reward.py (its --output_dir; also
    reward_model:DIR), or a programmatic reward: vader, classifier:NAME_OR_DIR[#LABEL], or python:FILE.py:FUNCTION
    (FUNCTION(queries, responses) of two lists of strings returns one float per episode); docs/rewards.md"""
    normalize_samples: int = 0
    """normalize a programmatic reward (not a reward model: train_reward.py normalized it) so that the scores of this
    many samples of the initial policy have mean 0 and std 1, as OAI normalizes its reward model; 0: raw scores"""
    normalization: tyro.conf.Suppress[dict[str, float] | None] = None
    """gain, bias and the measured mean, std and samples of --rewards.normalize_samples (set by the run, not a flag)"""
    kl_coef: float = 0.15
    """initial coefficient beta of the per-token KL penalty -beta*(logp - logp_ref) (OAI launch.py#L129)"""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """per-token KL estimate in the penalty and objective/kl: k1 = logp - logp_ref (OAI); k3 = (r - 1) - log r with
    r = p_ref / p, never negative per token (TRL's kl_estimator, nplus N21)"""
    adaptive_kl: AdaptiveKLParams = field(default_factory=AdaptiveKLParams)
    """adaptive KL controller, Ziegler et al. 2019 eq. (2)"""
    gold_model: str | None = None
    """a held-out judge that scores every rollout but never trains the policy, logged as objective/gold_score to show
    reward over-optimisation: reward_model:DIR, classifier:NAME_OR_DIR[#LABEL] or vader (label_generation's syntax)"""
    task_from_reward_model: bool = False
    """take every --task.* setting from the reward model (its reward_model.json), whatever the --task preset says;
    the differences from the preset are printed"""
    allow_task_mismatch: bool = False
    """use a reward model trained with other task settings than the policy's (by default a mismatch stops the run,
    as OAI asserts equal task hyperparameters, train_policy.py#L411); the differences are printed"""


@dataclass
class PpoHParams:
    total_episodes: int = 1_000_000
    """episodes (query, response pairs) in the run; nupdates = ceil(total_episodes / batch_size) (OAI launch.py#L123)"""
    batch_size: int = 512
    """episodes per update, summed over all processes (OAI launch.py#L124); the per-process share is derived"""
    nminibatches: int = 1
    """minibatches per PPO epoch, i.e. optimizer steps per epoch (OAI default 1)"""
    noptepochs: int = 4
    """PPO epochs over each batch of rollouts (CleanRL: update_epochs)"""
    lr: float = 1e-5
    """Adam learning rate, annealed linearly: lr * (1 - update / nupdates) (OAI launch.py#L122)"""
    vf_coef: float = 0.1
    """weight of the value loss in the total loss (CleanRL: vf_coef)"""
    cliprange: float = 0.2
    """PPO clip range of the probability ratio (CleanRL: clip_coef)"""
    cliprange_value: float = 0.2
    """clip range of the value prediction around the rollout value"""
    gamma: float = 1.0
    """discount factor over response tokens"""
    lam: float = 0.95
    """GAE lambda (CleanRL: gae_lambda)"""
    whiten_rewards: bool = True
    """whiten per-token rewards (population moments, mean kept) per minibatch before GAE (OAI train_policy.py#L324)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per process and minibatch (backward passes per optimizer step); the update does not depend on it"""
    whiten_group_size: int | None = None
    """episodes per virtual rank, a fixed share of the process's batch that permutes, cuts and whitens its own
    minibatches like one of OAI's ranks; None: batch_size / 8, OAI's 8 ranks on any number of processes (the whole
    process when the sizes do not allow it, with a warning); 0: the whole process, each process one rank"""
    value_model: str | None = None
    """the value function: None, OAI's zero-initialized value head on the policy's trunk; or a separate critic (a
    trunk and a head of its own, trained with the policy by the same optimizer, nplus N16) from: `reward`, the reward
    model of --rewards.trained_model (values start as its normalized score, the N+ recipe's choice); `policy`, a copy
    of --base_model's trunk with a zero head; or DIR, a reward model (train_reward.py) or a critic a run saved
    (OUTPUT_DIR/critic). The critic is saved to OUTPUT_DIR/critic (docs/nplus.md#critic)"""


@dataclass(slots=True)  # a misspelt field is an AttributeError, not a new attribute
class Args:
    seed: int = 1
    """run seed; process r seeds Python, NumPy, torch and the sampler with seed + 100003 * r (OAI
    utils/core.py#L108-L113)"""
    data_seed: int = 0
    """seed of the one global shuffle of the query texts, the same on every process (OAI shuffles with 0 whatever the
    run seed, datasets.py#L33)"""
    base_model: str = "gpt2"
    """pretrained causal LM, hub id or local directory (OAI: GPT-2 124M): the policy and the reference policy start
    from it"""
    use_tensorflow_adam: bool = True
    """TF1 Adam as OAI (epsilon added after bias correction); off: torch.optim.Adam with the same eps 1e-5"""
    weight_decay: float = 0.0
    """with --no_use_tensorflow_adam: torch.optim.AdamW's decoupled weight decay (the successor recipe uses AdamW's
    default 0.01, eps 1e-5); 0: no decay, as OAI (the TF1 Adam refuses any other value)"""
    task_id: tyro.conf.Suppress[str] = "sentiment"
    """name of the --task preset these settings started from (recorded in the run config)"""
    task: tasks.TaskHParams = field(default_factory=lambda: dataclasses.replace(tasks.TASKS["sentiment"]))
    """query data, lengths, truncation and sampling temperature (OAI lm_tasks.TaskHParams)"""
    rewards: RewardHParams = field(default_factory=RewardHParams)
    """reward model and KL penalty"""
    ppo: PpoHParams = field(default_factory=PpoHParams)
    """PPO optimisation"""
    lora: "lora.LoraHParams" = field(default_factory=lora.LoraHParams)  # the field shadows the module in this body
    """LoRA adapters instead of full fine-tuning (docs/lora.md)"""
    run: Annotated[settings.PolicyRunSettings, tyro.conf.arg(name="")] = field(
        default_factory=lambda: settings.PolicyRunSettings("train_policy", "models/policy", save_interval=50)
    )
    """where the run writes, how it logs, saves, resumes and speeds up (flags without a prefix: --output_dir, ...)"""


# ---------------------------------------------------------------------------------------------------- algorithm
# in the order one update runs them: the rollout (sampling, the reference policy's log-probs, the scores and the
# per-token rewards with their KL penalty, steps 2-4), whitening and GAE (per minibatch, as inside OAI's loss), the PPO
# losses, the update (its epochs' minibatches and optimizer steps, step 5), statistics (step 6), the KL controller
# (step 7). The sizes are derived in sizes.py, the plumbing (checks, tracking, checkpoints, saving) is in
# ppo_plumbing.py; responses that end at EOS (the successor recipe) are nplus/end_at_eos.py.
@dataclass
class Models:
    """The models a PPO update runs, by the role each plays."""

    policy: modeling.PolicyWithValueHead
    """samples the responses; its value head (on the policy's trunk) is OAI's value function"""
    critic: nplus_critic.Critic | None
    """a value function with a trunk of its own (--ppo.value_model, nplus N16); None: the policy's value head"""
    learner: torch.nn.Module
    """what PPO trains: the policy, or the policy and the critic (nplus N16)"""
    trained: torch.nn.Module
    """the learner as PPO's forwards run it: under DDP (gradients averaged over processes) or sharded by --fsdp"""
    reference: lora.ReferencePolicy
    """the frozen initial policy that the KL penalty measures against"""
    reward: rewards.Reward
    """what the policy maximizes: a reward model or a programmatic reward"""
    gold: labelers.Labeler | None
    """a held-out judge of every rollout that never trains the policy (--rewards.gold_model)"""


@dataclass
class Rollout:
    """One update's episodes as PPO trains on them: this process's batch, its rows grouped by virtual rank; and what
    the update's logs report of them."""

    query_responses: torch.Tensor
    """(B, C + L) context (prefix + query + suffix) followed by the raw response"""
    context_length: int
    """C, the context tokens before each response"""
    logprobs: torch.Tensor
    """(B, L) tempered log-probs of the response tokens under the rollout policy, as PPO's ratio uses them"""
    values: torch.Tensor
    """(B, L) value predictions at the positions that predict each response token"""
    rewards: torch.Tensor
    """(B, L) per-token rewards: -kl_coef * kl, + score at the last token (at s + 1 under --task.end_at_eos)"""
    masks: end_at_eos.ResponseMasks | None = None
    """where each response ends (--task.end_at_eos, nplus N20); None: OAI's episodes, every token trains"""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """the rollout's statistics under OAI's names (spec §4.1, step 6) and the counts of its non-finite entries"""
    samples: tuple[torch.Tensor, ...] = ()
    """for the sample table (spec P19): the queries, the truncated responses, their scores and KL sums"""


@torch.no_grad()
def rollout(
    models: Models,
    queries: torch.Tensor,
    affixes: tuple[torch.Tensor, torch.Tensor],
    generator: torch.Generator,
    kl_coef: float,
    args: Args,
    sizes: sizing.Sizes,
    tokenizer: PreTrainedTokenizerBase,
    timer: ppo_plumbing.PhaseTimer,
) -> Rollout:
    """Steps 2-4 of an update: responses to `queries` (B, Lq) sampled from the policy after the task's prefix and
    suffix (`affixes`), their scores, and the per-token rewards; the timer marks the end of the sampling."""
    task, pad_id = args.task, tokenizer.pad_token_id
    # 2. rollout: responses, with logprobs and values from the sampling pass itself (spec P13); rows grouped by
    # virtual rank, each holding the queries of the OAI rank it stands for (spec D3, D4)
    contexts = tasks.format_contexts(queries, *affixes)  # (B, C): prefix + query + suffix (spec G4)
    context_length = contexts.shape[1]
    # DEVIATION (rollout-micro-batch): with --rollout_micro_batch_size only; OAI decodes a rank's episodes together;
    # in chunks every episode keeps its random numbers and tokens, but log-probs and values move by float rounding (a
    # matmul's kernel depends on its row count)
    rows = args.run.rollout_micro_batch_size or sizes.batch  # episodes decoded and scored together
    # --fsdp: the policy's (and critic's) weights gathered once for the whole rollout, not at every token
    with distributed.gathered(models.trained):
        # QueryStream's queries start with a real token, so the sampler and the reward model skip that check and its
        # host sync: the update's only sync is the statistics copy in step 6
        responses, logprobs, values = modeling.sample(
            models.policy,
            contexts,
            task.response_length,
            task.temperature,
            pad_id,
            generator,
            check_first_token=False,
            compile=args.run.compile_sampler,
            max_rows=rows,
        )  # (B, L) each
        query_responses = torch.cat([contexts, responses], 1)  # (B, C + L)
        ppo_logprobs, ppo_values = logprobs, values
        if models.critic is not None and not args.run.bf16:  # the sampler's values are the policy head's (nplus N16)
            ppo_values = nplus_critic.rollout_values(models.critic, query_responses, context_length, pad_id, rows)
        if args.run.bf16:
            # DEVIATION (bf16-ratio): OAI's ratio and value clipping use the sampling pass's log-probs and values
            # (spec P13); under bf16 autocast of the PPO forward, float32 ones put the first minibatch's ratio ~1.5e-3
            # off 1 and clipping fires on rounding noise, so PPO gets those of the loss forward's arithmetic (one more
            # forward); the KL penalty keeps the float32 ones, like the reference's
            ppo_logprobs, ppo_values = modeling.training_logprobs_and_values(
                models.learner, query_responses, context_length, pad_id, task.temperature, sizes.micro
            )
    # the frozen reference policy's log-probs, --rollout_micro_batch_size rows per forward
    with models.reference() as ref_policy:
        ref_logprobs = reference_logprobs(ref_policy, query_responses, context_length, pad_id, task.temperature, rows)
    timer.mark()

    # 3. response processing: truncate -> score (raw query, no prefix/suffix, spec G4) -> filter penalty
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L378-L390
    postprocessed_responses = tasks.truncate_response(responses, task.truncate_token, task.truncate_after, pad_id)
    scores = models.reward(queries, postprocessed_responses)  # (B,)
    # responses without truncate_token at index >= truncate_after get a fixed score (spec P3)
    passed = tasks.passes_filter(postprocessed_responses, task.truncate_token, task.truncate_after)  # (B,)
    if task.penalty_mode == "subtract":  # TRL's missing_eos_penalty: added to the score (nplus N19)
        # https://github.com/huggingface/trl/blob/14ef1aba152fddbc5a58f3a8a712b6e509e7e69d/trl/trainer/ppo_trainer.py#L414-L418
        scores = torch.where(passed, scores, scores + task.penalty_reward_value)
    else:
        scores = torch.where(passed, scores, task.penalty_reward_value)
    gold_stats = {}
    if models.gold is not None:  # the gold judge sees what the reward model sees; it never trains the policy
        gold_scores = models.gold.scores(queries, postprocessed_responses[:, None])[:, 0].to(scores.device)
        gold_stats["objective/gold_score"] = gold_scores.mean()

    # the score lands on the last token, even when the response was truncated earlier (spec P4)
    masks, score_index = None, torch.full_like(passed, responses.shape[1] - 1, dtype=torch.long)  # (B,)
    if task.end_at_eos:  # nothing after a response's first EOS trains the policy (nplus N20)
        masks = end_at_eos.ResponseMasks.of(postprocessed_responses, task.truncate_token)
        logprobs, ref_logprobs = masks.invalidate(logprobs), masks.invalidate(ref_logprobs)
        ppo_logprobs, ppo_values = masks.invalidate(ppo_logprobs), masks.zero_values(ppo_values)
        score_index = masks.score_index()  # s + 1, or s when that is the last token (nplus N21)

    # 4. per-token rewards: -kl_coef * kl, + score at `score_index`
    rewards, non_score_reward, kl = compute_rewards(
        scores, logprobs, ref_logprobs, kl_coef, args.rewards.kl_estimator, score_index
    )  # (B, L)

    # statistics under OAI's names (step 6); with end_at_eos from the masked log-probs, as the successor recipe logs
    # them (nplus N26): kl 0 and -logprob -1 after EOS
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L199-L261
    stats = {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": (-logprobs).sum(1).mean(),
        "objective/score": scores.mean(),
        "objective/score_total": scores.mean() + non_score_reward.sum(1).mean(),
        **gold_stats,
        "debug/num_eos": (responses == tokenizer.eos_token_id).sum(1).float().mean(),
        "debug/filter_pass_rate": passed.float().mean(),
        "nonfinite/logprobs": validation.nonfinite_count([logprobs, ref_logprobs]),
        "nonfinite/values": validation.nonfinite_count([ppo_values]),
        "nonfinite/scores": validation.nonfinite_count([scores]),
        "nonfinite/rewards": validation.nonfinite_count([rewards]),
    }
    samples = (queries, postprocessed_responses, scores, kl.sum(1))
    return Rollout(query_responses, context_length, ppo_logprobs, ppo_values, rewards, masks, stats, samples)


def reference_logprobs(
    ref_policy: modeling.PolicyWithValueHead,
    query_responses: torch.Tensor,
    context_length: int,
    pad_id: int,
    temperature: float,
    rows: int,
) -> torch.Tensor:
    """Tempered log-probs (B, L) of the responses under the reference policy, `rows` episodes per forward; each
    forward's (rows, L, V) logits are freed right away."""
    responses = query_responses[:, context_length:]
    return torch.cat(
        [
            kernels.logprobs_from_logits(ref_policy(chunk, context_length, pad_id, temperature)[0], chunk_responses)
            for chunk, chunk_responses in zip(query_responses.split(rows), responses.split(rows))
        ]
    )


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """(B, L) per-token KL estimate of the sampled tokens: k1 = logprob - ref_logprob (OAI), or k3 = (r - 1) - log r
    with log r = ref_logprob - logprob, never negative (--rewards.kl_estimator, nplus N21)."""
    if estimator == "k3":
        # https://github.com/huggingface/trl/blob/55f5433e15cc6203d3c731f9de5247b00878bebd/trl/trainer/ppo_trainer.py#L594-L598
        log_ratio = ref_logprobs - logprobs
        return (torch.exp(log_ratio) - 1) - log_ratio
    return logprobs - ref_logprobs


def compute_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    kl_coef: float,
    kl_estimator: str,
    score_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards -kl_coef * kl per token, + each score at its response's `score_index` (OAI: the last token, spec P4;
    the step after EOS under --task.end_at_eos, nplus N21); returns rewards, non_score, kl."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L149-L155
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L680-L685
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)  # (B, L)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), score_index] += scores
    return rewards, non_score_reward, kl


def whiten(values: torch.Tensor, shift_mean: bool = True, group_size: int | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over all elements of each group of `group_size` rows (None: one group of all rows).

    The mean is added back when shift_mean is False. Groups stand for OAI's ranks when fewer processes run the same
    batch ("virtual ranks", spec D4): OAI whitens each rank's tensor on its own.
    """
    # TF-PARITY: tf.nn.moments gives the population variance (divide by N, not N - 1)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L336-L341
    groups = values.reshape(-1, group_size or values.shape[0], *values.shape[1:])  # (G, group_size, ...)
    dims = tuple(range(1, groups.dim()))
    var, mean = torch.var_mean(groups, dim=dims, correction=0, keepdim=True)
    whitened = (groups - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.reshape(values.shape)


def compute_advantages(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lam) backwards over the response (the episode ends after its last token); -> advantages, returns."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L327-L339
    lastgaelam = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    gen_length = rewards.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], 1)  # (B, L)
    return advantages, advantages + values


def minibatch_advantages(
    rewards: torch.Tensor, values: torch.Tensor, ppo: PpoHParams, whiten_group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Whitened) rewards, whitened GAE advantages and returns of one minibatch, each virtual rank's rows apart."""
    # reward whitening and GAE run per minibatch, inside OAI's loss (spec P5, P6), on each rank's own rows (D4)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L324-L339
    if ppo.whiten_rewards:
        rewards = whiten(rewards, shift_mean=False, group_size=whiten_group)
    advantages, returns = compute_advantages(rewards, values, ppo.gamma, ppo.lam)
    return rewards, whiten(advantages, group_size=whiten_group), returns


def ppo_losses(
    new_logprobs: torch.Tensor,
    vpred: torch.Tensor,
    logprobs: torch.Tensor,
    values: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
    policy_mean: Callable[[torch.Tensor], torch.Tensor] = torch.mean,
    value_mean: Callable[[torch.Tensor], torch.Tensor] = torch.mean,
) -> dict[str, torch.Tensor]:
    """Clipped PPO policy loss + vf_coef * clipped value loss, and stats under OAI names. The losses and clip
    fractions are means over every token (OAI), or `policy_mean` and `value_mean` (--task.end_at_eos: over each
    response's tokens, nplus N24)."""
    # value loss: the prediction may move at most cliprange_value from the rollout value (spec P8)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L343-L348
    vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpred - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * value_mean(torch.max(vf_losses1, vf_losses2))
    vf_clipfrac = value_mean((vf_losses2 > vf_losses1).float())
    # policy loss (spec P9); no entropy bonus, the KL only enters through the rewards (spec P10)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L350-L357
    logprob_diff = new_logprobs - logprobs
    ratio = torch.exp(logprob_diff)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = policy_mean(torch.max(pg_losses, pg_losses2))
    pg_clipfrac = policy_mean((pg_losses2 > pg_losses).float())
    # approxkl = 0.5 * mean(dlogp^2), not the k1/k3 estimators (spec P11)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L359-L371
    return {
        "loss/total": pg_loss + vf_coef * vf_loss,
        "loss/policy": pg_loss,
        "loss/value": vf_loss,
        "policy/approxkl": 0.5 * (logprob_diff**2).mean(),
        "policy/clipfrac": pg_clipfrac,
        "val/vpred": vpred.mean(),
        "val/error": vf_losses1.mean(),
        "val/clipfrac": vf_clipfrac,
        "ratio": ratio,
    }


def virtual_rank_rngs(seed: int, rank: int, world: int, virtual_ranks: int) -> list[np.random.RandomState]:
    """One NumPy RNG per virtual rank of this process, seeded like the OAI rank it stands for: virtual rank g of
    process `rank` is rank `rank + world * g` of world * virtual_ranks ranks, seeded seed + that rank * 100003."""
    # OAI seeds each rank's NumPy RNG with seed + rank * 100003 (spec D2)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    return [np.random.RandomState(seed + (rank + world * g) * 100003) for g in range(virtual_ranks)]


def minibatch_indices(
    rngs: list[np.random.RandomState], group_size: int, nminibatches: int, noptepochs: int
) -> np.ndarray:
    """(noptepochs, nminibatches, minibatch) rows of the local batch for every PPO step of one update (spec P12, D4).

    Virtual rank g owns rows [g * group_size, (g + 1) * group_size) for the whole update, as an OAI rank owns its
    batch; each epoch it permutes them with its own RNG and cuts the permutation into nminibatches chunks. Minibatch
    k is chunk k of every virtual rank, in virtual-rank order, so each virtual rank's rows are one contiguous block
    of group_size / nminibatches rows: what `whiten(group_size=group_size // nminibatches)` whitens.
    """
    # each OAI rank draws np.random.permutation(per-rank batch) per epoch and cuts it into contiguous minibatches
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L180-L196
    groups = len(rngs)
    orders = np.stack([[rng.permutation(group_size) for _ in range(noptepochs)] for rng in rngs], axis=1)  # (E, V, G)
    orders += group_size * np.arange(groups)[None, :, None]
    chunks = orders.reshape(noptepochs, groups, nminibatches, group_size // nminibatches)  # (E, V, M, G/M)
    return chunks.transpose(0, 2, 1, 3).reshape(noptepochs, nminibatches, -1)  # (E, M, V*G/M)


def ppo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    indices: torch.Tensor,
    sizes: sizing.Sizes,
    ppo: PpoHParams,
    temperature: float,
    pad_id: int,
) -> "PPOStats":
    """One optimizer step per minibatch of `indices` (noptepochs, nminibatches, minibatch), each over `accum`
    micro-batches with gradients averaged over processes; -> the update's PPO statistics.

    `policy`: the module the training forwards run through (`Models.trained`)."""
    params = list(policy.parameters())
    responses = rollout.query_responses[:, rollout.context_length :]  # (B, L)
    stats = PPOStats(rollout.values.device, ppo.noptepochs * ppo.nminibatches)
    accum = ppo.gradient_accumulation_steps
    for epoch, epoch_indices in enumerate(indices):
        for k, mb_inds in enumerate(epoch_indices):
            mb_values, mb_rewards = rollout.values[mb_inds], rollout.rewards[mb_inds]
            mb_masks = rollout.masks.rows(mb_inds) if rollout.masks is not None else None
            if mb_masks is None:  # OAI's episodes: every token trains
                _, mb_advantages, mb_returns = minibatch_advantages(mb_rewards, mb_values, ppo, sizes.whiten_group)
            else:  # responses that end at EOS: whitened over their tokens, 0 after (nplus N22, N23)
                _, mb_advantages, mb_returns = mb_masks.minibatch_advantages(
                    mb_rewards,
                    mb_values,
                    ppo.whiten_rewards,
                    ppo.gamma,
                    ppo.lam,
                    sizes.whiten_group,
                    compute_advantages,
                )
            stats.add_minibatch(mb_returns, mb_values, mb_advantages, sizes.virtual_ranks)
            for micro_start in range(0, sizes.minibatch, sizes.micro):
                micro = slice(micro_start, micro_start + sizes.micro)
                micro_inds = mb_inds[micro]
                # the gradients are averaged over processes in the minibatch's last backward (OAI's MPI all-reduce,
                # spec O4), overlapped with it; the micro-batches before it accumulate theirs locally
                last_micro = micro_start + sizes.micro == sizes.minibatch
                with distributed.averaging_gradients(policy, last_micro):
                    # forward on context + raw response: tempered logits and values at response positions (P7)
                    new_logits, vpred = policy(
                        rollout.query_responses[micro_inds], rollout.context_length, pad_id, temperature
                    )  # (b, L, V), (b, L)
                    # the entropy statistic comes from the same pass over the (b, L, V) logits
                    new_logprobs, new_entropy = kernels.logprobs_and_entropy_from_logits(
                        new_logits, responses[micro_inds]
                    )
                    del new_logits  # no reference left: the (b, L, V) logits go with the graph after backward
                    means = {}  # OAI: means over every token
                    if mb_masks is not None:  # masked as the rollout's, the means over each response's tokens (N24)
                        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L736-L738
                        micro_masks = mb_masks.rows(micro)
                        new_logprobs, vpred = micro_masks.invalidate(new_logprobs), micro_masks.zero_values(vpred)
                        loss_means = mb_masks.loss_means(micro, accum)
                        means = {"policy_mean": loss_means.policy_mean, "value_mean": loss_means.value_mean}
                    losses = ppo_losses(
                        new_logprobs,
                        vpred,
                        rollout.logprobs[micro_inds],
                        mb_values[micro],
                        mb_advantages[micro],
                        mb_returns[micro],
                        ppo.cliprange,
                        ppo.cliprange_value,
                        ppo.vf_coef,
                        **means,
                    )
                    # each micro loss is a mean over its rows; dividing by `accum` makes the summed gradient that of the
                    # minibatch mean, so accumulation does not change the update
                    (losses["loss/total"] / accum).backward()
                stats.add_micro(losses, new_entropy, 1 / accum, first=epoch == 0 and k == 0)
            # the gradients averaged over processes, then one Adam step
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L485-L489
            stats.nonfinite_gradients += validation.nonfinite_tensors(p.grad for p in params if p.grad is not None)
            optimizer.step()
            distributed.clear_gradients(optimizer, policy)
    return stats


class PPOStats:
    """Diagnostics of one update's PPO steps, summed on the device: means over minibatch steps (spec D5), extremes."""

    def __init__(self, device: torch.device, num_steps: int):
        self.weight = 1.0 / num_steps
        self.sums: dict[str, torch.Tensor] = {}
        self.ratio_min = torch.full((), float("inf"), device=device)
        self.ratio_max = torch.full((), -float("inf"), device=device)
        self.first_ratio_dev = torch.zeros((), device=device)
        self.nonfinite_advantages = torch.zeros((), device=device)
        self.nonfinite_loss = torch.zeros((), device=device)
        self.nonfinite_gradients = torch.zeros((), device=device)

    def _accumulate(self, stats: dict[str, torch.Tensor], weight: float) -> None:
        for key, value in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + value.detach() * weight

    def add_minibatch(
        self, returns: torch.Tensor, values: torch.Tensor, advantages: torch.Tensor, groups: int = 1
    ) -> None:
        """Moments of one minibatch's returns and rollout values, per virtual rank (`groups` equal blocks of rows)
        and then averaged, as OAI averages its ranks' moments; non-finite advantages counted."""
        # TF-PARITY: population variances (tf.nn.moments)
        var_returns, mean_returns = torch.var_mean(returns.reshape(groups, -1), dim=1, correction=0)
        var_values, mean_values = torch.var_mean(values.reshape(groups, -1), dim=1, correction=0)
        moments = {
            "returns/mean": mean_returns.mean(),
            "returns/var": var_returns.mean(),
            "val/mean": mean_values.mean(),
            "val/var": var_values.mean(),
        }
        self._accumulate(moments, self.weight)
        self.nonfinite_advantages += (~torch.isfinite(advantages)).sum()

    def add_micro(self, losses: dict[str, torch.Tensor], entropy: torch.Tensor, share: float, first: bool) -> None:
        """One micro-batch's losses and statistics, weighted by its share of the minibatch; ratio extremes."""
        ratio = losses.pop("ratio").detach()
        self.nonfinite_loss += validation.nonfinite_count([losses["loss/total"]])
        self._accumulate({**losses, "policy/entropy": entropy.mean(), "ratio_mean": ratio.mean()}, self.weight * share)
        self.ratio_min = torch.minimum(self.ratio_min, ratio.min())
        self.ratio_max = torch.maximum(self.ratio_max, ratio.max())
        if first:  # the first minibatch of the first epoch: the ratio should be ~1 (spec P13)
            self.first_ratio_dev = torch.maximum(self.first_ratio_dev, (ratio - 1).abs().max())

    def local(self) -> dict[str, torch.Tensor]:
        """This process's statistics under OAI's `ppo/` names, plus `debug/` extremes."""
        ratio_mean = self.sums.pop("ratio_mean")
        return {
            **{f"ppo/{key}": value for key, value in self.sums.items()},
            "debug/ratio_mean": ratio_mean,
            "debug/ratio_min": self.ratio_min,
            "debug/ratio_max": self.ratio_max,
            "debug/first_minibatch_ratio_max_abs_dev": self.first_ratio_dev,
            "nonfinite/advantages": self.nonfinite_advantages,
            "nonfinite/loss": self.nonfinite_loss,
            "nonfinite/gradients": self.nonfinite_gradients,
        }


def reduce_stats(local: dict[str, torch.Tensor], accelerator: Accelerator) -> dict[str, float]:
    """All statistics in one gather and one device-to-host copy: mean over processes (min/max for the extremes)."""
    # OAI all-reduce-means every statistic over ranks (spec D5)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L229-L237
    keys = list(local)
    gathered = accelerator.gather(torch.stack([local[k].float() for k in keys])[None]).cpu()  # (world, n_stats)
    reduced = {}
    for key, column in zip(keys, gathered.T):
        if key.endswith("_min"):
            reduced[key] = column.min().item()
        elif key.endswith(("_max", "_max_abs_dev")) or key.startswith(("nonfinite/", "stop/")):
            reduced[key] = column.max().item()
        else:
            reduced[key] = column.mean().item()
    return reduced


def add_elapsed_stats(stats: dict[str, float], update: int, args: Args, start_time: float, last_time: float) -> None:
    """OAI's `elapsed/*` counters, `var_explained` (from the reduced statistics) and the update's kl_coef."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L238-L261
    steps, now, batch, length = update + 1, time.time(), args.ppo.batch_size, args.task.response_length
    stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    stats["elapsed/updates"] = steps
    stats["elapsed/steps/serial"] = steps * length
    stats["elapsed/steps/total"] = steps * batch * length
    stats["elapsed/episodes"] = steps * batch
    stats["elapsed/fps"] = int(batch * length / (now - last_time))
    stats["elapsed/time"] = now - start_time


class FixedKLController:
    """kl_coef stays at its initial value (OAI's tldr and cnndm runs)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current: float, n_steps: int) -> None:
        """No-op."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards a target (Ziegler et al. 2019, eq. 2)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        """Scale kl_coef by 1 + clip(KL/target - 1, -0.2, 0.2) * n_steps/horizon; n_steps = episodes in the update."""
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L115-L124
        proportional_error = float(np.clip(current / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


def make_kl_controller(rewards: RewardHParams) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient's controller: adaptive towards --rewards.adaptive_kl.target, or fixed (OAI: fixed when
    rewards.adaptive_kl is None)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L136-L139
    kl_params = rewards.adaptive_kl
    if kl_params.enabled:
        return AdaptiveKLController(rewards.kl_coef, kl_params.target, kl_params.horizon)
    return FixedKLController(rewards.kl_coef)


# ---------------------------------------------------------------------------------------------------- main
# The plumbing calls name their module (cli., devices., distributed., ppo_plumbing., resumable., settings., sizing.,
# validation.): skip them to read the algorithm.
@resumable.one_run_per_output_dir
def main(args: Args) -> list[dict[str, float]]:
    """Train the policy; returns the logged statistics of every update."""
    # 0. sizes: global as in OAI, split over the processes (spec D1); printed, then checked by --dry_run; seeds
    args, task_changes = ppo_plumbing.task_from_reward_model(args)
    ppo_plumbing.check_args(args)
    nplus_critic.check_value_model_flag(args.ppo.value_model, args.rewards.trained_model, args.lora.rank)
    cli.quiet_transformers()
    accelerator = distributed.make_accelerator(args.run.dist_timeout)
    tf32 = devices.use_tf32(args.run.tf32)
    devices.use_deterministic(args.run.deterministic)
    device, ppo = accelerator.device, args.ppo
    sizes = sizing.derive_sizes(args, validation.dry_run_world(args.run, accelerator.num_processes))
    console = cli.make_console()
    if accelerator.is_main_process:
        ppo_plumbing.print_setup(console, args, sizes, tf32, task_changes, sizing.OAI_RANKS)
    if args.run.dry_run:
        return ppo_plumbing.dry_run(args, accelerator)
    ppo_plumbing.check_hub_for_push(args)
    # the truncation token's id in the base model's tokenizer, once: in args.json, the checkpoints and the task check
    tokenizer = load_tokenizer(args.base_model)
    args = dataclasses.replace(args, task=tasks.resolve_truncation(args.task, tokenizer))
    validation.check_policy_context(args, tokenizer)  # every model's context holds what it reads
    task, pad_id = args.task, tokenizer.pad_token_id
    # a killed run continues from its checkpoint (--resume); a fresh one never writes into another run's output_dir
    loop = resumable.CheckpointedLoop(
        args, sizes.world, ppo_plumbing.RESUME_IGNORED, accelerator, "update", sizes.nupdates
    )
    if loop.finished is not None:  # a finished run is a result: its summary shown, every file kept as it is
        return ppo_plumbing.report_finished(console, args, loop.finished, accelerator)

    # per-process seed (spec D2); the query order uses data_seed instead (spec D3)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    local_seed = args.seed + accelerator.process_index * 100003
    devices.set_seed(local_seed)
    generator = torch.Generator(device=device).manual_seed(local_seed)
    # the PPO epochs' permutations: one NumPy RNG per virtual rank, seeded like the OAI rank it stands for (spec D4)
    order_rngs = virtual_rank_rngs(args.seed, accelerator.process_index, sizes.world, sizes.virtual_ranks)

    # 1. tokenizer (loaded above), policy (+ value head on the shared trunk), frozen reference policy and reward model,
    # optimizer, data
    reward = rewards.load_reward(args.rewards.trained_model, tokenizer, pad_id, device)
    if reward.metadata is not None:  # a reward-model directory, not a programmatic reward
        ppo_plumbing.check_reward_model(reward.metadata, tokenizer, args, accelerator.print)  # tokenizer, task, name
    # dropout is off everywhere: p=0 in the configs and eval mode (spec G7)
    policy = modeling.PolicyWithValueHead(modeling.load_causal_lm(args.base_model)).to(device).eval()
    if args.lora.rank:  # DEVIATION (lora): OAI fine-tunes every weight; LoRA trains adapters and the value head only
        lora.apply_lora(policy, args.lora, args.base_model)
    # every process starts from rank 0's weights (spec D6); DDP and FSDP2 then skip a broadcast of their own
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L482-L485
    distributed.broadcast_parameters(policy, accelerator)
    # --ppo.value_model: a separate critic instead of the value head on the policy's trunk (nplus N16); None: none
    critic = nplus_critic.load_critic(
        args.ppo.value_model, args.rewards.trained_model, args.base_model, tokenizer, policy
    )
    if critic is not None:
        distributed.broadcast_parameters(critic, accelerator)
    # the frozen reference policy: a copy of the initial policy, or under LoRA the policy with its adapters disabled
    reference = lora.ReferencePolicy(policy)
    modeling.reduce_training_memory(policy, args.run.gradient_checkpointing, args.run.bf16)  # the PPO forward only
    # what PPO trains: the policy with its value head, or the policy and the critic, its value head frozen (nplus N16)
    learner = policy
    if critic is not None:
        modeling.reduce_training_memory(critic, args.run.gradient_checkpointing, args.run.bf16)
        learner = nplus_critic.PolicyWithCritic(policy, critic)
    gold = args.rewards.gold_model  # a held-out judge of every rollout that never trains the policy
    gold_labeler = labelers.load_labeler(gold, tokenizer, pad_id, device, flag="--rewards.gold_model") if gold else None
    ppo_plumbing.check_judge_tasks(args, reward, gold_labeler, accelerator.print)  # vader judging descriptiveness
    if args.run.fsdp:  # rank 0's host twins of the whole models for the saved directories, made before sharding
        ppo_plumbing.prepare_host_twins(loop.saves, accelerator, policy, *([critic] if critic is not None else []))
        ppo_plumbing.shard_frozen_models(accelerator, reference, reward)  # the frozen models sharded too
    # the module PPO's forwards run through: DDP averages its gradients over processes, or --fsdp shards it (spec O4)
    trained = distributed.data_parallel(learner, accelerator, args.run.fsdp)
    models = Models(policy, critic, learner, trained, reference, reward, gold_labeler)
    # read after sharding: --fsdp replaces the parameters with their shards (DTensors)
    critic_params = list(critic.parameters()) if critic is not None else []  # one optimizer for both (nplus N16)
    params = list(policy.parameters())
    optimizer = optim.make_optimizer(params + critic_params, ppo.lr, args.use_tensorflow_adam, args.weight_decay)
    params += critic_params  # the non-finite weights guard covers the critic too
    kl_ctl = make_kl_controller(args.rewards)
    texts = data.load_texts(task.query_dataset, task.query_split)
    query_stream = data.QueryStream(texts, tokenizer, task, accelerator.process_index, sizes.world, args.data_seed)
    rewards.attach_conversations(query_stream.conversation_of, reward, gold_labeler)  # chats for a reward's template
    affixes = tasks.encode_context_affixes(tokenizer, task)  # the task's prefix and suffix around each query
    # a programmatic reward's gain and bias (spec R4), in the run config, args.json and the training state
    args.rewards.normalization = rewards.normalize_from_initial_policy(
        reward,
        args.rewards.normalize_samples,
        loop.resumed,
        reference,
        query_stream,
        affixes,
        task,
        local_seed,
        accelerator,
    )

    # plumbing: what a checkpoint saves and --resume restores, the tracker, the logs and progress, the clock
    tracker, meta = ppo_plumbing.start_tracker(args, accelerator, loop, sizes.nupdates)
    report = ppo_plumbing.RunReport(
        args, accelerator, console, tracker, tokenizer, sizes.nupdates, loop.first_step, meta["run_name"]
    )
    state = ppo_plumbing.TrainingState(
        policy, optimizer, kl_ctl, query_stream, generator, order_rngs, critic, trained, args.run.fsdp, report
    )
    if loop.resumed is not None:
        state.restore(loop.resumed, accelerator, args.seed)
    last_time = time.time()
    start_time = last_time - (loop.resumed.shared["elapsed_time"] if loop.resumed else 0.0)

    def save(updates: int) -> None:
        """The training state and the policy after `updates` updates, written in the background (spec P20)."""
        ppo_plumbing.save_checkpoint(
            args, accelerator, updates, sizes.nupdates, state, tokenizer, tracker, meta, start_time, loop.saves
        )

    # Ctrl-C or SIGTERM during training: the update in progress finishes, a checkpoint is saved, the run stops
    with report, loop.saving(save, tracker.close):
        # OAI's step = number of completed updates, 0 at the first one
        for update in range(loop.first_step, sizes.nupdates):
            timer = ppo_plumbing.PhaseTimer(device)
            timer.mark()
            # for step 5: each virtual rank's fresh permutation for each PPO epoch (spec P12, D4); host-to-device
            # copies go through pinned memory, so none waits for the kernels queued before it
            indices = minibatch_indices(order_rngs, sizes.group, ppo.nminibatches, ppo.noptepochs)
            indices = devices.to_device(torch.from_numpy(indices), device)  # (noptepochs, nminibatches, minibatch)

            # 2-4. rollout: responses to the next queries, their scores and per-token rewards with the KL penalty
            queries = devices.to_device(query_stream.next_batch(sizes.batch, sizes.virtual_ranks), device)  # (B, Lq)
            kl_coef = kl_ctl.value
            episodes = rollout(models, queries, affixes, generator, kl_coef, args, sizes, tokenizer, timer)
            timer.mark()

            # 5. PPO: noptepochs x nminibatches optimizer steps, each over `accum` micro-batches;
            # lr annealed per update, constant within it (spec P16)
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L172-L173
            lr_now = ppo.lr * (1 - update / sizes.nupdates)
            for group in optimizer.param_groups:
                group["lr"] = lr_now
            ppo_stats = ppo_update(trained, optimizer, episodes, indices, sizes, ppo, task.temperature, pad_id)
            timer.mark()

            # 6. statistics of all processes, one device-to-host copy, with the run's guards: non-finite counts (the
            # first names the cause) and a stop signal
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L199-L261
            local_stats = {
                **episodes.stats,
                **ppo_stats.local(),
                "nonfinite/weights": validation.nonfinite_tensors(params),
                "stop/signal": loop.stop.flag(device),  # a signal to any process stops all after this update
            }
            stats = reduce_stats(local_stats, accelerator)
            stopping = stats.pop("stop/signal") > 0
            validation.check_finite_stats(stats, f"update {update}", "Lower --ppo.lr or check the reward model.")
            add_elapsed_stats(stats, update, args, start_time, last_time)
            last_time = time.time()
            stats.update({"objective/kl_coef": kl_coef, "debug/lr": lr_now, **timer.durations()})

            # 7. adaptive KL from the KL of all processes, after PPO training (spec P14; the PyTorch predecessor
            # vwxyzjn/lm-human-preference-details used the rank-local KL)
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L305
            kl_ctl.update(stats["objective/kl"], ppo.batch_size)

            # 8. logs, samples every log_interval updates, warnings, progress (P19); a checkpoint every save_interval
            # updates and at the end (P20), or now when a signal stops the run
            report.update(stats, update, episodes.samples)
            loop.step_done(update + 1, stopping)
        if loop.first_step == sizes.nupdates:  # a finished run resumed: write its policy again, a kill may have cut it
            save(loop.first_step)
    loop.finish()  # the last checkpoint and policy are on disk before the run ends; the tracker closes
    return report.finish(kl_ctl.value)  # summary.json, the closing table, --push_to_hub; a diverged run stops


def parse(argv: list[str] | None = None) -> Args:
    """Args from the command line, starting from the `--task` preset (default sentiment)."""
    return cli.parse_args(Args, task_presets(), "sentiment", __doc__, argv)[1]


def task_presets() -> dict[str, Args]:
    """One `Args` per `--task` name: OAI's launch.py experiments and the successor recipe's (presets.py)."""
    return presets.build(Args, presets.POLICY)


if __name__ == "__main__":
    cli.run(main, parse)
