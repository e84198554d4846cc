#!/usr/bin/env bash
# OAI's sentiment experiment on one 8-GPU node: reward model from OAI's labels, then PPO against it, for seeds
# 1..NUM_SEEDS, with the settings of OAI's launch.py (the scripts' `--task sentiment` presets).
#   bash benchmark/oai_sentiment.sh                     # run here, one seed after the other
#   DRY_RUN=1 bash benchmark/oai_sentiment.sh           # print the exact commands
#   bash benchmark/oai_sentiment.sh --slurm_template benchmark/slurm_template.sh --submit   # one Slurm job per seed
# Outputs: models/oai_sentiment/seed<S>/{train_reward,train_policy}; wandb group oai_sentiment. Extra arguments go to
# benchmark/launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# OAI's task settings apply unchanged: the texts are OAI's book passages or, where they cannot be fetched, bookcorpus
# reshaped into passages (docs/data.md, "Query data and label files"); QUERY_FLAGS adds task flags, e.g.
# QUERY_FLAGS="--task.query_dataset passages.jsonl" for a local file of passages.
QUERY_FLAGS=${QUERY_FLAGS-""}

# PYTHON is the interpreter that runs the launcher (default python3), e.g. PYTHON=.venv/bin/python
"${PYTHON:-python3}" benchmark/launch.py \
    --name oai_sentiment \
    --num_seeds "${NUM_SEEDS:-3}" \
    --wandb_project "${WANDB_PROJECT:-lm_human_preference_details}" \
    --wandb_tags oai_settings sentiment \
    --command "accelerate launch --num_processes 8 train_reward.py --task sentiment $QUERY_FLAGS" \
    --command "accelerate launch --num_processes 8 train_policy.py --task sentiment $QUERY_FLAGS \
--rewards.trained_model {run_dir}/train_reward" \
    ${DRY_RUN:+--dry_run} "$@"
