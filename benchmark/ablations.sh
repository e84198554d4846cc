#!/usr/bin/env bash
# Ablations of OAI's sentiment experiment, each changing one detail of benchmark/oai_sentiment.sh (the baseline; run
# it first). The policy-only ablations train against the baseline's reward model of the same seed
# (models/oai_sentiment/seed<S>/train_reward), so that a seed differs from the baseline only in the ablated detail.
# Every policy is written to models/<ablation>/seed<S>/train_policy, as the baseline's.
#   bash benchmark/ablations.sh                         # run here, one seed after the other
#   DRY_RUN=1 bash benchmark/ablations.sh               # print the exact commands
# Compare with the baseline, e.g.:
#   python benchmark/compare.py --runs "baseline=models/oai_sentiment/seed*/train_policy" \
#       "torch_adam=models/ablation_torch_adam/seed*/train_policy" --output_dir compare/torch_adam
# Extra arguments go to every benchmark/launch.py call.
set -euo pipefail
cd "$(dirname "$0")/.."
QUERY_FLAGS=${QUERY_FLAGS-""}  # as benchmark/oai_sentiment.sh: OAI's task settings unchanged
BASELINE_DIR=${BASELINE_DIR:-models/oai_sentiment}
REWARD="accelerate launch --num_processes 8 train_reward.py --task sentiment $QUERY_FLAGS"
POLICY="accelerate launch --num_processes 8 train_policy.py --task sentiment $QUERY_FLAGS"
EXTRA=("$@")

# PYTHON is the interpreter that runs the launcher (default python3), e.g. PYTHON=.venv/bin/python
launch() {
    "${PYTHON:-python3}" benchmark/launch.py \
        --num_seeds "${NUM_SEEDS:-3}" \
        --wandb_project "${WANDB_PROJECT:-lm_human_preference_details}" \
        "$@" ${DRY_RUN:+--dry_run} "${EXTRA[@]}"
}

# torch.optim.Adam (epsilon inside the bias correction) instead of OAI's TF1 Adam, for the reward model and the policy
launch --name ablation_torch_adam --wandb_tags ablation torch_adam sentiment \
    --command "$REWARD --no_use_tensorflow_adam" \
    --command "$POLICY --no_use_tensorflow_adam --rewards.trained_model {run_dir}/train_reward"

# no reward whitening before GAE (OAI whitens the per-token rewards of each minibatch)
launch --name ablation_no_whiten_rewards --wandb_tags ablation no_whiten_rewards sentiment \
    --command "$POLICY --ppo.no_whiten_rewards --rewards.trained_model $BASELINE_DIR/seed{seed}/train_reward \
--output_dir {run_dir}/train_policy"

# fixed KL coefficient 0.15 instead of the adaptive controller (target 6 nats)
launch --name ablation_fixed_kl --wandb_tags ablation fixed_kl sentiment \
    --command "$POLICY --rewards.adaptive_kl.no_enabled --rewards.trained_model $BASELINE_DIR/seed{seed}/train_reward \
--output_dir {run_dir}/train_policy"

# reward model normalized neither before nor after training (raw head output as the score)
launch --name ablation_no_reward_normalization --wandb_tags ablation no_reward_normalization sentiment \
    --command "$REWARD --no_normalize_before --no_normalize_after" \
    --command "$POLICY --rewards.trained_model {run_dir}/train_reward"
