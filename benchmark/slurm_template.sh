#!/bin/bash
# Slurm job for one seed of one experiment, on one node with 8 GPUs. benchmark/launch.py --slurm_template fills the
# placeholders (job name, seed, run directory, working directory, command); adapt the #SBATCH lines (partition,
# account, time) to your cluster.
#SBATCH --job-name={job_name}
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=3-00:00:00
#SBATCH --chdir={workdir}
#SBATCH --output={run_dir}/slurm-%j.log

set -euo pipefail
echo "seed {seed} on $(hostname), job ${SLURM_JOB_ID:-none}"
{command}
