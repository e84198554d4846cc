#!/usr/bin/env python3
"""Mutation check: every OAI detail of docs/implementation-details.md is guarded by tests that fail when it breaks.

Each breakage in BREAKAGES changes one snippet of the current source (it must occur there exactly once), in a copy of
the project, and runs only the tests that guard that detail. The check passes when every breakage makes its tests fail
("caught"); a breakage whose tests still pass ("SURVIVED"), a snippet that no longer occurs ("stale": update the
breakage to the current code) or a test that does not exist fails it. `make mutation` runs it; CI runs that.

    python3 tools/mutation_check.py                      # every breakage, one at a time per CPU core
    python3 tools/mutation_check.py --only P15-floor-nupdates G4-reward-sees-context --jobs 1
    python3 tools/mutation_check.py --list               # the breakages, without running them

Each run imports torch and transformers once, then forks one child per breakage (POSIX), so a breakage costs only its
tests; `--subprocess` starts a fresh `python -m pytest` per breakage instead. Each child makes its own copy of the
project, runs pytest there on one intra-op thread per core it has (--jobs children share the cores) with its
temporary directories inside that copy, and the copy is removed when the breakage's tests end; the breakages whose
tests start processes (marked `slow`) run first, so the last ones to finish are short. Ctrl-C or SIGTERM stops the
children and removes every copy.
"""

import argparse
import ast
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTEST_FLAGS = [
    "-x",
    "-q",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:unraisableexception",
    "-W",
    "ignore::pytest.PytestAssertRewriteWarning",
]
"""stop at the first failure; skip pytest's end-of-session garbage collection (seconds per run with torch loaded)"""
BASETEMP = ".pytest-tmp"
"""pytest's --basetemp inside a breakage's copy, removed with it"""
PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "accelerate",
    "datasets",
    "tyro",
    "rich",
    "safetensors.torch",
    "torch.utils.tensorboard",
    "wandb",
    "pytest",
)
"""third-party modules imported once before forking (the project's own modules are imported in each copy)"""
ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "PYTHONDONTWRITEBYTECODE": "1",
}


@dataclass
class Breakage:
    id: str
    """unique name (the detail tag, then a few words)"""
    detail: str
    """the tag of the detail it breaks (an anchor of docs/implementation-details.md)"""
    what: str
    """the breakage in words"""
    file: str
    """the file it changes, relative to the repository root"""
    original: str
    """a snippet that occurs exactly once in that file"""
    replacement: str
    """what the snippet becomes"""
    tests: list[str]
    """pytest node ids that must fail"""


POLICY_RUN = "tests/test_fidelity_policy.py::"
REWARD_RUN = "tests/test_fidelity_reward.py::"
UNITS = "tests/test_fidelity_units.py::"
ROLLOUT = POLICY_RUN + "test_run_policy_sees_prefix_query_suffix_and_reward_model_the_raw_query"
REFERENCE = POLICY_RUN + "test_run_reference_logprobs_are_the_initial_policy_at_the_task_temperature"
WHITENING = POLICY_RUN + "test_run_whitens_rewards_and_advantages_per_minibatch"
RATIO = POLICY_RUN + "test_run_ppo_ratio_is_taken_against_the_rollout_logprobs"
KL_CONTROL = POLICY_RUN + "test_run_kl_controller_gets_the_global_kl_and_the_global_batch"
METRICS = POLICY_RUN + "test_run_logs_oai_metric_semantics"
SCHEDULE = POLICY_RUN + "test_run_nupdates_round_up_and_lr_anneals_per_update"
SYNC = POLICY_RUN + "test_run_syncs_weights_first_then_averages_gradients_before_every_step"
ALLREDUCE_TESTS = "tests/test_allreduce.py::"
ALLREDUCE = ALLREDUCE_TESTS + "test_overlapped_allreduce_gives_each_step_the_mean_of_the_processes_gradients"
NORMALIZATION = REWARD_RUN + "test_reward_run_normalizes_on_raw_samples_of_the_pretrained_policy"
LABEL_LOOP = REWARD_RUN + "test_reward_run_trains_one_epoch_in_rank_zero_order_with_rank_strided_slices"
REWARD_LOGS = REWARD_RUN + "test_reward_run_logs_the_best_of_n_cross_entropy"
PPO_LOSSES = UNITS + "test_ppo_losses_match_numpy_rederivation"
REWARDS = "tests/test_rewards.py::"
TP_TESTS = "tests/test_train_policy.py::"
PPO_STATS = "tests/test_train_policy.py::test_ppo_update_logs_every_statistic_by_its_formula"
REWARD_STATS = "tests/test_train_reward.py::test_reward_run_logs_each_statistic_by_its_formula"
NORMALIZED_REWARD = (
    REWARDS
    + "test_normalization_is_population_moments_of_truncated_samples_and_the_reward_is_gain_times_score_plus_bias"
)
TP, TR, MOD = "train_policy.py", "train_reward.py", "lm_human_preference_details/modeling.py"
PPO_PLUMBING = "lm_human_preference_details/ppo_plumbing.py"
REWARD_PLUMBING = "lm_human_preference_details/reward_plumbing.py"

RESUMED_STATE = "tests/test_resume.py::test_a_resumed_policy_run_holds_the_uninterrupted_runs_state_at_that_update"
REWARD_RESUMED_STATE = (
    "tests/test_resume.py::test_a_resumed_reward_run_holds_the_uninterrupted_runs_state_where_it_reads_it"
)
EOS_TESTS = "tests/test_nplus_eos.py::"
EOS_RUN = EOS_TESTS + "test_main_with_end_at_eos_masks_the_rollout_and_logs_the_masked_objectives"

BREAKAGES = [
    # ---------------------------------------------------------------- G: tokens, padding, sampling, heads
    Breakage(
        "G1-oai-pad-not-mapped",
        "G1",
        "label files keep OAI's PAD 50259 instead of the tokenizer's PAD",
        "lm_human_preference_details/labels.py",
        "query[query == file_pad_id] = pad_id",
        "query[query == file_pad_id] = file_pad_id",
        ["tests/test_labels.py::test_load_labels_maps_oai_pad"],
    ),
    Breakage(
        "G2-inclusive-positions",
        "G2",
        "position ids = cumsum(mask) - 1 (Hugging Face generate's rule) instead of the exclusive cumsum",
        MOD,
        "return torch.cumsum(mask, dim=1) - mask",
        "return torch.cumsum(mask, dim=1) - 1",
        ["tests/test_modeling.py::test_position_ids_from_mask_oai_exclusive_cumsum"],
    ),
    Breakage(
        "G2-pads-attended",
        "G2",
        "PAD keys are not masked out of attention",
        MOD,
        "visible = (keys <= query_slots[:, None])[None, None] & key_mask[:, None, None, :]  # (B, 1, Q, K)",
        "visible = (keys <= query_slots[:, None])[None, None] & torch.ones_like(key_mask)[:, None, None, :]",
        ["tests/test_modeling.py::test_pad_invisible_hidden_real_positions_match_unpadded"],
    ),
    Breakage(
        "G3-first-end-token",
        "G3",
        "queries end at the first end_text token instead of the last",
        "lm_human_preference_details/tasks.py",
        "tokens = tokens[: len(tokens) - tokens[::-1].index(end_token)]",
        "tokens = tokens[: tokens.index(end_token) + 1]",
        ["tests/test_tasks.py::test_build_query_oai_steps"],
    ),
    Breakage(
        "G4-reward-sees-context",
        "G4",
        "the reward model scores prefix + query + suffix (the policy's context) instead of the raw query",
        TP,
        "scores = models.reward(queries, postprocessed_responses)",
        "scores = models.reward(contexts, postprocessed_responses)",
        [ROLLOUT],
    ),
    Breakage(
        "G4-normalization-sees-context",
        "G4",
        "reward normalization scores the policy's context instead of the raw query",
        TR,
        "scores.append(reward_model(torch.cat([queries, responses], dim=1), pad_id))",
        "scores.append(reward_model(torch.cat([contexts, responses], dim=1), pad_id))",
        [NORMALIZATION],
    ),
    Breakage(
        "G4-empty-affix-copy-counted",
        "G4",
        "the host-sync counter takes the copy of an empty prefix or suffix (no elements, unpinned) for one that waits",
        "lm_human_preference_details/instruments/host_syncs.py",
        "if source.numel() == 0 or (destination is not None and destination.numel() == 0):",
        "if False:",
        ["tests/test_gpu_paths.py::test_counter_does_not_count_a_copy_of_no_elements"],
    ),
    Breakage(
        "G5-first-token-from-pad",
        "G5",
        "the first response token is sampled from the context's last position even when it is a PAD",
        MOD,
        "hidden = _gather_positions(output.last_hidden_state, _last_real_index(mask)[:, -1:])[:, 0]  # (B, D)",
        "hidden = output.last_hidden_state[:, -1]  # (B, D)",
        ["tests/test_modeling.py::test_sample_matches_full_forward"],
    ),
    Breakage(
        "G5-graph-kept-after-weights-moved",
        "G5",
        "--compile_sampler replays a decoding graph captured before the policy's tensors were replaced",
        "lm_human_preference_details/decoding_graph.py",
        "key = (*key, storage_key(policy))",
        "key = (*key,)",
        ["tests/test_gpu_paths.py::test_decoding_graph_is_captured_once_per_shape_and_weight_storage"],
    ),
    Breakage(
        "G5-chunks-redraw",
        "G5",
        "a rollout decoded in chunks (--rollout_micro_batch_size) gives each chunk the first rows' random numbers",
        MOD,
        "[u[start : start + max_rows] for u in uniforms]",
        "[u[: len(contexts[start : start + max_rows])] for u in uniforms]",
        [
            "tests/test_gpu_paths.py::test_sampling_in_chunks_gives_every_episode_the_samples_of_one_batch[False]",
        ],
    ),
    Breakage(
        "G6-reference-at-temperature-1",
        "G6",
        "the reference policy's log-probs use temperature 1 instead of the task temperature",
        TP,
        "ref_logprobs = reference_logprobs(ref_policy, query_responses, context_length, pad_id, task.temperature, "
        "rows)",
        "ref_logprobs = reference_logprobs(ref_policy, query_responses, context_length, pad_id, 1.0, rows)",
        [REFERENCE],
    ),
    Breakage(
        "G6-logits-untempered",
        "G6",
        "the policy's logits are not divided by the temperature",
        MOD,
        "logits = lm.get_output_embeddings()(hidden / temperature)",
        "logits = lm.get_output_embeddings()(hidden)",
        ["tests/test_modeling.py::test_sample_temperature_applied"],
    ),
    Breakage(
        "G7-dropout-kept",
        "G7",
        "the loaded config keeps its dropout probabilities",
        MOD,
        "setattr(config, key, 0.0)",
        "setattr(config, key, value)",
        ["tests/test_modeling.py::test_load_causal_lm_disables_dropout"],
    ),
    Breakage(
        "G8-value-head-random",
        "G8",
        "the value head starts from random weights instead of zeros",
        MOD,
        "nn.init.zeros_(self.value_head.weight)",
        "nn.init.normal_(self.value_head.weight, std=0.02)",
        ["tests/test_modeling.py::test_policy_value_head_zero_at_init"],
    ),
    Breakage(
        "G8-reward-head-std",
        "G8",
        "reward head std 1/sqrt(n_embd) instead of 1/sqrt(n_embd + 1)",
        MOD,
        "return 1.0 / math.sqrt(hidden_size + 1)",
        "return 1.0 / math.sqrt(hidden_size)",
        ["tests/test_modeling.py::test_reward_head_init_matches_oai"],
    ),
    Breakage(
        "G9-embeddings-frozen",
        "G9",
        "the token embeddings (tied to the LM head) are left out of the policy's optimizer",
        TP,
        "params = list(policy.parameters())\n    optimizer = optim.make_optimizer(",
        'params = [p for n, p in policy.named_parameters() if "wte" not in n]\n    optimizer = optim.make_optimizer(',
        [POLICY_RUN + "test_run_trains_the_embeddings_and_the_tied_lm_head"],
    ),
    Breakage(
        "G10-pad-samplable",
        "G10",
        "a PAD inside the model's vocabulary keeps its logit, so it can be sampled",
        MOD,
        "logits[..., pad_id] = torch.finfo(logits.dtype).min",
        "logits[..., pad_id] = logits[..., pad_id] * 1.0",
        ["tests/test_modeling.py::test_sample_never_samples_pad_inside_vocab"],
    ),
    # ---------------------------------------------------------------- R: reward model
    Breakage(
        "R1-no-gain",
        "R1",
        "the reward ignores the gain: head + bias",
        MOD,
        "return self.gain * self.head(last).squeeze(-1) + self.bias",
        "return self.head(last).squeeze(-1) + self.bias",
        ["tests/test_modeling.py::test_reward_model_batched_forward_matches_rows"],
    ),
    Breakage(
        "R2-reward-at-last-position",
        "R2",
        "the reward is read at the last position (a PAD after truncation) instead of the last real token",
        MOD,
        "return _gather_positions(hidden, _last_real_index(mask)[:, start:])",
        "return hidden[:, start:]",
        ["tests/test_modeling.py::test_reward_model_reads_last_real_token"],
    ),
    Breakage(
        "R3-gain-bias-frozen",
        "R3",
        "gain and bias are left out of the reward model's optimizer",
        TR,
        "params = list(reward_model.parameters())",
        "params = [p for p in reward_model.parameters() if p.dim() > 0]",
        [REWARD_RUN + "test_reward_run_trains_gain_and_bias_with_the_trunk"],
    ),
    Breakage(
        "R4-unbiased-std",
        "R4",
        "reward normalization uses this process's unbiased std instead of the global population std",
        TR,
        "mean, std = moments[0], (moments[1] - moments[0].square()).clamp_min(0).sqrt()",
        "mean, std = moments[0], scores.std()",
        [NORMALIZATION],
    ),
    Breakage(
        "R4-normalization-at-temperature-1",
        "R4",
        "reward normalization samples the pretrained policy at temperature 1 instead of the task temperature",
        TR,
        "ref_policy, contexts, args.task.response_length, args.task.temperature, pad_id, generator",
        "ref_policy, contexts, args.task.response_length, 1.0, pad_id, generator",
        [NORMALIZATION],
    ),
    Breakage(
        "R4-floor-batches",
        "R4",
        "normalization draws floor(normalize_samples / rollout_batch_size) batches (at least one) instead of ceil",
        TR,
        "for _ in range(sizing.ceil_div(n, args.rollout_batch_size)):",
        "for _ in range(max(1, n // args.rollout_batch_size)):",
        [NORMALIZATION],
    ),
    Breakage(
        "R4-no-reset",
        "R4",
        "normalization does not reset the gain to 1 before sampling",
        TR,
        "reward_model.gain.fill_(1.0)\n",
        "reward_model.gain.mul_(1.0)\n",
        [NORMALIZATION],
    ),
    Breakage(
        "R4-bias-formula",
        "R4",
        "normalization bias = target_mean - mean instead of target_mean - gain * mean",
        TR,
        "reward_model.bias.fill_(target_mean - gain * mean)",
        "reward_model.bias.fill_(target_mean - mean)",
        [NORMALIZATION],
    ),
    Breakage(
        "R5-hinge-loss",
        "R5",
        "best-of-N loss is a multi-class hinge loss instead of softmax cross-entropy",
        TR,
        'return F.cross_entropy(rewards, label, reduction="none")',
        'return F.multi_margin_loss(rewards, label, reduction="none")',
        ["tests/test_train_reward.py::test_best_of_n_loss_is_softmax_cross_entropy"],
    ),
    Breakage(
        "R5-samples-misaligned",
        "R5",
        "the batched scoring of label rows pairs queries with other rows' samples",
        MOD,
        "query.repeat_interleave(n, dim=0)",
        "query.repeat(n, 1)",
        ["tests/test_train_reward.py::test_score_label_rows_matches_separate_forwards"],
    ),
    Breakage(
        "R6-contiguous-slices",
        "R6",
        "each process takes a contiguous block of the step's labels instead of a rank-strided slice",
        TR,
        "local_indices = permutation[start : start + args.batch_size][rank::world]",
        "local_indices = permutation[start + rank * local_batch_size : start + (rank + 1) * local_batch_size]",
        [LABEL_LOOP],
    ),
    Breakage(
        "R6-order-not-broadcast",
        "R6",
        "each process uses its own label permutation instead of rank 0's",
        TR,
        "permutation = broadcast(permutation, from_process=0).cpu()",
        "permutation = permutation.cpu()",
        [LABEL_LOOP],
    ),
    Breakage(
        "R7-last-rows",
        "R7",
        "training uses the last num_train rows of the label file instead of the first",
        TR,
        "label_rows[: args.labels.num_train], label_rows[args.labels.num_train :]",
        "label_rows[-args.labels.num_train :], label_rows[: -args.labels.num_train]",
        [LABEL_LOOP],
    ),
    Breakage(
        "R8-gain-not-loaded",
        "R8",
        "a saved reward model is loaded without its gain",
        MOD,
        'model.gain.copy_(tensors["gain"])',
        "model.gain.copy_(model.gain)",
        [
            "tests/test_modeling.py::test_reward_model_save_load_roundtrip",
            "tests/test_artifacts.py::test_reward_model_without_classifier_export_fails_standard_loader_loudly",
        ],
    ),
    # ---------------------------------------------------------------- P: policy training
    Breakage(
        "P1-reference-is-current-policy",
        "P1",
        "the KL reference is the current policy instead of the frozen initial one",
        TP,
        "ref_logprobs = reference_logprobs(ref_policy, query_responses, context_length, pad_id, task.temperature, "
        "rows)",
        "ref_logprobs = reference_logprobs(models.policy, query_responses, context_length, pad_id, task.temperature, "
        "rows)",
        [REFERENCE],
    ),
    Breakage(
        "P2-reward-sees-raw-response",
        "P2",
        "the reward model scores the untruncated response",
        TP,
        "scores = models.reward(queries, postprocessed_responses)",
        "scores = models.reward(queries, responses)",
        [ROLLOUT],
    ),
    Breakage(
        "P2-truncation-token-dropped",
        "P2",
        "truncation also pads the truncating token itself",
        "lm_human_preference_details/tasks.py",
        "after_first_match = (matches.cumsum(1) - matches.long()) > 0",
        "after_first_match = matches.cumsum(1) > 0",
        ["tests/test_tasks.py::test_truncate_response_pads_after_first_qualifying_token"],
    ),
    Breakage(
        "P3-no-penalty",
        "P3",
        "responses that fail the filter keep the reward model's score instead of -1",
        TP,
        "scores = torch.where(passed, scores, task.penalty_reward_value)",
        "scores = torch.where(passed, scores, scores)",
        [POLICY_RUN + "test_run_failing_responses_score_the_penalty"],
    ),
    Breakage(
        "P3-filter-off-by-one",
        "P3",
        "the filter looks for the truncate token only after index truncate_after",
        "lm_human_preference_details/tasks.py",
        "return (responses[:, truncate_after:] == truncate_token).any(1)",
        "return (responses[:, truncate_after + 1 :] == truncate_token).any(1)",
        ["tests/test_tasks.py::test_passes_filter_needs_truncate_token_at_or_after_truncate_after"],
    ),
    Breakage(
        "P4-kl-sign",
        "P4",
        "the KL penalty has the wrong sign (+beta * kl)",
        TP,
        "non_score_reward = -kl_coef * kl",
        "non_score_reward = kl_coef * kl",
        ["tests/test_train_policy.py::test_compute_rewards_matches_tv5"],
    ),
    Breakage(
        "P5-reward-mean-removed",
        "P5",
        "reward whitening removes the mean (shift_mean=True)",
        TP,
        "rewards = whiten(rewards, shift_mean=False, group_size=whiten_group, correction=correction)",
        "rewards = whiten(rewards, shift_mean=True, group_size=whiten_group, correction=correction)",
        [WHITENING],
    ),
    Breakage(
        "P5-unbiased-variance",
        "P5",
        "whitening uses the unbiased variance",
        TP,
        "var, mean = torch.var_mean(groups, dim=dims, correction=correction, keepdim=True)",
        "var, mean = torch.var_mean(groups, dim=dims, correction=1, keepdim=True)",
        ["tests/test_train_policy.py::test_whiten_uses_population_not_unbiased_variance"],
    ),
    Breakage(
        "P5-unbiased-variance-by-default",
        "P5",
        "the run whitens with the unbiased variance without --ppo.whiten_variance unbiased",
        TP,
        'correction = int(ppo.whiten_variance == "unbiased")  # 0: OAI\'s population variance',
        "correction = 1",
        [WHITENING],
    ),
    Breakage(
        "P6-advantages-not-whitened",
        "P6",
        "advantages are not whitened",
        TP,
        "return rewards, whiten(advantages, group_size=whiten_group, correction=correction), returns",
        "return rewards, advantages, returns",
        [WHITENING],
    ),
    Breakage(
        "P6-returns-without-values",
        "P6",
        "returns = advantages instead of advantages + values",
        TP,
        "return advantages, advantages + values",
        "return advantages, advantages",
        ["tests/test_train_policy.py::test_compute_advantages_matches_tv9"],
    ),
    Breakage(
        "P7-loss-forward-untempered",
        "P7",
        "the loss forward evaluates the responses at temperature 1",
        TP,
        "rollout.query_responses[micro_inds], rollout.context_length, pad_id, temperature",
        "rollout.query_responses[micro_inds], rollout.context_length, pad_id, 1.0",
        [RATIO],
    ),
    Breakage(
        "P8-value-loss-min",
        "P8",
        "the clipped value loss takes the min of the two terms",
        TP,
        "vf_loss = 0.5 * value_mean(torch.max(vf_losses1, vf_losses2))",
        "vf_loss = 0.5 * value_mean(torch.min(vf_losses1, vf_losses2))",
        [PPO_LOSSES],
    ),
    Breakage(
        "P9-ratio-against-reference",
        "P9",
        "the PPO ratio is taken against the reference policy's log-probs",
        TP,
        "return Rollout(query_responses, context_length, ppo_logprobs, ppo_values, rewards, masks, stats, samples)",
        "return Rollout(query_responses, context_length, ref_logprobs, ppo_values, rewards, masks, stats, samples)",
        [RATIO],
    ),
    Breakage(
        "P9-policy-loss-min",
        "P9",
        "the clipped policy loss takes the min (optimistic) term",
        TP,
        "pg_loss = policy_mean(torch.max(pg_losses, pg_losses2))",
        "pg_loss = policy_mean(torch.min(pg_losses, pg_losses2))",
        [PPO_LOSSES],
    ),
    Breakage(
        "P10-vf-coef-ignored",
        "P10",
        "the total loss adds the value loss without vf_coef",
        TP,
        '"loss/total": pg_loss + vf_coef * vf_loss,',
        '"loss/total": pg_loss + vf_loss,',
        [PPO_LOSSES],
    ),
    Breakage(
        "P11-approxkl-factor",
        "P11",
        "approxkl = mean(dlogp^2) without the factor 0.5",
        TP,
        '"policy/approxkl": 0.5 * (logprob_diff**2).mean(),',
        '"policy/approxkl": (logprob_diff**2).mean(),',
        [PPO_LOSSES],
    ),
    Breakage(
        "P11-entropy-formula",
        "P11",
        "the entropy sums exp(z - max) * z instead of exp(z - max) * (z - max) (drops the logsumexp's max term)",
        "lm_human_preference_details/kernels.py",
        "torch.sub(logits[..., chunk], maxes, out=products)",
        "torch.sub(logits[..., chunk], 0, out=products)",
        ["tests/test_kernels.py::test_logprobs_and_entropy_from_logits_match_separate_functions"],
    ),
    Breakage(
        "P12-one-permutation",
        "P12",
        "one permutation is reused for every PPO epoch",
        TP,
        "[[rng.permutation(group_size) for _ in range(noptepochs)] for rng in rngs]",
        "[[rng.permutation(group_size)] * noptepochs for rng in rngs]",
        [POLICY_RUN + "test_run_each_epoch_draws_a_fresh_permutation"],
    ),
    Breakage(
        "P13-values-not-from-sampling",
        "P13",
        "the sampler's values are not the value head of the sampling pass",
        MOD,
        "return tokens, logprobs, policy.value_head(hidden).squeeze(-1).float()",
        "return tokens, logprobs, policy.value_head(hidden).squeeze(-1).float() * 0",
        ["tests/test_modeling.py::test_sample_matches_full_forward"],
    ),
    Breakage(
        "P14-local-batch-n-steps",
        "P14",
        "the KL controller's n_steps is the per-process batch instead of the global batch",
        TP,
        'kl_ctl.update(stats["objective/kl"], ppo.batch_size)',
        'kl_ctl.update(stats["objective/kl"], sizes.batch)',
        [KL_CONTROL],
    ),
    Breakage(
        "P14-rank-local-kl",
        "P14",
        "the KL controller is updated with this process's KL instead of the KL of all processes",
        TP,
        'kl_ctl.update(stats["objective/kl"], ppo.batch_size)',
        "kl_ctl.update(kl.sum(1).mean().item(), ppo.batch_size)",
        [KL_CONTROL],
    ),
    Breakage(
        "P14-clip-range",
        "P14",
        "the controller clips the proportional error to +-0.1 instead of +-0.2",
        TP,
        "np.clip(current / self.target - 1, -0.2, 0.2)",
        "np.clip(current / self.target - 1, -0.1, 0.1)",
        ["tests/test_train_policy.py::test_adaptive_kl_controller_matches_tv7"],
    ),
    Breakage(
        "P15-floor-nupdates",
        "P15",
        "nupdates = total_episodes // batch_size instead of ceil",
        "lm_human_preference_details/sizes.py",
        "nupdates = ceil_div(ppo.total_episodes, ppo.batch_size)",
        "nupdates = ppo.total_episodes // ppo.batch_size",
        [SCHEDULE],
    ),
    Breakage(
        "P16-lr-one-update-ahead",
        "P16",
        "the learning rate of update u is lr * (1 - (u + 1) / nupdates)",
        TP,
        "lr_now = ppo.lr * (1 - update / sizes.nupdates)",
        "lr_now = ppo.lr * (1 - (update + 1) / sizes.nupdates)",
        [SCHEDULE],
    ),
    Breakage(
        "P17-whitening-minimum",
        "P17",
        "reward whitening accepts groups of fewer than 8 episodes",
        "lm_human_preference_details/sizes.py",
        "if ppo.whiten_rewards and whiten_group < 8:",
        "if ppo.whiten_rewards and whiten_group < 4:",
        ["tests/test_train_policy.py::test_main_whitening_group_below_eight_raises"],
    ),
    Breakage(
        "P18-metric-renamed",
        "P18",
        "objective/score is logged as objective/scores",
        TP,
        '"objective/score": scores.mean(),',
        '"objective/scores": scores.mean(),',
        ["tests/test_train_policy.py::test_main_logs_exactly_oai_metric_names"],
    ),
    Breakage(
        "P19-current-kl-coef-in-table",
        "P19",
        "the sample table's total uses the current kl_coef instead of the initial one",
        "lm_human_preference_details/ppo_plumbing.py",
        "*samples, args.rewards.kl_coef, args.run.print_samples)",
        '*samples, stats["objective/kl_coef"], args.run.print_samples)',
        [POLICY_RUN + "test_run_sample_table_totals_use_the_initial_kl_coef"],
    ),
    Breakage(
        "P20-no-final-save",
        "P20",
        "the policy is not saved at the end of training",
        "lm_human_preference_details/resumable.py",
        "if last or stopping or (self.save_interval and steps % self.save_interval == 0):",
        "if stopping or (self.save_interval and steps % self.save_interval == 0):",
        ["tests/test_train_policy.py::test_main_saves_a_loadable_policy"],
    ),
    Breakage(
        "P20-resume-keeps-the-initial-kl-coef",
        "P20",
        "a resumed policy run starts from the initial kl_coef instead of the checkpoint's",
        PPO_PLUMBING,
        'self.kl_ctl.value = resumed.shared["kl_coef"]',
        "self.kl_ctl.value = self.kl_ctl.value",
        [RESUMED_STATE],
    ),
    Breakage(
        "P20-resume-restarts-the-query-stream",
        "P20",
        "a resumed policy run draws its queries from the start of the stream instead of the checkpoint's position",
        PPO_PLUMBING,
        'self.query_stream.load_state_dict(resumed.local["query_stream"])',
        "self.query_stream.state_dict()",
        [RESUMED_STATE],
    ),
    Breakage(
        "P20-resume-reseeds-the-epoch-orders",
        "P20",
        "a resumed policy run restores the sampling and global RNGs but not the PPO epochs' permutation RNGs",
        PPO_PLUMBING,
        'devices.restore_rng_states(resumed.local["rng"], self.generator, self.order_rngs)',
        'devices.restore_rng_states({**resumed.local["rng"], "numpy_rngs": []}, self.generator)',
        [RESUMED_STATE],
    ),
    Breakage(
        "P20-resume-without-adam-state",
        "P20",
        "a resumed policy run starts Adam afresh (no moments, step 0) instead of from the checkpoint's",
        PPO_PLUMBING,
        'self.optimizer.load_state_dict(resumed.shared["optimizer"])',
        "self.optimizer.state_dict()",
        [RESUMED_STATE],
    ),
    Breakage(
        "P20-resume-forgets-the-divergence-watch",
        "P20",
        "a resumed policy run's divergence watch starts afresh instead of the checkpoint's",
        PPO_PLUMBING,
        'self.report.load_state_dict(resumed.shared.get("report"))',
        "self.report.load_state_dict(None)",
        [RESUMED_STATE],
    ),
    Breakage(
        "P20-host-twin-copies-the-kv-cache",
        "P20",
        "the checkpoint's host twin copies tensors the model keeps beside its weights (the sampler's KV cache)",
        "lm_human_preference_details/checkpoint.py",
        'return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")',
        "return func(*args, **(kwargs or {}))",
        ["tests/test_checkpoint.py::test_the_host_copy_holds_the_state_dict_only_not_what_the_module_keeps_beside_it"],
    ),
    # ---------------------------------------------------------------- O: optimizer
    Breakage(
        "O1-eps",
        "O1",
        "Adam's epsilon is 1e-8 instead of OAI's 1e-5",
        "lm_human_preference_details/optim.py",
        "    eps: float = 1e-5,\n    fused: bool = False,\n) -> torch.optim.Optimizer:",
        "    eps: float = 1e-8,\n    fused: bool = False,\n) -> torch.optim.Optimizer:",
        [UNITS + "test_make_optimizer_is_tf1_adam_with_oai_eps"],
    ),
    Breakage(
        "O1-policy-eps",
        "O1",
        "train_policy.py's Adam epsilon defaults to 1e-8 instead of OAI's 1e-5",
        TP,
        '    eps: float = 1e-5\n    """Adam\'s epsilon',
        '    eps: float = 1e-8\n    """Adam\'s epsilon',
        ["tests/test_optim.py::test_train_policy_eps_and_value_head_bias_reach_the_optimizer"],
    ),
    Breakage(
        "O2-pytorch-adam",
        "O2",
        "the scripts get torch.optim.Adam instead of TF1-style Adam",
        "lm_human_preference_details/optim.py",
        "    if use_tensorflow_adam:\n        return AdamTensorFlowStyle(",
        "    if False:\n        return AdamTensorFlowStyle(",
        [UNITS + "test_make_optimizer_is_tf1_adam_with_oai_eps"],
    ),
    Breakage(
        "O3-bias-correction",
        "O3",
        "TF-style Adam drops the second-moment bias correction from the step size",
        "lm_human_preference_details/optim.py",
        'step_sizes.append(-group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))',
        'step_sizes.append(-group["lr"] / (1.0 - beta1**t))',
        ["tests/test_optim.py::test_adam_tf_style_matches_closed_form_float64"],
    ),
    Breakage(
        "O4-gradients-summed",
        "O4",
        "gradients are summed over processes instead of averaged (a DDP comm hook that all-reduces without dividing)",
        "lm_human_preference_details/distributed.py",
        "    return DistributedDataParallel(\n        module,\n",
        "    def summed(*args, **kwargs):\n        ddp = DistributedDataParallel(*args, **kwargs)\n"
        "        ddp.register_comm_hook(None, lambda _, bucket: dist.all_reduce(bucket.buffer(), async_op=True)"
        ".get_future().then(lambda f: f.value()[0]))\n        return ddp\n\n    return summed(\n        module,\n",
        ["tests/test_distributed.py::test_allreduce_and_broadcast_two_processes"],
    ),
    Breakage(
        "O4-no-allreduce",
        "O4",
        "the policy's gradients are not all-reduced before the optimizer step (PPO's forwards skip DDP)",
        TP,
        "trained = distributed.data_parallel(learner, accelerator, args.run.fsdp)",
        "trained = learner",
        [SYNC],
    ),
    Breakage(
        "O4-last-micro-batch-not-averaged",
        "O4",
        "the policy's micro-batches all run without DDP's gradient sync: no all-reduce before the step",
        TP,
        "with distributed.averaging_gradients(policy, last_micro):",
        "with distributed.averaging_gradients(policy, False):",
        [SYNC, ALLREDUCE],
    ),
    Breakage(
        "O4-reward-no-allreduce",
        "O4",
        "the reward model's gradients are not all-reduced before the optimizer step (every micro-batch under no_sync)",
        TR,
        "with distributed.averaging_gradients(trained, len(step_rewards) == accum - 1):",
        "with distributed.averaging_gradients(trained, False):",
        [ALLREDUCE],
    ),
    Breakage(
        "O4-allreduce-every-micro-batch",
        "O4",
        "every micro-batch's backward all-reduces the gradients (no no_sync): gradient accumulation communicates "
        "accum times per step",
        "lm_human_preference_details/distributed.py",
        "if isinstance(trained, DistributedDataParallel) and not average:",
        "if isinstance(trained, DistributedDataParallel) and False:",
        ["tests/test_distributed.py::test_allreduce_and_broadcast_two_processes", ALLREDUCE],
    ),
    Breakage(
        "O4-gradients-beside-buckets",
        "O4",
        "DDP copies the gradients into its buckets instead of making them views of them: a second gradient-sized copy",
        "lm_human_preference_details/distributed.py",
        "gradient_as_bucket_view=True,",
        "gradient_as_bucket_view=False,",
        [ALLREDUCE_TESTS + "test_ddp_gradients_are_its_buckets_and_a_step_allocates_no_second_copy"],
    ),
    Breakage(
        "O4-ddp-gradients-set-to-none",
        "O4",
        "DDP's gradients are freed after each step: the next backward allocates fresh ones and copies them into the "
        "buckets",
        "lm_human_preference_details/distributed.py",
        "optimizer.zero_grad(set_to_none=not isinstance(trained, DistributedDataParallel))",
        "optimizer.zero_grad(set_to_none=True)",
        [ALLREDUCE_TESTS + "test_ddp_gradients_are_its_buckets_and_a_step_allocates_no_second_copy"],
    ),
    Breakage(
        "O4-ddp-gradients-not-cleared",
        "O4",
        "DDP's gradients are not cleared after a step: each step adds the previous steps' gradients",
        "lm_human_preference_details/distributed.py",
        "    optimizer.zero_grad(set_to_none=not isinstance(trained, DistributedDataParallel))",
        "    if not isinstance(trained, DistributedDataParallel):\n        optimizer.zero_grad(set_to_none=True)",
        [ALLREDUCE_TESTS + "test_ddp_steps_with_gradients_zeroed_in_place_equal_steps_with_gradients_set_to_none"],
    ),
    Breakage(
        "O5-reward-lr-schedule",
        "O5",
        "the reward model's learning rate is annealed one step ahead (0 at the last step)",
        TR,
        "lr = args.lr * (1 - start / args.labels.num_train)",
        "lr = args.lr * (1 - (start + args.batch_size) / args.labels.num_train)",
        [LABEL_LOOP],
    ),
    # ---------------------------------------------------------------- D: processes, seeds, data order
    Breakage(
        "D1-per-process-batch",
        "D1",
        "ppo.batch_size is taken per process instead of global",
        "lm_human_preference_details/sizes.py",
        'batch = per_process(ppo.batch_size, world, "--ppo.batch_size",',
        'batch = per_process(ppo.batch_size, 1, "--ppo.batch_size",',
        [ROLLOUT],
    ),
    Breakage(
        "D1-more-processes-than-gpus-pass",
        "D1",
        "a run on GPUs with more processes per machine than GPUs starts (and stops deep in NCCL)",
        "lm_human_preference_details/distributed.py",
        "    if processes > gpus:",
        "    if processes > 2 * gpus:",
        ["tests/test_multiprocess.py::test_more_processes_per_machine_than_gpus_stop_at_the_start_in_one_line"],
    ),
    Breakage(
        "D1-gpu-count-unchecked-at-launch",
        "D1",
        "the training scripts' accelerator does not check the processes per machine against the GPUs",
        "lm_human_preference_details/distributed.py",
        "    check_gpus_per_process(os.environ)\n",
        "",
        ["tests/test_multiprocess.py::test_more_processes_per_machine_than_gpus_stop_at_the_start_in_one_line"],
    ),
    Breakage(
        "D2-no-rank-seed",
        "D2",
        "every process seeds NumPy and torch with the run seed (no rank offset)",
        TR,
        "set_seed(args.seed + rank * 100003)",
        "set_seed(args.seed)",
        [LABEL_LOOP],
    ),
    Breakage(
        "D3-rank-seeded-order",
        "D3",
        "each process shuffles the texts with its own seed",
        "lm_human_preference_details/data.py",
        "self.order = oai_shuffle_order(len(texts), data_seed)",
        "self.order = oai_shuffle_order(len(texts), data_seed + rank)",
        ["tests/test_data.py::test_query_stream_ranks_disjoint_and_union_equals_single_rank"],
    ),
    Breakage(
        "D3-run-seed-order",
        "D3",
        "the policy's query order follows the run seed instead of the data seed",
        TP,
        "QueryStream(texts, tokenizer, task, accelerator.process_index, sizes.world, args.data_seed)",
        "QueryStream(texts, tokenizer, task, accelerator.process_index, sizes.world, args.seed)",
        [POLICY_RUN + "test_run_draws_queries_in_the_data_seed_order_rank_strided"],
    ),
    Breakage(
        "D4-groups-ignored",
        "D4",
        "whitening ignores the group size (one group over all rows)",
        TP,
        "groups = values.reshape(-1, group_size or values.shape[0], *values.shape[1:])",
        "groups = values.reshape(1, -1, *values.shape[1:])",
        ["tests/test_train_policy.py::test_whiten_groups_use_population_moments_per_group"],
    ),
    Breakage(
        "D5-rank-zero-stats",
        "D5",
        "statistics are rank 0's instead of the mean over processes",
        TP,
        "reduced[key] = column.mean().item()",
        "reduced[key] = column[0].item()",
        [METRICS],
    ),
    Breakage(
        "D5-last-minibatch-stats",
        "D5",
        "PPO statistics are the last minibatch's instead of the mean over all minibatch steps",
        TP,
        "self.sums[key] = self.sums.get(key, 0.0) + value.detach() * weight",
        "self.sums[key] = value.detach()",
        [METRICS],
    ),
    Breakage(
        "D6-no-initial-broadcast",
        "D6",
        "rank 0's policy weights are not broadcast before training",
        TP,
        "distributed.broadcast_parameters(policy, accelerator)",
        "distributed.broadcast_parameters(torch.nn.Module(), accelerator)",
        [SYNC],
    ),
    Breakage(
        "D7-global-label-batch-per-process",
        "D7",
        "each process takes the whole global label batch size",
        "lm_human_preference_details/sizes.py",
        'per_process(args.batch_size, world, "--batch_size", f"pass a multiple of {world}")\n    where = f"the labels',
        'per_process(args.batch_size, 1, "--batch_size", f"pass a multiple of {world}")\n    where = f"the labels',
        [LABEL_LOOP],
    ),
    # ---------------------------------------------------------------- H: hyperparameter plumbing, LG
    Breakage(
        "H1-horizon",
        "H1",
        "the adaptive KL horizon defaults to 1000 instead of 10000",
        TP,
        "horizon: int = 10000",
        "horizon: int = 1000",
        [UNITS + "test_adaptive_kl_defaults_are_oai_on_settings"],
    ),
    Breakage(
        "H2-tldr-whitens-rewards",
        "H2",
        "the tldr/cnndm presets keep reward whitening on",
        "lm_human_preference_details/presets.py",
        '"ppo.whiten_rewards": False,\n        }\n        for name, kl_coef in',
        '"ppo.whiten_rewards": True,\n        }\n        for name, kl_coef in',
        ["tests/test_train_policy.py::test_oai_presets_match_launch_settings"],
    ),
    Breakage(
        "H3-summarization-reward-lr",
        "H3",
        "the tldr/cnndm reward presets use the class default lr 5e-5 instead of launch.py's 2.5e-5",
        "lm_human_preference_details/presets.py",
        '"lr": 2.5e-5,',
        '"lr": 5e-5,',
        ["tests/test_train_reward.py::test_presets_follow_oai_launch"],
    ),
    Breakage(
        "TRL-switch-population-variance",
        "N22",
        "the trl_tldr preset whitens with the population variance (TRL divides by n - 1)",
        "lm_human_preference_details/presets.py",
        '"ppo.whiten_variance": "unbiased",',
        '"ppo.whiten_variance": "population",',
        ["tests/test_trl_parity.py::test_one_update_of_the_trl_switch_equals_trls"],
    ),
    Breakage(
        "LG-untruncated-labels",
        "LG",
        "generated label rows hold the untruncated responses",
        "label_generation.py",
        "collected[active[rows], slot[rows, cols]] = postprocessed[rows, cols]",
        "collected[active[rows], slot[rows, cols]] = raw.view(-1, per_query, length)[rows, cols]",
        ["tests/test_label_generation.py::test_sample_passing_responses_drops_failing_and_truncates"],
    ),
    Breakage(
        "LG-sampled-at-temperature-1",
        "LG",
        "label generation samples the candidates at temperature 1 instead of the task temperature",
        "label_generation.py",
        "policy, contexts[active].repeat_interleave(per_query, 0), length, task.temperature, pad_id, generator",
        "policy, contexts[active].repeat_interleave(per_query, 0), length, 1.0, pad_id, generator",
        ["tests/test_label_generation.py::test_sample_passing_responses_samples_at_the_task_temperature"],
    ),
    Breakage(
        "G6-rollout-at-temperature-1",
        "G6",
        "the policy samples its rollout at temperature 1 instead of the task temperature",
        TP,
        "task.response_length,\n            task.temperature,\n            pad_id,\n            generator,",
        "task.response_length,\n            1.0,\n            pad_id,\n            generator,",
        [POLICY_RUN + "test_run_rollout_logprobs_and_values_come_from_the_sampling_policy"],
    ),
    Breakage(
        "G6-bf16-ratio-logprobs-at-temperature-1",
        "G6",
        "--bf16: the ratio's old log-probs (the loss forward's arithmetic) are taken at temperature 1",
        TP,
        "models.learner, query_responses, context_length, pad_id, task.temperature, sizes.micro",
        "models.learner, query_responses, context_length, pad_id, 1.0, sizes.micro",
        [TP_TESTS + "test_main_gradient_checkpointing_and_bf16_track_the_plain_update"],
    ),
    Breakage(
        "G6-evaluate-sampled-at-temperature-1",
        "G6",
        "evaluate.py samples the policy at temperature 1 instead of the task temperature",
        "lm_human_preference_details/evaluation.py",
        "sample(policy, contexts, task.response_length, task.temperature, pad_id, generator)",
        "sample(policy, contexts, task.response_length, 1.0, pad_id, generator)",
        ["tests/test_evaluation.py::test_kl_matches_a_direct_recomputation"],
    ),
    Breakage(
        "G6-evaluate-reference-at-temperature-1",
        "G6",
        "evaluate.py's KL takes the reference policy's log-probs at temperature 1 instead of the task temperature",
        "lm_human_preference_details/evaluation.py",
        "contexts.shape[1], pad_id, task.temperature)[0]",
        "contexts.shape[1], pad_id, 1.0)[0]",
        ["tests/test_evaluation.py::test_kl_matches_a_direct_recomputation"],
    ),
    # ---------------------------------------------------------------- §4: metric semantics
    Breakage(
        "metrics-kl-per-token",
        "§4.1",
        "objective/kl is the mean per-token KL instead of the per-episode sum, averaged",
        TP,
        '"objective/kl": kl.sum(1).mean(),',
        '"objective/kl": kl.mean(),',
        [METRICS],
    ),
    Breakage(
        "metrics-entropy-per-token",
        "§4.1",
        "objective/entropy is a per-token mean instead of the per-episode sum, averaged",
        TP,
        '"objective/entropy": (-logprobs).sum(1).mean(),',
        '"objective/entropy": (-logprobs).mean(),',
        [METRICS],
    ),
    Breakage(
        "metrics-score-total",
        "§4.1",
        "objective/score_total leaves out the KL penalty",
        TP,
        '"objective/score_total": scores.mean() + non_score_reward.sum(1).mean(),',
        '"objective/score_total": scores.mean(),',
        [METRICS],
    ),
    Breakage(
        "metrics-unbiased-returns-var",
        "§4.1",
        "ppo/returns/var is the unbiased variance",
        TP,
        "var_returns, mean_returns = torch.var_mean(returns.reshape(groups, -1), dim=1, correction=0)",
        "var_returns, mean_returns = torch.var_mean(returns.reshape(groups, -1), dim=1, correction=1)",
        [METRICS],
    ),
    Breakage(
        "metrics-var-explained",
        "§4.1",
        "var_explained divides by the second moment of the returns instead of their variance",
        TP,
        '1 - stats["ppo/val/error"] / stats["ppo/returns/var"]',
        '1 - stats["ppo/val/error"] / (stats["ppo/returns/var"] + stats["ppo/returns/mean"] ** 2)',
        [METRICS],
    ),
    Breakage(
        "metrics-elapsed-serial-steps",
        "§4.1",
        "elapsed/steps/serial counts all episodes' tokens",
        TP,
        'stats["elapsed/steps/serial"] = steps * length',
        'stats["elapsed/steps/serial"] = steps * batch * length',
        [METRICS],
    ),
    Breakage(
        "reward-metrics-error-is-accuracy",
        "§4.2",
        "train_reward/minibatch/error logs 1 - accuracy instead of the loss",
        TR,
        'stats = {"loss": error, "error": error}',
        'stats = {"loss": error, "error": (rewards.argmax(1) != label).float().mean()}',
        [REWARD_LOGS],
    ),
    Breakage(
        "reward-metrics-last-micro-batch",
        "§4.2",
        "the logged statistics are those of the last micro-batch instead of the whole step",
        TR,
        "oai_stats = label_loss(label_type, step_rewards, label)",
        "oai_stats = label_loss(label_type, rewards.detach(), micro_label)",
        [REWARD_LOGS],
    ),
    # ---------------------------------------------------------------- RS: programmatic rewards
    Breakage(
        "RS1-no-penalty-for-programmatic",
        "RS1",
        "responses that fail the filter keep a programmatic reward's score instead of the penalty",
        TP,
        "scores = torch.where(passed, scores, task.penalty_reward_value)",
        "scores = torch.where(passed | (reward.metadata is None), scores, task.penalty_reward_value)",
        [REWARDS + "test_python_reward_sees_raw_queries_and_truncated_responses_and_failing_ones_get_the_penalty"],
    ),
    Breakage(
        "RS1-untruncated-for-programmatic",
        "RS1",
        "a programmatic reward scores the untruncated response",
        TP,
        "scores = models.reward(queries, postprocessed_responses)",
        "scores = models.reward(queries, postprocessed_responses if models.reward.metadata else responses)",
        [REWARDS + "test_python_reward_sees_raw_queries_and_truncated_responses_and_failing_ones_get_the_penalty"],
    ),
    Breakage(
        "RS1-normalization-gain-ignored",
        "RS1",
        "the normalization's bias is added but its gain is not applied",
        "lm_human_preference_details/rewards.py",
        "return self.gain * self.raw(queries, responses) + self.bias",
        "return self.raw(queries, responses) + self.bias",
        [REWARDS + "test_normalization_gain_and_bias_are_saved_and_restored_on_resume"],
    ),
    Breakage(
        "RS1-normalization-remeasured-on-resume",
        "RS1",
        "a resumed run measures gain and bias afresh instead of taking its checkpoint's",
        "lm_human_preference_details/rewards.py",
        'normalization = resumed.meta.get("reward_normalization") if resumed else None',
        "normalization = None",
        [REWARDS + "test_normalization_gain_and_bias_are_saved_and_restored_on_resume"],
    ),
    Breakage(
        "RS1-nonfinite-score-accepted",
        "RS1",
        "a function's NaN or infinite score goes into training unnamed",
        "lm_human_preference_details/rewards.py",
        "bad = (~torch.isfinite(scores)).nonzero()",
        "bad = torch.isfinite(scores[:0]).nonzero()",
        [REWARDS + "test_bad_reward_function_is_one_line_naming_the_function_and_the_problem[nan]"],
    ),
    Breakage(
        "RS1-wrong-length-accepted",
        "RS1",
        "a function that returns fewer scores than episodes is not stopped",
        "lm_human_preference_details/rewards.py",
        "if scores.dim() != 1 or scores.numel() != len(response_texts):",
        "if scores.dim() != 1:",
        [REWARDS + "test_bad_reward_function_is_one_line_naming_the_function_and_the_problem[too-few]"],
    ),
    Breakage(
        "D4-default-one-rank-per-process",
        "D4",
        "with no whitening flag each process whitens its whole batch (a plain data-parallel port), not OAI's 8 ranks",
        "lm_human_preference_details/sizes.py",
        "    else:\n        return oai_group, None",
        "    else:\n        return batch, None",
        [
            "tests/test_oai_ranks.py::test_default_sizes_are_oai_ranks_on_any_process_count",
            "tests/test_oai_ranks.py::test_one_two_and_four_processes_log_oai_eight_rank_whitening",
            "tests/test_train_policy.py::test_whiten_groups_use_population_moments_per_group",
        ],
    ),
    Breakage(
        "R8-resume-without-adam-state",
        "R8",
        "a resumed reward run starts Adam afresh (no moments, step 0) instead of from the checkpoint's",
        REWARD_PLUMBING,
        'optimizer.load_state_dict(resumed.shared["optimizer"])',
        "optimizer.state_dict()",
        [REWARD_RESUMED_STATE],
    ),
    Breakage(
        "R8-resume-restarts-the-query-stream",
        "R8",
        "a resumed reward run normalizes on queries from the start of the stream instead of the checkpoint's position",
        REWARD_PLUMBING,
        "query_stream.load_state_dict(query_stream_state(resumed, query_stream))",
        "query_stream.state_dict()",
        [REWARD_RESUMED_STATE],
    ),
    Breakage(
        "R8-resume-reseeds-the-rngs",
        "R8",
        "a resumed reward run reseeds its RNGs from the seed and step instead of restoring the checkpoint's",
        REWARD_PLUMBING,
        'devices.restore_rng_states(resumed.local["rng"], generator)\n        return',
        "devices.reseed_rngs(args.seed, accelerator.process_index, resumed.step, generator)\n        return",
        [REWARD_RESUMED_STATE],
    ),
    Breakage(
        "R8-task-name-unchecked",
        "R8",
        "a reward model trained for another --task (sentiment for descriptiveness) trains the policy without a word",
        "lm_human_preference_details/ppo_plumbing.py",
        "    if saved == task_id:\n        return None",
        "    if saved is not None:\n        return None",
        [
            "tests/test_wrong_experiment.py::test_reward_model_of_the_other_books_task_stops_the_policy",
            "tests/test_modeling.py::test_reward_model_save_load_roundtrip",
        ],
    ),
    Breakage(
        "P11-entropy-unshifted-dot",
        "P11",
        "the entropy is max + log(total) - (exps . z) / total, one float32 dot over unshifted logits (1.1e-4 off)",
        "lm_human_preference_details/kernels.py",
        "    return total.log() - shifted_sum / total",
        "    return maxes + total.log() - (exps.unsqueeze(-2) @ logits.unsqueeze(-1)).squeeze(-1) / total",
        [
            "tests/test_kernels.py::test_fused_entropy_on_full_vocabulary_float32_logits_is_as_accurate_as_the_plain_formula",
            "tests/test_kernels.py::test_logprobs_and_entropy_from_logits_match_separate_functions",
        ],
    ),
    Breakage(
        "R7-text-pairs-rejected-first",
        "R7",
        "a text preference pair becomes a best_of_2 row with the rejected response as the better one",
        "lm_human_preference_details/text_prefs.py",
        "row.update(sample0=first, sample1=second, best=CHOSEN_INDEX)",
        "row.update(sample0=second, sample1=first, best=CHOSEN_INDEX)",
        [
            "tests/test_text_prefs.py::test_pairs_tokenize_like_oai_label_rows_chosen_first",
            "tests/test_text_prefs.py::test_text_pairs_convert_to_oai_schema_and_back_without_loss",
        ],
    ),
    Breakage(
        "R7-text-pairs-back-swapped",
        "R7",
        "converting best_of_2 rows back to text pairs takes the other sample as the chosen response",
        "lm_human_preference_details/text_prefs.py",
        """fields["chosen"] = [row[f"sample{row['best']}"] for row in rows]""",
        """fields["chosen"] = [row[f"sample{1 - row['best']}"] for row in rows]""",
        ["tests/test_text_prefs.py::test_text_pairs_convert_to_oai_schema_and_back_without_loss"],
    ),
    Breakage(
        "RS1-evaluate-normalization-ignored",
        "RS1",
        "evaluate.py scores a normalized programmatic reward raw, without the run's gain and bias",
        "evaluate.py",
        'reward.gain, reward.bias = normalization["gain"], normalization["bias"]',
        "reward.gain, reward.bias = 1.0, 0.0",
        ["tests/test_evaluation.py::test_vader_run_is_scored_by_vader_with_its_normalization_and_the_filter_penalty"],
    ),
    Breakage(
        "RS1-evaluate-no-penalty-for-programmatic",
        "RS1",
        "evaluate.py gives a programmatic reward's score to responses that fail the filter, not the penalty",
        "lm_human_preference_details/evaluation.py",
        "metrics = {SCORE: torch.where(passed, scores, task.penalty_reward_value)}",
        "metrics = {SCORE: torch.where(passed | (reward.metadata is None), scores, task.penalty_reward_value)}",
        ["tests/test_evaluation.py::test_vader_run_is_scored_by_vader_with_its_normalization_and_the_filter_penalty"],
    ),
    Breakage(
        "RS1-evaluate-untruncated-for-programmatic",
        "RS1",
        "evaluate.py's programmatic reward scores the untruncated response",
        "lm_human_preference_details/evaluation.py",
        "scores = reward(batch, truncated)",
        "scores = reward(batch, truncated if reward.metadata else responses)",
        ["tests/test_evaluation.py::test_vader_run_is_scored_by_vader_with_its_normalization_and_the_filter_penalty"],
    ),
    Breakage(
        "RS1-evaluate-normalization-of-another-reward",
        "RS1",
        "evaluate.py applies a run's normalization to a --reward_model other than the one the run trained against",
        "evaluate.py",
        'if run is not None and run["rewards"]["trained_model"] == reward:',
        "if run is not None:",
        ["tests/test_evaluation.py::test_normalization_comes_from_the_first_run_trained_against_the_evaluated_reward"],
    ),
    # ---------------------------------------------------------------- LoRA (--lora.rank, docs/lora.md)
    Breakage(
        "P4-lora-reference-adapters-on",
        "P4",
        "under LoRA the reference policy keeps its adapters: the KL is measured against the policy itself",
        "lm_human_preference_details/lora.py",
        "    with peft_model_of(policy).disable_adapter():",
        "    with _quiet_peft():",
        ["tests/test_lora.py::test_reference_is_exactly_the_base_model_at_init_and_after_an_update"],
    ),
    Breakage(
        "G9-lora-base-weights-trainable",
        "G9",
        "under LoRA the trunk's base weights stay trainable and go to the optimizer",
        "lm_human_preference_details/lora.py",
        '    policy.__dict__["peft_model"] = peft_model',
        '    policy.__dict__["peft_model"] = peft_model.requires_grad_(True)',
        [
            "tests/test_lora.py::test_reference_is_exactly_the_base_model_at_init_and_after_an_update",
            "tests/test_lora.py::test_lora_run_trains_adapters_and_value_head_only_from_the_exact_reference",
        ],
    ),
    Breakage(
        "G8-lora-value-head-frozen",
        "G8",
        "under LoRA the value head is frozen with the trunk",
        "lm_human_preference_details/lora.py",
        '    policy.__dict__["peft_model"] = peft_model',
        '    policy.value_head.requires_grad_(False)\n    policy.__dict__["peft_model"] = peft_model',
        ["tests/test_lora.py::test_reference_is_exactly_the_base_model_at_init_and_after_an_update"],
    ),
    Breakage(
        "P20-lora-merged-save-not-merged",
        "P20",
        "the LoRA policy's merged model is the base model: the adapters are dropped instead of merged",
        "lm_human_preference_details/lora.py",
        "return copy.deepcopy(peft_model_of(policy)).merge_and_unload()",
        "return copy.deepcopy(peft_model_of(policy)).unload()",
        ["tests/test_lora.py::test_lora_policy_saves_adapters_and_a_merged_model_for_plain_transformers"],
    ),
    Breakage(
        "G7-lora-dropout-when-sampling",
        "G7",
        "--lora.dropout also drops in sampling and scoring, not only in the PPO loss's forward",
        "lm_human_preference_details/lora.py",
        "return F.dropout(x, self.p, training=torch.is_grad_enabled())",
        "return F.dropout(x, self.p, training=True)",
        ["tests/test_lora.py::test_lora_dropout_acts_only_in_forwards_that_record_gradients"],
    ),
    Breakage(
        "D6-lora-adapters-not-broadcast",
        "D6",
        "the adapters are added after rank 0's weights are broadcast: each process starts from its own random A",
        TP,
        "        lora.apply_lora(policy, args.lora, args.base_model)\n    # every process starts from rank 0's weights "
        "(spec D6); DDP and FSDP2 then skip a broadcast of their own\n    # https://github.com/openai/"
        "lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py"
        "#L482-L485\n    distributed.broadcast_parameters(policy, accelerator)",
        "        pass\n    distributed.broadcast_parameters(policy, accelerator)\n"
        "    if args.lora.rank:\n        lora.apply_lora(policy, args.lora, args.base_model)",
        ["tests/test_lora.py::test_two_processes_keep_identical_adapters"],
    ),
    Breakage(
        "R8-neox-reward-not-a-classifier",
        "R8",
        "a GPT-NeoX reward model is saved as trunk and head, not as a standard GPTNeoXForSequenceClassification",
        MOD,
        'CLASSIFIER_EXPORT = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm"}',
        'CLASSIFIER_EXPORT = {"gpt2": "ln_f"}',
        ["tests/test_artifacts.py::test_reward_model_loads_with_standard_classifier_and_gives_project_scores"],
    ),
    Breakage(
        "R8-classifier-constant-dropped",
        "R8",
        "the exported classifier drops the reward's constant term (gain * head bias + bias) instead of folding it",
        MOD,
        "state[norm_bias] = state[norm_bias] + constant * weight[0] / squared_norm",
        "state[norm_bias] = state[norm_bias]",
        ["tests/test_artifacts.py::test_reward_model_loads_with_standard_classifier_and_gives_project_scores"],
    ),
    Breakage(
        "R8-llama-classifier-without-norm-bias",
        "R8",
        "Llama reward models are exported as classifiers although their RMSNorm has no bias to hold the constant",
        MOD,
        'CLASSIFIER_EXPORT = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm"}',
        'CLASSIFIER_EXPORT = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm", "llama": "norm"}',
        ["tests/test_artifacts.py::test_reward_model_without_classifier_export_fails_standard_loader_loudly"],
    ),
    Breakage(
        "P20-policy-saved-without-generation-tokenizer",
        "P20",
        "the policy is saved with the project's tokenizer (PAD outside the embedding, right padding) for plain use",
        MOD,
        "tokenizer = generation_tokenizer(tokenizer, self.lm.get_input_embeddings().num_embeddings)",
        "tokenizer = tokenizer",
        ["tests/test_artifacts.py::test_saved_policy_generates_padded_batches_with_plain_transformers"],
    ),
    Breakage(
        "P20-policy-generation-config-without-pad",
        "P20",
        "the saved policy's generation_config does not name the generation tokenizer's PAD",
        MOD,
        "self.lm.generation_config.pad_token_id = tokenizer.pad_token_id",
        "self.lm.generation_config.pad_token_id = self.lm.generation_config.pad_token_id",
        ["tests/test_artifacts.py::test_saved_policy_generates_padded_batches_with_plain_transformers"],
    ),
    # ---------------------------------------------------------------- base models other than GPT-2: BOS, truncation
    Breakage(
        "G1-bos-missing-in-reward-inputs",
        "G1",
        "the reward model's inputs lack the BOS that its tokenizer adds (Llama): query ⊕ response without it",
        MOD,
        "tokens = with_bos(query_responses, self.bos_token_id)",
        "tokens = query_responses",
        ["tests/test_architectures.py::test_reward_model_puts_one_bos_in_front"],
    ),
    Breakage(
        "G1-bos-twice-in-contexts",
        "G1",
        "the policy's contexts get the tokenizer's BOS twice",
        "lm_human_preference_details/tasks.py",
        "return ([bos] if bos is not None else []) + list(prefix), list(suffix)",
        "return ([bos, bos] if bos is not None else []) + list(prefix), list(suffix)",
        ["tests/test_architectures.py::test_policy_contexts_start_with_exactly_one_bos"],
    ),
    Breakage(
        "G1-bos-not-saved",
        "G1",
        "reward_model.json does not record the BOS, so a loaded reward model scores without it",
        MOD,
        '"bos_token_id": self.bos_token_id,',
        '"bos_token_id": None,',
        ["tests/test_architectures.py::test_reward_model_puts_one_bos_in_front"],
    ),
    Breakage(
        "G2-architecture-check-bypassed",
        "G2",
        "a model of an untested architecture loads (its attention may not take the pads-invisible mask)",
        MOD,
        "if model_type not in SUPPORTED_MODEL_TYPES:",
        "if False:",
        ["tests/test_architectures.py::test_unsupported_architecture_is_refused_in_one_line"],
    ),
    Breakage(
        "P2-truncate-text-gpt2-ids",
        "P2",
        "the truncation text resolves to GPT-2's ids (13, 198) whatever the tokenizer",
        "lm_human_preference_details/tasks.py",
        'token = text_to_token(tokenizer, task.truncate_text, "--task.truncate_text")',
        'token = {".": 13, "\\n": 198}.get(task.truncate_text)',
        ["tests/test_tasks.py::test_preset_truncation_text_resolves_to_each_tokenizers_own_id"],
    ),
    Breakage(
        "P2-truncate-conflict-ignored",
        "P2",
        "an explicit --task.truncate_token that names another token than --task.truncate_text is silently replaced",
        "lm_human_preference_details/tasks.py",
        "if task.truncate_token is not None and task.truncate_token != token:",
        "if False:",
        ["tests/test_tasks.py::test_truncation_text_of_several_tokens_or_naming_another_token_is_refused"],
    ),
    Breakage(
        "P2-truncate-flag-keeps-preset-text",
        "P2",
        "--task.truncate_token alone keeps the preset's truncation text (so None no longer turns the filter off)",
        "lm_human_preference_details/cli.py",
        "    rest = explicit_truncation_flag(rest)\n    description",
        "    description",
        ["tests/test_architectures.py::test_one_truncation_flag_unsets_the_others_preset_value"],
    ),
    Breakage(
        "P2-truncate-task-check-by-text",
        "P2",
        "the reward model's task check compares the truncation text too, so tasks saved before it never match",
        "lm_human_preference_details/tasks.py",
        '    skipped = {"truncate_text"}\n',
        "    skipped = set()\n",
        ["tests/test_tasks.py::test_task_check_compares_the_resolved_truncation_id"],
    ),
    Breakage(
        "G1-bos-not-given-to-reward-training",
        "G1",
        "train_reward.py builds the reward model without its tokenizer's BOS",
        TR,
        "RewardModel.from_base(args.base_model, bos_token_id=added_bos_id(tokenizer))",
        "RewardModel.from_base(args.base_model, bos_token_id=None)",
        ["tests/test_architectures.py::test_train_reward_on_llama_records_its_bos_and_truncation_id"],
    ),
    Breakage(
        "P2-truncate-text-not-resolved",
        "P2",
        "train_reward.py saves the task without resolving its truncation text to the tokenizer's id",
        TR,
        "args = dataclasses.replace(args, task=resolve_truncation(args.task, tokenizer))",
        "args = args",
        ["tests/test_architectures.py::test_train_reward_on_llama_records_its_bos_and_truncation_id"],
    ),
    Breakage(
        "P2-truncate-old-label-meta-refused",
        "P2",
        "label_generation.py generate refuses to resume a file whose task predates --task.truncate_text",
        "label_generation.py",
        'del different["task"]  # the same task',
        'different["task"] = different["task"]  # the same task',
        ["tests/test_label_generation.py::test_generate_refuses_to_resume_with_other_settings"],
    ),
    Breakage(
        "P2-unresolved-truncation-evaluated",
        "P2",
        "evaluation.sample_and_score filters with an unresolved preset task (no truncation id: no filter)",
        "lm_human_preference_details/evaluation.py",
        "    check_truncation_resolved(task)\n    pad_id = tokenizer.pad_token_id",
        "    pad_id = tokenizer.pad_token_id",
        [
            "tests/test_tasks.py::test_a_preset_whose_truncation_text_was_not_resolved_is_refused_where_the_filter_applies"
        ],
    ),
    Breakage(
        "P2-unresolved-truncation-normalized",
        "P2",
        "a programmatic reward is normalized with an unresolved preset task (no truncation)",
        "lm_human_preference_details/rewards.py",
        "    check_truncation_resolved(task)\n    generator = torch.Generator(",
        "    generator = torch.Generator(",
        [
            "tests/test_tasks.py::test_a_preset_whose_truncation_text_was_not_resolved_is_refused_where_the_filter_applies"
        ],
    ),
    Breakage(
        "P2-unresolved-truncation-labeled",
        "P2",
        "label generation samples with an unresolved preset task (no truncation, no filter)",
        "label_generation.py",
        "    check_truncation_resolved(task)\n    batch_size, n, length",
        "    batch_size, n, length",
        [
            "tests/test_tasks.py::test_a_preset_whose_truncation_text_was_not_resolved_is_refused_where_the_filter_applies"
        ],
    ),
    # ---------------------------------------------------------------- every setting and statistic told apart
    # flags sharing a default swapped, rarely taken branches, logged statistics' formulas (docs/testing.md)
    Breakage(
        "P4-last-token-kl-dropped",
        "P4",
        "the score replaces the last token's KL penalty instead of adding to it",
        TP,
        "rewards[torch.arange(rewards.shape[0], device=rewards.device), score_index] += scores",
        "rewards[torch.arange(rewards.shape[0], device=rewards.device), score_index] = scores",
        ["tests/test_train_policy.py::test_compute_rewards_matches_tv5"],
    ),
    Breakage(
        "P6-gamma-dropped-from-trace",
        "P6",
        "GAE's trace decays by lam alone instead of gamma * lam",
        TP,
        "lastgaelam = delta + gamma * lam * lastgaelam",
        "lastgaelam = delta + lam * lastgaelam",
        ["tests/test_train_policy.py::test_compute_advantages_matches_discounted_loop_per_row"],
    ),
    Breakage(
        "P6-gamma-dropped-from-delta",
        "P6",
        "GAE's TD error bootstraps without gamma",
        TP,
        "delta = rewards[:, t] + gamma * nextvalues - values[:, t]",
        "delta = rewards[:, t] + nextvalues - values[:, t]",
        ["tests/test_train_policy.py::test_compute_advantages_matches_discounted_loop_per_row"],
    ),
    Breakage(
        "P8-value-clip-uses-cliprange",
        "P8",
        "the value prediction is clipped by cliprange instead of cliprange_value",
        TP,
        "torch.clamp(vpred, values - cliprange_value, values + cliprange_value)",
        "torch.clamp(vpred, values - cliprange, values + cliprange)",
        [PPO_STATS],
    ),
    Breakage(
        "P9-ratio-clip-uses-cliprange-value",
        "P9",
        "the ratio is clipped by cliprange_value instead of cliprange",
        TP,
        "torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)",
        "torch.clamp(ratio, 1.0 - cliprange_value, 1.0 + cliprange_value)",
        [PPO_STATS],
    ),
    Breakage(
        "P14-clip-lower-bound",
        "P14",
        "the controller clips a KL below target to -0.1 (only the upper bound stays 0.2)",
        TP,
        "np.clip(current / self.target - 1, -0.2, 0.2)",
        "np.clip(current / self.target - 1, -0.1, 0.2)",
        ["tests/test_train_policy.py::test_adaptive_kl_controller_matches_tv7"],
    ),
    Breakage(
        "P14-horizon-ignores-n-steps",
        "P14",
        "the controller's step ignores the update's episodes (n_steps)",
        TP,
        "self.value *= 1 + proportional_error * n_steps / self.horizon",
        "self.value *= 1 + proportional_error / self.horizon",
        ["tests/test_train_policy.py::test_adaptive_kl_controller_matches_tv7"],
    ),
    Breakage(
        "P2-truncate-after-strict",
        "P2",
        "truncation matches the token only after index truncate_after, not at it",
        "lm_human_preference_details/tasks.py",
        "matches = (responses == truncate_token) & (positions >= truncate_after)",
        "matches = (responses == truncate_token) & (positions > truncate_after)",
        ["tests/test_tasks.py::test_truncate_response_pads_after_first_qualifying_token"],
    ),
    Breakage(
        "G3-start-token-last",
        "G3",
        "a text whose start token is its last token becomes an empty query instead of keeping all",
        "lm_human_preference_details/tasks.py",
        "if first < len(tokens):",
        "if first <= len(tokens):",
        ["tests/test_tasks.py::test_build_query_oai_steps"],
    ),
    Breakage(
        "G5-searchsorted-left",
        "G5",
        "inverse-CDF sampling picks the first index whose CDF reaches the target (a probability-0 token can be drawn)",
        "lm_human_preference_details/kernels.py",
        "torch.searchsorted(cdf, target, right=True)",
        "torch.searchsorted(cdf, target, right=False)",
        ["tests/test_kernels.py::test_inverse_cdf_sampler_never_draws_a_token_whose_probability_underflows_to_zero"],
    ),
    Breakage(
        "G5-uniform-cap-dropped",
        "G5",
        "inverse-CDF sampling's target is not kept below the CDF's total",
        "lm_human_preference_details/kernels.py",
        "target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))",
        "target = uniform * total",
        ["tests/test_kernels.py::test_inverse_cdf_sampler_never_draws_a_token_whose_probability_underflows_to_zero"],
    ),
    Breakage(
        "P11-entropy-last-chunk-only",
        "P11",
        "the entropy keeps only the last vocabulary chunk's sum",
        "lm_human_preference_details/kernels.py",
        "shifted_sum += products.sum(dim=-1, keepdim=True)",
        "shifted_sum = products.sum(dim=-1, keepdim=True)",
        [
            "tests/test_kernels.py::test_fused_entropy_on_full_vocabulary_float32_logits_is_as_accurate_as_the_plain_formula"
        ],
    ),
    Breakage(
        "P7-logprob-grad-overwrites",
        "P7",
        "the log-prob's backward overwrites the token's gradient instead of adding it",
        "lm_human_preference_details/kernels.py",
        "scatter_add_(-1, tokens.unsqueeze(-1), grad)",
        "scatter_(-1, tokens.unsqueeze(-1), grad)",
        ["tests/test_kernels.py::test_fused_logprobs_and_entropy_equal_the_plain_formulas_in_values_and_gradients"],
    ),
    Breakage(
        "O3-eps-inside-sqrt",
        "O3",
        "TF-style Adam adds eps under the square root",
        "lm_human_preference_details/optim.py",
        "denoms = torch._foreach_sqrt(exp_avg_sqs)\n    torch._foreach_add_(denoms, eps)",
        "denoms = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, eps))",
        ["tests/test_optim.py::test_adam_tf_style_matches_closed_form_float64"],
    ),
    Breakage(
        "O5-annealed-lr-ignored",
        "O5",
        "TF-style Adam steps with its initial lr, ignoring the annealed lr of its param group",
        "lm_human_preference_details/optim.py",
        'step_sizes.append(-group["lr"] * math.sqrt',
        'step_sizes.append(-self.defaults["lr"] * math.sqrt',
        ["tests/test_optim.py::test_adam_tf_style_lr_change_between_steps_takes_effect"],
    ),
    Breakage(
        "O5-reward-lr-by-step",
        "O5",
        "the reward lr anneals by step index over num_train instead of labels done",
        TR,
        "lr = args.lr * (1 - start / args.labels.num_train)",
        "lr = args.lr * (1 - step / args.labels.num_train)",
        [REWARD_STATS],
    ),
    Breakage(
        "R7-compare-difference-sign",
        "R7",
        "scalar_compare's loss compares the difference with r0 - r1",
        "train_reward.py",
        "else rewards[:, 1] - rewards[:, 0]",
        "else rewards[:, 0] - rewards[:, 1]",
        ["tests/test_train_reward.py::test_scalar_compare_loss_is_mse_of_the_reward_difference"],
    ),
    Breakage(
        "R4-compare-target-not-halved",
        "R4",
        "scalar_compare's normalization target is the differences' scale, not half of it",
        "lm_human_preference_details/labels.py",
        "return labels.label / 2",
        "return labels.label",
        ["tests/test_train_reward.py::test_normalization_targets_follow_the_label_type"],
    ),
    Breakage(
        "R4-target-unbiased-std",
        "R4",
        "the normalization target's std is the labels' unbiased std",
        TR,
        "var, mean = torch.var_mean(scales.double(), correction=0)",
        "var, mean = torch.var_mean(scales.double(), correction=1)",
        ["tests/test_train_reward.py::test_normalization_targets_follow_the_label_type"],
    ),
    Breakage(
        "R4-debug-normalize-count",
        "R4",
        "--debug_normalize re-measures on normalize_samples instead of its own count",
        TR,
        "reward_moments(*sampling, args.debug_normalize)",
        "reward_moments(*sampling, args.normalize_samples)",
        [REWARD_STATS],
    ),
    Breakage(
        "metrics-val-error-clipped",
        "§4.1",
        "ppo/val/error is the clipped squared error",
        TP,
        '"val/error": vf_losses1.mean(),',
        '"val/error": vf_losses2.mean(),',
        [PPO_LOSSES, PPO_STATS],
    ),
    Breakage(
        "metrics-val-clipfrac-ties",
        "§4.1",
        "ppo/val/clipfrac counts ties (unclipped tokens) as clipped",
        TP,
        "vf_clipfrac = value_mean((vf_losses2 > vf_losses1).float())",
        "vf_clipfrac = value_mean((vf_losses2 >= vf_losses1).float())",
        [PPO_LOSSES, PPO_STATS],
    ),
    Breakage(
        "metrics-pg-clipfrac-ties",
        "§4.1",
        "ppo/policy/clipfrac counts ties (unclipped tokens) as clipped",
        TP,
        "pg_clipfrac = policy_mean((pg_losses2 > pg_losses).float())",
        "pg_clipfrac = policy_mean((pg_losses2 >= pg_losses).float())",
        [PPO_LOSSES, PPO_STATS],
    ),
    Breakage(
        "metrics-vpred-is-rollout-value",
        "§4.1",
        "ppo/val/vpred is the mean rollout value instead of the new prediction",
        TP,
        '"val/vpred": vpred.mean(),',
        '"val/vpred": values.mean(),',
        [PPO_LOSSES, PPO_STATS],
    ),
    Breakage(
        "metrics-moments-ignore-virtual-ranks",
        "§4.1",
        "ppo/returns/var is the variance over all rows, not the mean of each virtual rank's",
        TP,
        "var_returns, mean_returns = torch.var_mean(returns.reshape(groups, -1), dim=1, correction=0)",
        "var_returns, mean_returns = torch.var_mean(returns.reshape(1, -1), dim=1, correction=0)",
        [PPO_STATS],
    ),
    Breakage(
        "metrics-val-var-of-returns",
        "§4.1",
        "ppo/val/var logs the returns' variance",
        TP,
        '"val/var": var_values.mean(),',
        '"val/var": var_returns.mean(),',
        [PPO_STATS],
    ),
    Breakage(
        "metrics-val-mean-of-returns",
        "§4.1",
        "ppo/val/mean logs the returns' mean",
        TP,
        '"val/mean": mean_values.mean(),',
        '"val/mean": mean_returns.mean(),',
        [PPO_STATS],
    ),
    Breakage(
        "metrics-micro-share-ignored",
        "§4.1",
        "with gradient accumulation the PPO statistics sum the micro-batches instead of averaging them",
        TP,
        "self.weight * share)",
        "self.weight)",
        [PPO_STATS],
    ),
    Breakage(
        "metrics-first-ratio-every-epoch",
        "§4.1",
        "debug/first_minibatch_ratio_max_abs_dev takes the first minibatch of every epoch",
        TP,
        "first=epoch == 0 and k == 0",
        "first=k == 0",
        [PPO_STATS],
    ),
    Breakage(
        "metrics-ratio-min-is-mean",
        "§4.1",
        "debug/ratio_min tracks the minimum of micro-batch means",
        TP,
        "self.ratio_min = torch.minimum(self.ratio_min, ratio.min())",
        "self.ratio_min = torch.minimum(self.ratio_min, ratio.mean())",
        [PPO_STATS],
    ),
    Breakage(
        "metrics-entropy-of-reference",
        "§4.1",
        "objective/entropy sums the reference policy's log-probs",
        TP,
        '"objective/entropy": (-logprobs).sum(1).mean(),',
        '"objective/entropy": (-ref_logprobs).sum(1).mean(),',
        [METRICS],
    ),
    Breakage(
        "metrics-elapsed-episodes-from-zero",
        "§4.1",
        "elapsed/episodes counts from update instead of update + 1",
        TP,
        'stats["elapsed/episodes"] = steps * batch',
        'stats["elapsed/episodes"] = update * batch',
        ["tests/test_train_policy.py::test_main_logs_exactly_oai_metric_names"],
    ),
    Breakage(
        "metrics-num-eos-truncated",
        "§4.1",
        "debug/num_eos counts EOS in the truncated responses",
        TP,
        '"debug/num_eos": (responses == tokenizer.eos_token_id)',
        '"debug/num_eos": (postprocessed_responses == tokenizer.eos_token_id)',
        ["tests/test_train_policy.py::test_main_logs_eos_count_and_filter_pass_rate_of_the_raw_responses"],
    ),
    Breakage(
        "reward-metrics-label-var-unbiased",
        "§4.2",
        "train_reward/minibatch/label_var is the unbiased variance",
        "train_reward.py",
        "label_var, label_mean = torch.var_mean(label, correction=0)",
        "label_var, label_mean = torch.var_mean(label, correction=1)",
        ["tests/test_train_reward.py::test_scalar_rating_loss_and_statistics_match_numpy"],
    ),
    Breakage(
        "reward-metrics-corr-formula",
        "§4.2",
        "train_reward/minibatch/corr divides by sqrt(var_x) * var_y",
        "lm_human_preference_details/labels.py",
        "return ((x - x_mean) * (y - y_mean)).mean() / torch.sqrt(x_var * y_var)",
        "return ((x - x_mean) * (y - y_mean)).mean() / (torch.sqrt(x_var) * y_var)",
        ["tests/test_train_reward.py::test_scalar_rating_loss_and_statistics_match_numpy"],
    ),
    Breakage(
        "reward-metrics-accuracy-argmin",
        "§4.2",
        "debug/accuracy counts the lowest-rewarded sample",
        TR,
        'local_stats["debug/accuracy"] = (step_rewards.argmax(1) == label)',
        'local_stats["debug/accuracy"] = (step_rewards.argmin(1) == label)',
        [REWARD_STATS],
    ),
    Breakage(
        "RS1-bias-not-scaled",
        "RS1",
        "a programmatic reward's normalization bias is -mean instead of -mean / std",
        "lm_human_preference_details/rewards.py",
        '"bias": -mean / std',
        '"bias": -mean',
        [NORMALIZED_REWARD],
    ),
    Breakage(
        "RS1-affine-order",
        "RS1",
        "a programmatic reward is gain * (score + bias) instead of gain * score + bias",
        "lm_human_preference_details/rewards.py",
        "return self.gain * self.raw(queries, responses) + self.bias",
        "return self.gain * (self.raw(queries, responses) + self.bias)",
        [NORMALIZED_REWARD],
    ),
    Breakage(
        "RS1-normalization-untruncated",
        "RS1",
        "a programmatic reward is normalized on untruncated responses",
        "lm_human_preference_details/rewards.py",
        "scores.append(reward.raw(queries, truncated).float())",
        "scores.append(reward.raw(queries, responses).float())",
        [NORMALIZED_REWARD],
    ),
    Breakage(
        "metrics-fps-per-episode",
        "§4.1",
        "elapsed/fps counts episodes per second instead of tokens",
        TP,
        'stats["elapsed/fps"] = int(batch * length / (now - last_time))',
        'stats["elapsed/fps"] = int(batch / (now - last_time))',
        [TP_TESTS + "test_elapsed_statistics_follow_their_formulas"],
    ),
    Breakage(
        "metrics-time-since-last-update",
        "§4.1",
        "elapsed/time is the time since the previous update instead of since the start",
        TP,
        'stats["elapsed/time"] = now - start_time',
        'stats["elapsed/time"] = now - last_time',
        [TP_TESTS + "test_elapsed_statistics_follow_their_formulas"],
    ),
    Breakage(
        "R4-after-targets-label-scale",
        "R4",
        "normalize_after targets the labels' scale (as normalize_before does) instead of mean 0 and std 1",
        TR,
        'norms["after"] = normalize("after", sizes.steps, (0.0, 1.0))',
        'norms["after"] = normalize("after", sizes.steps, normalization_target(label_type, train_labels))',
        ["tests/test_train_reward.py::test_scalar_labels_normalize_after_training_to_mean_zero_std_one"],
    ),
    # ---------------------------------------------------------------- N8: --weight_decay, torch AdamW (nplus N8)
    Breakage(
        "N8-weight-decay-coupled",
        "N8",
        "--weight_decay is an L2 term added to the gradient (torch.optim.Adam) instead of AdamW's decoupled decay",
        "lm_human_preference_details/optim.py",
        "return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=fused or None)",
        "return torch.optim.Adam(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=fused or None)",
        ["tests/test_optim.py::test_make_optimizer_weight_decay_is_adamw_decoupled_decay_with_eps_1e5"],
    ),
    Breakage(
        "N8-weight-decay-with-tf-adam-ignored",
        "N8",
        "a --weight_decay with OAI's TF1 Adam is accepted (and the run trains with AdamW) instead of stopping",
        "lm_human_preference_details/optim.py",
        "if weight_decay and use_tensorflow_adam:",
        "if weight_decay and use_tensorflow_adam and not weight_decay:",
        ["tests/test_optim.py::test_weight_decay_with_tensorflow_adam_stops_in_one_line_naming_both_flags"],
    ),
    Breakage(
        "N8-policy-drops-weight-decay",
        "N8",
        "train_policy.py builds its optimizer without --weight_decay (torch Adam, no decay)",
        TP,
        "        args.weight_decay,\n        args.eps,\n        fused=args.run.fused_adam,",
        "        0.0,\n        args.eps,\n        fused=args.run.fused_adam,",
        ["tests/test_optim.py::test_train_policy_weight_decay_gives_adamw_over_the_trained_parameters"],
    ),
    Breakage(
        "N8-reward-drops-weight-decay",
        "N8",
        "train_reward.py builds its optimizer without --weight_decay (torch Adam, no decay)",
        TR,
        "make_optimizer(params, args.lr, args.use_tensorflow_adam, args.weight_decay, fused=args.run.fused_adam)",
        "make_optimizer(params, args.lr, args.use_tensorflow_adam, fused=args.run.fused_adam)",
        ["tests/test_optim.py::test_train_reward_weight_decay_gives_adamw"],
    ),
    Breakage(
        "N8-zero-weight-decay-is-adamw",
        "N8",
        "weight decay 0 builds torch AdamW for the ablation instead of today's torch.optim.Adam (another state dict)",
        "lm_human_preference_details/optim.py",
        "    if weight_decay:\n        # p <- p * (1 - lr * weight_decay)",
        "    if not use_tensorflow_adam:\n        # p <- p * (1 - lr * weight_decay)",
        [
            "tests/test_optim.py::test_make_optimizer_without_weight_decay_keeps_oais_and_the_ablations_optimizer",
        ],
    ),
    # ---------------------------------------------------------------- nplus: a reward model with its own tokenizer
    Breakage(
        "N28-seqcls-left-padded",
        "N28",
        "a sequence_classifier: reward left-pads its rows (as its tokenizer asks), so a shorter row's tokens sit at "
        "other positions than when it is scored alone",
        "lm_human_preference_details/labelers.py",
        'padding_side="right",',
        'padding_side="left",',
        ["tests/test_external_reward.py::test_scores_are_a_plain_transformers_call_on_prompt_and_response_text"],
    ),
    Breakage(
        "N28-seqcls-pad-not-skipped",
        "N28",
        "a sequence_classifier: reward pads with its tokenizer's PAD, not the config's pad_token_id that the "
        "classifier skips when it picks the token to read its score at",
        "lm_human_preference_details/labelers.py",
        "    tokenizer.pad_token = token\n",
        "",
        ["tests/test_external_reward.py::test_rows_are_padded_with_the_id_the_classifier_skips_to_read_its_score"],
    ),
    Breakage(
        "N28-seqcls-no-chat-template",
        "N28",
        "a sequence_classifier: reward ignores its tokenizer's chat template (plain prompt + response text)",
        "lm_human_preference_details/labelers.py",
        "self.chat = self.classifier_tokenizer.chat_template is not None",
        "self.chat = False",
        ["tests/test_external_reward.py::test_scores_are_a_plain_transformers_call_on_prompt_and_response_text"],
    ),
    Breakage(
        "N19-seqcls-past-eos",
        "N19",
        "a sequence_classifier: reward decodes the response past its first EOS",
        "lm_human_preference_details/labelers.py",
        "keep = keep & ((rows == self.eos_id).cumsum(-1) == 0)",
        "keep = keep",
        ["tests/test_external_reward.py::test_response_ends_at_its_first_eos_and_special_tokens_are_skipped"],
    ),
    Breakage(
        "N28-seqcls-prompt-not-cut",
        "N28",
        "a sequence_classifier: reward scores a row longer than the classifier's max length uncut",
        "lm_human_preference_details/labelers.py",
        "rows = self.fit(self.encode(prompts, texts), prompts, texts)",
        "rows = self.encode(prompts, texts)",
        [
            "tests/test_external_reward.py::test_a_row_longer_than_the_classifier_takes_is_cut_from_the_left_of_its_prompt"
        ],
    ),
    # ---------------------------------------------------------------- N: the successor recipe (docs/nplus-details.md)
    Breakage(
        "N3-sft-eos-not-appended",
        "N3",
        "SFT completions end without EOS, so the policy never learns to stop",
        "lm_human_preference_details/nplus/sft_data.py",
        "ids[i] = row_ids + [tokenizer.eos_token_id] if row_ids[-1:] != [tokenizer.eos_token_id] else row_ids",
        "ids[i] = row_ids",
        ["tests/test_train_sft.py::test_eos_is_appended_and_pads_are_distinct_and_never_targets"],
    ),
    Breakage(
        "N3-chat-rows-end-with-two-eos",
        "N3",
        "a chat row whose template ends its turn with the EOS keeps the newline after it and gets a second EOS",
        "lm_human_preference_details/conversations.py",
        "return stripped if eos and stripped.endswith(eos) else completion",
        "return completion",
        [
            "tests/test_train_sft.py::test_every_trl_sft_format_reads_as_pairs_rendered_like_the_policys_queries"
            "[conversational language modeling-jsonl]"
        ],
    ),
    Breakage(
        "N3-chat-responses-end-with-two-eos",
        "N3",
        "a conversational preference response keeps the newline after its turn-ending EOS and gets a second EOS",
        "lm_human_preference_details/conversations.py",
        "return tokens[: last + 1] if not tokenizer.decode(after).strip() else tokens",
        "return tokens",
        [
            "tests/test_text_prefs.py::test_every_trl_preference_format_reads_as_best_of_2_labels_rendered_like_the_"
            "policys_queries[conversational]"
        ],
    ),
    Breakage(
        "N5-sft-prompt-not-stripped",
        "N5",
        "the SFT text is prompt + completion instead of prompt.strip() + completion",
        "lm_human_preference_details/nplus/sft_data.py",
        "prompts = [p if chat else p.strip() for p, chat in zip(pairs.prompts, pairs.chat)]",
        "prompts = list(pairs.prompts)",
        ["tests/test_train_sft.py::test_eos_is_appended_and_pads_are_distinct_and_never_targets"],
    ),
    Breakage(
        "N10-sft-pad-counted",
        "N10",
        "the SFT loss counts PAD positions as targets",
        "train_sft.py",
        "loss_mask = (rows.tokens != pad_id) & (positions",
        "loss_mask = (rows.tokens == rows.tokens) & (positions",
        ["tests/test_train_sft.py::test_eos_is_appended_and_pads_are_distinct_and_never_targets"],
    ),
    Breakage(
        "N10-sft-prompt-counted-under-completion",
        "N10",
        "--loss_on completion still counts the prompt's tokens",
        "train_sft.py",
        'first_counted = [p if loss_on == "completion" else 1 for p in pairs.prompt_tokens]',
        "first_counted = [1 for p in pairs.prompt_tokens]",
        ["tests/test_train_sft.py::test_loss_is_the_plain_cross_entropy_over_exactly_the_counted_tokens"],
    ),
    Breakage(
        "N10-sft-mean-per-micro-batch",
        "N10",
        "the SFT loss is each micro-batch's token mean, so the update depends on --gradient_accumulation_steps",
        "train_sft.py",
        "(micro_sum * (world / counted)).backward()",
        "(micro_sum / micro_mask.sum() / accum).backward()",
        ["tests/test_train_sft.py::test_loss_and_update_do_not_depend_on_gradient_accumulation"],
    ),
    Breakage(
        "N8-sft-lr-not-cosine",
        "N8",
        "the SFT lr decays linearly instead of on transformers' cosine",
        "train_sft.py",
        "return max(0.0, 0.5 * (1.0 + math.cos(math.pi * step / max(1, steps))))",
        "return max(0.0, 1.0 - step / max(1, steps))",
        ["tests/test_train_sft.py::test_lr_follows_transformers_cosine_schedule_without_warm_up"],
    ),
    Breakage(
        "N8-sft-lr-constant",
        "N8",
        "train_sft.py keeps the lr constant instead of annealing it",
        "train_sft.py",
        "lr = args.lr * cosine_factor(step, sizes.steps)",
        "lr = args.lr",
        ["tests/test_train_sft.py::test_run_learns_saves_a_base_model_and_logs_the_cosine_lr"],
    ),
    Breakage(
        "N9-sft-order-not-random-samplers",
        "N9",
        "the SFT data order is a permutation of the seed itself, not the one SFD's seeded DataLoader draws",
        "train_sft.py",
        "return torch.randperm(num_rows, generator=torch.Generator().manual_seed(int(seed_draw)))",
        "return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))",
        ["tests/test_train_sft.py::test_data_order_is_torch_random_samplers_after_seeding"],
    ),
    # ---------------------------------------------------------------- nplus: the successor recipe
    Breakage(
        "N16-critic-values-one-position-off",
        "N16",
        "the critic reads the positions one token later than those that predict each response token",
        "lm_human_preference_details/nplus/critic.py",
        "tokens = with_bos(query_responses[:, :-1], self.bos_token_id)",
        "tokens = with_bos(query_responses[:, 1:], self.bos_token_id)",
        ["tests/test_nplus_critic.py::test_critic_value_t_is_the_reward_score_of_the_prefix_before_token_t"],
    ),
    Breakage(
        "N16-critic-reward-bias-dropped",
        "N16",
        "the critic from a reward model keeps its gain but drops its bias: values do not start at the normalized score",
        "lm_human_preference_details/nplus/critic.py",
        "critic.head.bias.copy_(reward_model.gain * reward_model.head.bias + reward_model.bias)",
        "critic.head.bias.copy_(reward_model.gain * reward_model.head.bias)",
        ["tests/test_nplus_critic.py::test_critic_value_t_is_the_reward_score_of_the_prefix_before_token_t"],
    ),
    Breakage(
        "N16-rollout-values-from-policy-head",
        "N16",
        "the rollout's values are the sampler's (the policy's value head) instead of the critic's",
        TP,
        "if models.critic is not None and not args.run.bf16:",
        "if models.critic is None and not args.run.bf16:",
        ["tests/test_nplus_critic.py::test_rollout_values_come_from_the_critic_not_the_sampler"],
    ),
    Breakage(
        "N16-critic-not-in-optimizer",
        "N16",
        "the optimizer holds the policy only: the critic never trains",
        TP,
        "        params + critic_params,\n        ppo.lr,\n",
        "        params,\n        ppo.lr,\n",
        ["tests/test_nplus_critic.py::test_run_with_a_critic_from_the_reward_model_trains_it_and_saves_it"],
    ),
    Breakage(
        "N16-policy-value-head-left-trainable",
        "N16",
        "with a critic, the policy's unused value head stays trainable and gets optimizer state",
        "lm_human_preference_details/nplus/critic.py",
        "policy.value_head.requires_grad_(False)",
        "policy.value_head.requires_grad_(True)",
        ["tests/test_nplus_critic.py::test_one_optimizer_trains_the_critic_and_never_the_policys_value_head"],
    ),
    Breakage(
        "N16-critic-not-resumed",
        "N16",
        "--resume restores the policy and the optimizer but not the critic's weights",
        "lm_human_preference_details/ppo_plumbing.py",
        'self.critic.load_state_dict(resumed.shared["critic"])',
        "self.critic.load_state_dict(self.critic.state_dict())",
        ["tests/test_nplus_critic.py::test_critic_run_killed_after_a_checkpoint_resumes_exactly"],
    ),
    Breakage(
        "N16-value-head-bias-frozen-by-default",
        "N16",
        "the value head's bias never trains unless --ppo.no_value_head_bias asks for it (TRL's head without bias)",
        TP,
        "if not ppo.value_head_bias:",
        "if True:",
        ["tests/test_optim.py::test_train_policy_eps_and_value_head_bias_reach_the_optimizer"],
    ),
    Breakage(
        "N2-cut-at-first-newline",
        "N2",
        "a prompt too long is cut at its first newline instead of its last",
        "lm_human_preference_details/prompts.py",
        'i = text.rfind("\\n")',
        'i = text.find("\\n")',
        [
            "tests/test_prompts.py::test_cut_at_the_last_newline_matches_a_plain_reimplementation_of_nplus_n2",
            "tests/test_prompts.py::test_cut_keeps_whole_lines_and_drops_characters_only_without_a_newline",
        ],
    ),
    Breakage(
        "N2-cut-once",
        "N2",
        "a prompt too long is cut once, not again and again until it fits",
        "lm_human_preference_details/prompts.py",
        "        while len(tokens) > self.query_length:\n            value = prompt.cut_value()",
        "        if len(tokens) > self.query_length:\n            value = prompt.cut_value()",
        [
            "tests/test_prompts.py::test_cut_keeps_whole_lines_and_drops_characters_only_without_a_newline",
            "tests/test_prompts.py::test_cut_at_the_last_newline_matches_a_plain_reimplementation_of_nplus_n2",
        ],
    ),
    Breakage(
        "N2-drop-instead-of-cut",
        "N2",
        "a prompt too long is dropped (as TRL's example does) instead of cut",
        "lm_human_preference_details/prompts.py",
        "                fitted = self._fit(prompt, tokens)",
        "                fitted = None",
        ["tests/test_prompts.py::test_cut_at_the_last_newline_matches_a_plain_reimplementation_of_nplus_n2"],
    ),
    Breakage(
        "N2-chat-no-generation-prompt",
        "N2",
        "chats are rendered without the generation prompt (the assistant header the policy answers after)",
        "lm_human_preference_details/prompts.py",
        "            add_generation_prompt=True,",
        "            add_generation_prompt=False,",
        ["tests/test_prompts.py::test_chats_render_with_the_generation_prompt_and_one_bos"],
    ),
    Breakage(
        "N2-chat-double-bos",
        "N2",
        "the BOS a chat template writes stays in the query, in front of which the project puts its own",
        "lm_human_preference_details/prompts.py",
        "        return [tokens[1:] if tokens[:1] == [self.bos] else tokens for tokens in encoded]",
        "        return encoded",
        ["tests/test_prompts.py::test_chats_render_with_the_generation_prompt_and_one_bos"],
    ),
    Breakage(
        "N2-chat-text-as-control-tokens",
        "N2",
        "control-token text inside a message is encoded as control tokens",
        "lm_human_preference_details/prompts.py",
        "            sanitize_control_tokens=True,",
        "            sanitize_control_tokens=False,",
        ["tests/test_prompts.py::test_chats_render_with_the_generation_prompt_and_one_bos"],
    ),
    Breakage(
        "N5-query-padding-left",
        "N5",
        "prompt queries are left-padded with the PAD, which the project's forward reads as a first token",
        "lm_human_preference_details/prompts.py",
        "            queries.append(tokens + [self.pad_id] * (self.query_length - len(tokens)))",
        "            queries.append([self.pad_id] * (self.query_length - len(tokens)) + tokens)",
        ["tests/test_prompts.py::test_jsonl_prompts_become_right_padded_queries_of_their_plain_text"],
    ),
    Breakage(
        "N2-conversation-before-cut",
        "N2",
        "conversation_of gives the prompt as it was before the cut",
        "lm_human_preference_details/prompts.py",
        "                prompt, tokens = fitted",
        "                tokens = fitted[1]",
        ["tests/test_prompts.py::test_conversation_of_gives_the_messages_of_each_query"],
    ),
    Breakage(
        "N2-characters-shortest-prefix",
        "N2",
        "a prompt without a newline left keeps the shortest prefix tried, not the longest that fits",
        "lm_human_preference_details/prompts.py",
        "            low, high, best = (middle, high, found) if found is not None else (low, middle, best)",
        "            low, high, best = (middle, high, best) if found is not None else (low, middle, best)",
        ["tests/test_prompts.py::test_a_long_cut_without_newlines_drops_characters_as_nplus_n2_does"],
    ),
    Breakage(
        "N2-characters-bisected-only",
        "N2",
        "the character-dropping cut trusts bisection alone: a longer prefix that fits again within a word is missed",
        "lm_human_preference_details/prompts.py",
        "STEP_WINDOW = 64\n",
        "STEP_WINDOW = 0\n",
        ["tests/test_prompts.py::test_cut_at_the_last_newline_matches_a_plain_reimplementation_of_nplus_n2"],
    ),
    Breakage(
        "N2-conversations-of-a-copy-lost",
        "N2",
        "a deep copy of the query stream (the reward's normalization) keeps its prompts' messages to itself",
        "lm_human_preference_details/prompts.py",
        '    def __deepcopy__(self, memo: dict) -> "_SharedConversations":\n        return self\n',
        "    pass\n",
        ["tests/test_prompts.py::test_conversation_of_gives_the_messages_of_each_query"],
    ),
    # ---------------------------------------------------------------- the successor recipe (docs/nplus-details.md)
    Breakage(
        "N19-truncation-drops-eos",
        "N19",
        "truncation at EOS also pads the EOS itself",
        "lm_human_preference_details/tasks.py",
        "after_first_match = (matches.cumsum(1) - matches.long()) > 0",
        "after_first_match = matches.cumsum(1) > 0",
        [EOS_TESTS + "test_truncation_at_eos_keeps_the_eos_and_the_masks_follow_it"],
    ),
    Breakage(
        "N19-eos-truncation-after-one",
        "N19",
        "--task.end_at_eos keeps a truncate_after of 1: an EOS at index 0 does not end the response",
        "lm_human_preference_details/tasks.py",
        "return dataclasses.replace(task, truncate_token=eos, truncate_after=0)",
        "return dataclasses.replace(task, truncate_token=eos, truncate_after=1)",
        [EOS_TESTS + "test_end_at_eos_resolves_the_truncation_to_the_tokenizers_eos"],
    ),
    Breakage(
        "N19-penalty-subtract-replaces",
        "N19",
        "--task.penalty_mode subtract replaces the score by the penalty instead of adding it",
        TP,
        "scores = torch.where(passed, scores, scores + task.penalty_reward_value)",
        "scores = torch.where(passed, scores, task.penalty_reward_value)",
        [EOS_RUN + "[subtract-k3]"],
    ),
    Breakage(
        "N20-end-at-last-eos",
        "N20",
        "a response ends at its last EOS instead of its first",
        "lm_human_preference_details/tasks.py",
        "return torch.where(truncated == eos_id, positions, length - 1).amin(1)",
        "return torch.where(truncated == eos_id, positions, -1).amax(1).clamp(min=0)",
        [EOS_TESTS + "test_truncation_at_eos_keeps_the_eos_and_the_masks_follow_it"],
    ),
    Breakage(
        "N20-value-mask-at-eos",
        "N20",
        "values are masked after s instead of after s + 1",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "return cls(ends, positions > ends[:, None], positions > ends[:, None] + 1)",
        "return cls(ends, positions > ends[:, None], positions > ends[:, None])",
        [EOS_TESTS + "test_truncation_at_eos_keeps_the_eos_and_the_masks_follow_it"],
    ),
    Breakage(
        "N20-rollout-logprobs-unmasked",
        "N20",
        "the rollout's log-probs keep their values after EOS (KL counted there)",
        TP,
        "logprobs, ref_logprobs = masks.invalidate(logprobs), masks.invalidate(ref_logprobs)",
        "logprobs, ref_logprobs = logprobs, masks.invalidate(ref_logprobs)",
        [EOS_RUN + "[replace-k1]"],
    ),
    Breakage(
        "N20-rollout-values-unmasked",
        "N20",
        "the rollout's values keep their values after s + 1",
        TP,
        "ppo_logprobs, ppo_values = masks.invalidate(ppo_logprobs), masks.zero_values(ppo_values)",
        "ppo_logprobs, ppo_values = masks.invalidate(ppo_logprobs), ppo_values",
        [EOS_RUN + "[replace-k1]"],
    ),
    Breakage(
        "N20-new-logprobs-unmasked",
        "N20",
        "the loss forward's log-probs are not masked after EOS",
        TP,
        "new_logprobs, vpred = micro_masks.invalidate(new_logprobs), micro_masks.zero_values(vpred)",
        "new_logprobs, vpred = new_logprobs, micro_masks.zero_values(vpred)",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-new-values-unmasked",
        "N20",
        "the loss forward's values are not masked after s + 1",
        TP,
        "new_logprobs, vpred = micro_masks.invalidate(new_logprobs), micro_masks.zero_values(vpred)",
        "new_logprobs, vpred = micro_masks.invalidate(new_logprobs), vpred",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-loss-means-per-micro-batch-by-default",
        "N20",
        "each micro-batch's losses are means over its own tokens without --ppo.loss_means micro_batch",
        TP,
        'loss_means = mb_masks.loss_means(micro, accum, ppo.loss_means == "micro_batch")',
        "loss_means = mb_masks.loss_means(micro, accum, True)",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-policy-loss-unmasked",
        "N20",
        "the policy loss is a mean over all L tokens under end_at_eos",
        TP,
        "pg_loss = policy_mean(torch.max(pg_losses, pg_losses2))",
        "pg_loss = torch.max(pg_losses, pg_losses2).mean()",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-policy-clipfrac-unmasked",
        "N20",
        "the policy clip fraction is a mean over all L tokens under end_at_eos",
        TP,
        "pg_clipfrac = policy_mean((pg_losses2 > pg_losses).float())",
        "pg_clipfrac = (pg_losses2 > pg_losses).float().mean()",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-value-loss-over-policy-tokens",
        "N20",
        "the value loss is a mean over t <= s instead of t <= s + 1",
        TP,
        "vf_loss = 0.5 * value_mean(torch.max(vf_losses1, vf_losses2))",
        "vf_loss = 0.5 * policy_mean(torch.max(vf_losses1, vf_losses2))",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-value-clipfrac-unmasked",
        "N20",
        "the value clip fraction is a mean over all L tokens under end_at_eos",
        TP,
        "vf_clipfrac = value_mean((vf_losses2 > vf_losses1).float())",
        "vf_clipfrac = (vf_losses2 > vf_losses1).float().mean()",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N20-loss-mean-per-micro-batch",
        "N20",
        "each micro-batch's masked mean divides by its own tokens, not the minibatch's",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "(~self.after_end).sum() / micro_batches,",
        "(~micro_masks.after_end).sum(),",
        [EOS_TESTS + "test_ppo_update_masks_new_logprobs_values_and_the_loss_means"],
    ),
    Breakage(
        "N21-score-at-eos",
        "N21",
        "the score is added at the EOS (s) instead of one step after it",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "return torch.where(self.ends + 1 < length, self.ends + 1, self.ends)",
        "return self.ends",
        [EOS_TESTS + "test_truncation_at_eos_keeps_the_eos_and_the_masks_follow_it"],
    ),
    Breakage(
        "N21-score-at-last-token",
        "N21",
        "under end_at_eos the score still goes to the last token",
        TP,
        "rewards[torch.arange(rewards.shape[0], device=rewards.device), score_index] += scores",
        "rewards[:, -1] += scores",
        [EOS_TESTS + "test_rewards_carry_no_kl_after_eos_and_the_score_one_step_after_it"],
    ),
    Breakage(
        "N21-k3-without-minus-one",
        "N21",
        "k3 is r - log r (no - 1): positive even where the policies agree",
        TP,
        "return (torch.expm1(log_ratio) - log_ratio).clamp_min(0)",
        "return (torch.expm1(log_ratio) + 1 - log_ratio).clamp_min(0)",
        [EOS_TESTS + "test_k1_and_k3_estimate_the_kl_and_only_k3_is_never_negative"],
    ),
    Breakage(
        "N21-k3-ratio-inverted",
        "N21",
        "k3 with log r = logprob - ref_logprob (the ratio upside down)",
        TP,
        "log_ratio = ref_logprobs - logprobs",
        "log_ratio = logprobs - ref_logprobs",
        [EOS_TESTS + "test_k1_and_k3_estimate_the_kl_and_only_k3_is_never_negative"],
    ),
    Breakage(
        "N22-reward-whitening-unmasked",
        "N22",
        "under end_at_eos the rewards are whitened over all L tokens",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "rewards, ~self.after_value_end, shift_mean=False, group_size=whiten_group, correction=correction",
        "rewards, torch.ones_like(self.after_value_end), shift_mean=False, group_size=whiten_group, "
        "correction=correction",
        [EOS_TESTS + "test_masked_advantages_match_per_row_loops[True-0]"],
    ),
    Breakage(
        "N22-masked-variance-unbiased",
        "N22",
        "the masked whitening divides the variance by n - 1",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "var = ((groups - mean) ** 2 * weights).sum(dims, keepdim=True) / (count - correction)",
        "var = ((groups - mean) ** 2 * weights).sum(dims, keepdim=True) / (count - 1)",
        [EOS_TESTS + "test_masked_advantages_match_per_row_loops"],
    ),
    Breakage(
        "N23-advantage-whitening-unmasked",
        "N23",
        "under end_at_eos the advantages are whitened over all L tokens",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "advantages = masked_whiten(advantages, ~self.after_end, group_size=whiten_group, correction=correction)",
        "advantages = masked_whiten(\n            advantages, torch.ones_like(self.after_end), "
        "group_size=whiten_group, correction=correction\n        )",
        [EOS_TESTS + "test_masked_advantages_match_per_row_loops"],
    ),
    Breakage(
        "N23-advantages-kept-after-eos",
        "N23",
        "the whitened advantages are not zeroed after EOS",
        "lm_human_preference_details/nplus/end_at_eos.py",
        "return rewards, advantages.masked_fill(self.after_end, 0.0), returns",
        "return rewards, advantages, returns",
        [EOS_TESTS + "test_masked_advantages_match_per_row_loops"],
    ),
    # ---------------------------------------------------------------- nplus: a reward model of responses ending at EOS
    Breakage(
        "N3-reward-pairs-without-eos",
        "N3",
        "under --task.end_at_eos the reward model trains on preference responses without their EOS",
        "lm_human_preference_details/reward_plumbing.py",
        "eos_id=tokenizer.eos_token_id if args.task.end_at_eos else None,",
        "eos_id=None,",
        [
            "tests/test_train_reward.py::"
            "test_reward_run_under_end_at_eos_trains_and_normalizes_on_responses_that_end_at_eos"
        ],
    ),
    Breakage(
        "N19-reward-normalization-not-cut-at-eos",
        "N19",
        "under --task.end_at_eos the reward model is normalized on samples not cut at EOS (PPO scores cut ones)",
        "train_reward.py",
        "        if args.task.end_at_eos:  # the successor recipe's policy is scored",
        "        if False:  # the successor recipe's policy is scored",
        [
            "tests/test_train_reward.py::"
            "test_reward_run_under_end_at_eos_trains_and_normalizes_on_responses_that_end_at_eos"
        ],
    ),
    # ---------------------------------------------------------------- --fsdp: the rollout's gather, sharded checkpoints
    Breakage(
        "O4-fsdp-rollout-not-gathered",
        "O4",
        "--fsdp: the rollout does not gather the policy's weights once (every decoding step all-gathers them)",
        "lm_human_preference_details/distributed.py",
        "        unit.unshard()\n",
        "        pass\n",
        ["tests/test_fsdp_policy.py::test_gathered_unshards_every_unit_once_for_a_whole_rollout_and_shards_them_again"],
    ),
    Breakage(
        "O4-fsdp-rollout-not-resharded",
        "O4",
        "--fsdp: after the rollout the gathered weights stay whole on every process",
        "lm_human_preference_details/distributed.py",
        "            unit.reshard()",
        "            pass",
        ["tests/test_fsdp_policy.py::test_gathered_unshards_every_unit_once_for_a_whole_rollout_and_shards_them_again"],
    ),
    Breakage(
        "P20-fsdp-checkpoint-without-adam",
        "P20",
        "--fsdp: the sharded checkpoint holds the weights but not the Adam moments",
        "lm_human_preference_details/sharded.py",
        "dcp.save(_state(module, optimizer), checkpoint_id=os.path.join(directory, SHARDED_DIR))",
        'dcp.save({"model": get_model_state_dict(module)}, checkpoint_id=os.path.join(directory, SHARDED_DIR))',
        ["tests/test_fsdp_policy.py::test_one_process_fsdp_run_writes_sharded_checkpoints_and_resumes_from_them"],
    ),
    Breakage(
        "P20-fsdp-resume-ignores-shards",
        "P20",
        "--fsdp: --resume does not load the sharded weights and Adam state (the run goes on from the initial ones)",
        "lm_human_preference_details/ppo_plumbing.py",
        "            sharded.load(resumed.path, self.trained, self.optimizer)",
        "            pass",
        ["tests/test_fsdp_policy.py::test_one_process_fsdp_run_writes_sharded_checkpoints_and_resumes_from_them"],
    ),
    Breakage(
        "P20-fsdp-policy-dir-not-gathered",
        "P20",
        "--fsdp: the saved policy directory holds the initial weights (the gathered ones never reach its host twin)",
        "lm_human_preference_details/ppo_plumbing.py",
        "        return saves.host_copy(state.policy, whole), None",
        "        return saves._host_modules[id(state.policy)], None",
        ["tests/test_fsdp_policy.py::test_fsdp_runs_on_two_processes_equal_the_unsharded_runs"],
    ),
    Breakage(
        "P20-fsdp-other-layout-query-position",
        "P20",
        "--fsdp on another number of processes: the query stream continues from process 0's position, not the last's",
        "lm_human_preference_details/ppo_plumbing.py",
        "checkpoint.load_process_state(resumed, written - 1)",
        "checkpoint.load_process_state(resumed, 0)",
        ["tests/test_fsdp_policy.py::test_fsdp_on_four_processes_equals_unsharded_and_resumes_on_two"],
    ),
    # ---------------------------------------------------------------- train_reward.py --fsdp (FSDP2)
    Breakage(
        "R3-fsdp-gain-bias-gradients-not-averaged",
        "R3",
        "under --fsdp the gradients of gain and bias (0-dim, left whole by FSDP2) are not averaged over processes",
        "lm_human_preference_details/distributed.py",
        "        if grads:\n            _coalesced(grads, lambda flat: dist.all_reduce(",
        "        if False:\n            _coalesced(grads, lambda flat: dist.all_reduce(",
        ["tests/test_fsdp_reward.py::test_fsdp_reward_runs_equal_unsharded_runs[2]"],
    ),
    Breakage(
        "R8-fsdp-resume-skips-shards",
        "R8",
        "a resumed --fsdp reward run does not load its checkpoint's shards of the weights and Adam moments",
        "lm_human_preference_details/reward_plumbing.py",
        "    if args.run.fsdp:\n        sharded.load(resumed.path, reward_model, optimizer)",
        "    if args.run.fsdp:\n        pass",
        ["tests/test_fsdp_reward.py::test_fsdp_reward_killed_and_resumed_equals_uninterrupted"],
    ),
    Breakage(
        "D3-fsdp-query-position-of-own-process",
        "D3",
        "a --fsdp checkpoint resumed on fewer processes continues each query stream from its own rank's position, not "
        "the global one",
        "lm_human_preference_details/reward_plumbing.py",
        "checkpoint.load_process_state(resumed, saved_world - 1)",
        "checkpoint.load_process_state(resumed, query_stream.rank)",
        ["tests/test_fsdp_reward.py::test_query_stream_on_fewer_processes_continues_where_a_run_with_as_many_would"],
    ),
    Breakage(
        "D1-world-size-changes-without-fsdp",
        "D1",
        "a reward checkpoint resumes on another number of processes without --fsdp too (its per-process sizes change)",
        "lm_human_preference_details/resumable.py",
        'return (*ignored, "world_size") if getattr(run, "fsdp", False) else tuple(ignored)',
        'return (*ignored, "world_size")',
        ["tests/test_fsdp_reward.py::test_another_process_count_resumes_only_under_fsdp"],
    ),
    Breakage(
        "R6-fsdp-eval-not-gathered",
        "R6",
        "under --fsdp the held-out evaluation runs FSDP2's per-forward all-gathers, though processes score unequal "
        "numbers of rank-strided rows",
        "train_reward.py",
        "    with distributed.gathered(reward_model):\n        for chunk in rows.split(micro_batch_size):",
        "    with torch.no_grad():\n        for chunk in rows.split(micro_batch_size):",
        ["tests/test_fsdp_reward.py::test_fsdp_reward_runs_equal_unsharded_runs[4]"],
    ),
    # ---------------------------------------------------------------- --fsdp: the frozen models, accumulation
    Breakage(
        "O4-fsdp-accumulates-unsharded",
        "O4",
        "--fsdp: the micro-batches before the last keep whole, unsharded gradients (FSDP2 without gradient sync)",
        "lm_human_preference_details/distributed.py",
        "        return\n    yield\n    if isinstance(trained, FSDPModule) and average:",
        "        return\n    if isinstance(trained, FSDPModule):\n        trained.set_requires_gradient_sync(average)\n"
        "    yield\n    if isinstance(trained, FSDPModule) and average:",
        ["tests/test_fsdp_policy.py::test_fsdp_reduce_scatters_every_micro_batch_so_no_whole_gradient_accumulates"],
    ),
    Breakage(
        "O4-fsdp-reference-whole",
        "O4",
        "--fsdp: the reference policy stays whole on every process",
        "lm_human_preference_details/ppo_plumbing.py",
        "    distributed.shard_frozen(reference.copy, accelerator)\n",
        "    pass\n",
        ["tests/test_fsdp_policy.py::test_fsdp_shards_the_reference_and_a_reward_model_and_they_score_as_before"],
    ),
]


# ---------------------------------------------------------------- checking the list against the code


@functools.cache
def test_functions(path: Path) -> dict[str, ast.FunctionDef]:
    """The test functions defined at the top level of a test file, by name (each file parsed once)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def defined_tests(path: Path) -> set[str]:
    """Names of the test functions defined at the top level of a test file."""
    return set(test_functions(path))


@functools.cache
def module_marks(path: Path) -> str:
    """The source of a test file's `pytestmark`, "" without one."""
    for statement in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(statement, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in statement.targets):
            return ast.unparse(statement.value)
    return ""


def starts_processes(root: Path, node: str) -> bool:
    """Whether the test `node` is marked `slow` (it runs the scripts in processes of their own, the longest tests), by
    a decorator or its module's `pytestmark`."""
    file, _, name = node.partition("::")
    function = test_functions(root / file).get(name.split("[")[0])
    marks = [ast.unparse(d) for d in function.decorator_list] if function is not None else []
    return any("mark.slow" in mark for mark in [*marks, module_marks(root / file)])


def list_problems(breakages: list[Breakage], root: Path) -> list[str]:
    """Why breakages cannot run: duplicate ids, stale snippets, replacements that do not compile, unknown tests."""
    problems = []
    ids = [b.id for b in breakages]
    problems += [f"{i}: duplicate id" for i in sorted({i for i in ids if ids.count(i) > 1})]
    for b in breakages:
        path = root / b.file
        if not path.is_file():
            problems.append(f"{b.id}: {b.file} does not exist; update this breakage in tools/mutation_check.py")
            continue
        source = path.read_text(encoding="utf-8")
        count = source.count(b.original)
        if count != 1:
            problems.append(
                f"{b.id}: stale: the snippet {b.original!r} occurs {count} times in {b.file} (must be once); "
                "update this breakage in tools/mutation_check.py to the current code"
            )
        elif b.original == b.replacement:
            problems.append(f"{b.id}: the replacement equals the original")
        else:
            try:
                compile(source.replace(b.original, b.replacement), b.file, "exec")
            except SyntaxError as e:
                problems.append(f"{b.id}: the broken {b.file} does not compile ({e.msg}, line {e.lineno})")
        if not b.tests:
            problems.append(f"{b.id}: names no test")
        for node in b.tests:
            file, _, name = node.partition("::")
            if not (root / file).is_file() or name.split("[")[0] not in defined_tests(root / file):
                problems.append(f"{b.id}: test {node} does not exist")
    return problems


# ---------------------------------------------------------------- running


def run_order(breakages: list[Breakage], root: Path) -> list[Breakage]:
    """The breakages whose tests start processes (the longest) first, the others after them, each group in the list's
    order: the cores are not left waiting on one long breakage at the end."""
    return sorted(breakages, key=lambda b: not any(starts_processes(root, t) for t in b.tests))


def project_files(root: Path) -> list[str]:
    """Files of the project: tracked and untracked-but-not-ignored (git), else everything outside generated dirs."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
        return [name for name in out.decode().split("\0") if name and (root / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "runs", "models", "wandb", "__pycache__", "build"}
        return [
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(root).parts) and ".egg-info" not in str(p)
        ]


def make_copy(files: list[str], root: Path, dest: Path, breakage: Breakage | None) -> None:
    """A copy of `files` under `dest`, with `breakage` applied."""
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target)
    if breakage is not None:
        path = dest / breakage.file
        path.write_text(path.read_text(encoding="utf-8").replace(breakage.original, breakage.replacement))


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class IntraOpThreads:
    """A pytest plugin that sets torch's intra-op threads once the tests' conftest.py has set its own count."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def pytest_sessionstart(self, session) -> None:
        import torch

        torch.set_num_threads(self.threads)


def run_pytest(tests: list[str], threads: int) -> int:
    """pytest on `tests` in the current directory, temporary directories under BASETEMP, `threads` intra-op threads;
    -> its exit code."""
    import pytest

    return int(pytest.main([*PYTEST_FLAGS, "--basetemp", BASETEMP, *tests], plugins=[IntraOpThreads(threads)]))


def preload() -> None:
    """Import the heavy third-party modules once, before forking."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module; the tests import what they need
            pass


@dataclass
class Job:
    name: str
    """a breakage's id, or baseline (the unbroken copy)"""
    breakage: Breakage | None
    """what the copy breaks (None: the unbroken copy)"""
    tests: list[str]
    """pytest node ids"""
    limit: float
    """seconds before the job is killed"""


def start_fork(job: Job, files: list[str], workdir: Path, threads: int, log: Path) -> int:
    """Fork a child that copies the project to `workdir` with the job's breakage and runs pytest on its tests there,
    output to `log`; -> its pid (= process group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        make_copy(files, REPO, workdir, job.breakage)
        os.chdir(workdir)
        drop = {str(REPO), str(REPO / "tools"), "", "."}
        sys.path[:] = [str(workdir)] + [p for p in sys.path if p not in drop and Path(p or ".").resolve() != REPO]
        code = run_pytest(job.tests, threads)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's loop
        import traceback

        traceback.print_exc()
        os._exit(3)


def start_subprocess(job: Job, files: list[str], workdir: Path, threads: int, log: Path) -> subprocess.Popen:
    """Copy the project to `workdir` with the job's breakage, then a fresh python runs pytest on its tests there,
    output to `log`, in its own process group."""
    make_copy(files, REPO, workdir, job.breakage)
    tools = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {tools!r}); import mutation_check as m; sys.path.pop(0); "
    code += f"sys.exit(m.run_pytest(sys.argv[1:], {threads}))"
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-c", code, *job.tests],
            cwd=workdir,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def verdict(code: int | None) -> str:
    """The outcome of a breakage's pytest exit code (None: killed at the time limit)."""
    if code is None:
        return "caught (time limit)"
    if code in (1, 2):  # tests failed, or the test module failed to import
        return "caught"
    if code < 0:  # killed by a signal (e.g. a crash the breakage caused)
        return "caught (crash)"
    if code == 0:
        return "SURVIVED"
    return f"error (pytest exit {code})"


def stop(handle: int | subprocess.Popen, use_fork: bool) -> None:
    """Kill a job's whole process group and reap the child."""
    pgid = handle if use_fork else handle.pid
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pgid, 0) if use_fork else handle.wait()


def run_jobs(jobs: list[Job], files: list[str], workers: int, use_fork: bool, scratch: Path, keep: bool):
    """Run the jobs, `workers` at a time, each in a copy scratch/NAME (removed when it ends, unless `keep`) with
    cores // workers intra-op threads; -> {name: (exit code or None, seconds)}. The running children are killed when
    this returns early (Ctrl-C, SIGTERM)."""
    threads = max(1, cores() // workers)
    pending, running, results = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and len(running) < workers:
                job = pending.pop(0)
                args = (job, files, scratch / job.name, threads, scratch / f"{job.name}.log")
                handle = start_fork(*args) if use_fork else start_subprocess(*args)
                running[job.name] = (handle, time.monotonic(), job.limit)
            time.sleep(0.2)
            for name, (handle, started, limit) in list(running.items()):
                elapsed = time.monotonic() - started
                if use_fork:
                    pid, status = os.waitpid(handle, os.WNOHANG)
                    code = os.waitstatus_to_exitcode(status) if pid else None
                else:
                    code = handle.poll()
                if code is None and elapsed > limit:
                    stop(handle, use_fork)
                    results[name] = (None, elapsed)
                elif code is not None:
                    results[name] = (code, elapsed)
                else:
                    continue
                del running[name]
                if not keep:
                    shutil.rmtree(scratch / name, ignore_errors=True)
    finally:
        for handle, _, _ in running.values():
            stop(handle, use_fork)
    return results


def print_report(breakages: list[Breakage], results: dict, seconds: float) -> tuple[int, int]:
    """The table of breakages and outcomes; -> (caught, total)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mutation check: each breakage must make its tests fail", show_lines=False)
    for column in ("id", "detail", "breakage", "guarded by", "result", "s"):
        table.add_column(column, overflow="fold")
    caught = 0
    for b in breakages:
        code, elapsed = results[b.id]
        outcome = verdict(code)
        caught += outcome.startswith("caught")
        style = "green" if outcome.startswith("caught") else "bold red"
        tests = ", ".join(t.split("::")[-1] for t in b.tests)
        table.add_row(b.id, b.detail, b.what, tests, f"[{style}]{outcome}[/]", f"{elapsed:.0f}")
    console = Console(width=max(160, Console().width))
    console.print(table)
    console.print(f"caught {caught} of {len(breakages)} breakages in {seconds:.0f} s")
    return caught, len(breakages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--jobs", type=int, default=cores(), help=f"breakages run at the same time (default: the cores, {cores()})"
    )
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these breakages")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per breakage before it is killed")
    parser.add_argument("--list", action="store_true", help="print the breakages and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the guarding tests unbroken first")
    parser.add_argument("--subprocess", action="store_true", help="a fresh python per breakage instead of a fork")
    parser.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the copies and logs (their folder is printed)")
    args = parser.parse_args(argv)

    breakages = BREAKAGES
    if args.only:
        unknown = sorted(set(args.only) - {b.id for b in BREAKAGES})
        if unknown:
            print(f"unknown breakage ids {unknown}; --list shows them", file=sys.stderr)
            return 2
        breakages = [b for b in BREAKAGES if b.id in args.only]
    if args.list:
        for b in breakages:
            print(f"{b.id:36} {b.detail:5} {b.file}: {b.what}")
        return 0
    problems = list_problems(breakages, REPO)
    if problems:
        print("the breakage list does not match the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1

    os.environ.update(ENV)
    use_fork = hasattr(os, "fork") and not args.subprocess
    if use_fork:
        preload()
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="mutation-check-"))
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: the children are stopped and the copies removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        files = project_files(REPO)
        jobs = []
        if not args.no_baseline:
            baseline_tests = list(dict.fromkeys(t for b in breakages for t in b.tests))
            files_with_tests = len({t.split("::")[0] for t in baseline_tests})
            jobs.append(Job("baseline", None, baseline_tests, args.timeout * files_with_tests))
        jobs += [Job(b.id, b, b.tests, args.timeout) for b in run_order(breakages, REPO)]
        results = run_jobs(jobs, files, args.jobs, use_fork, scratch, args.keep)
        seconds = time.monotonic() - started
        caught, total = print_report(breakages, results, seconds)
        if args.json:
            outcome = {b.id: {**asdict(b), "result": verdict(results[b.id][0])} for b in breakages}
            Path(args.json).write_text(json.dumps({"caught": caught, "total": total, "breakages": outcome}, indent=1))
        for b in breakages:
            if not verdict(results[b.id][0]).startswith("caught"):
                log = (scratch / f"{b.id}.log").read_text(errors="replace")[-1500:]
                print(f"\n--- {b.id} ({verdict(results[b.id][0])}): tail of its pytest output\n{log}")
        if not args.no_baseline and results["baseline"][0] != 0:
            log = (scratch / "baseline.log").read_text(errors="replace")[-4000:]
            print(
                f"\nthe guarding tests fail without any breakage, so the check means nothing:\n{log}", file=sys.stderr
            )
            return 1
        return 0 if caught == total else 1
    finally:
        if args.keep:
            print(f"copies and logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
