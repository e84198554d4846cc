#!/usr/bin/env bash
# OAI's tldr experiment on one 8-GPU node: reward model from OAI's 46k online labels, then PPO against it (fixed KL
# coefficient 0.03, 32 episodes per update), for seeds 1..NUM_SEEDS, with the settings of OAI's launch.py (the
# scripts' `--task tldr` presets).
#   bash benchmark/oai_tldr.sh                          # run here, one seed after the other
#   DRY_RUN=1 bash benchmark/oai_tldr.sh                # print the exact commands
#   bash benchmark/oai_tldr.sh --slurm_template benchmark/slurm_template.sh --submit   # one Slurm job per seed
# Outputs: models/oai_tldr/seed<S>/{train_reward,train_policy}; wandb group oai_tldr. Extra arguments go to
# benchmark/launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# The tldr preset reads CarperAI/openai_summarize_tldr (OAI's subset is unpublished); add
# `--task.query_dataset FILE.jsonl` to both commands to use another copy.

# PYTHON is the interpreter that runs the launcher (default python3), e.g. PYTHON=.venv/bin/python
"${PYTHON:-python3}" benchmark/launch.py \
    --name oai_tldr \
    --num_seeds "${NUM_SEEDS:-3}" \
    --wandb_project "${WANDB_PROJECT:-lm_human_preference_details}" \
    --wandb_tags oai_settings tldr \
    --command "accelerate launch --num_processes 8 train_reward.py --task tldr" \
    --command "accelerate launch --num_processes 8 train_policy.py --task tldr \
--rewards.trained_model {run_dir}/train_reward" \
    ${DRY_RUN:+--dry_run} "$@"
