#!/usr/bin/env bash
# OAI's cnndm experiment on one 8-GPU node: reward model from OAI's 46k online labels, then PPO against it (fixed KL
# coefficient 0.01, 32 episodes per update, temperature 0.5), for seeds 1..NUM_SEEDS, with the settings of OAI's
# launch.py (the scripts' `--task cnndm` presets).
#   bash benchmark/oai_cnndm.sh                         # run here, one seed after the other
#   DRY_RUN=1 bash benchmark/oai_cnndm.sh               # print the exact commands
#   bash benchmark/oai_cnndm.sh --slurm_template benchmark/slurm_template.sh --submit   # one Slurm job per seed
# Outputs: models/oai_cnndm/seed<S>/{train_reward,train_policy}; wandb group oai_cnndm. Extra arguments go to
# benchmark/launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
# OAI's task settings apply unchanged: HF abisee/cnn_dailymail articles get their paragraph breaks back, so end_text
# '\n' cuts the query after the last whole paragraph (docs/data.md, "Query data and label files"); QUERY_FLAGS adds task flags
QUERY_FLAGS=${QUERY_FLAGS-""}

# PYTHON is the interpreter that runs the launcher (default python3), e.g. PYTHON=.venv/bin/python
"${PYTHON:-python3}" benchmark/launch.py \
    --name oai_cnndm \
    --num_seeds "${NUM_SEEDS:-3}" \
    --wandb_project "${WANDB_PROJECT:-lm_human_preference_details}" \
    --wandb_tags oai_settings cnndm \
    --command "accelerate launch --num_processes 8 train_reward.py --task cnndm $QUERY_FLAGS" \
    --command "accelerate launch --num_processes 8 train_policy.py --task cnndm $QUERY_FLAGS \
--rewards.trained_model {run_dir}/train_reward" \
    ${DRY_RUN:+--dry_run} "$@"
