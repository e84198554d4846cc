"""Run a command for several seeds: here (one at a time or k at once) or as Slurm jobs, with consistent wandb settings.

    python benchmark/launch.py --num_seeds 3 --dry_run --command "python train_policy.py --task sentiment"
    DRY_RUN=1 bash benchmark/oai_sentiment.sh   # reward model then policy, 8 GPUs, through this launcher

A seed's job runs its --command stages one after the other and stops at the first that fails (reward model, then
policy). To every stage the launcher appends `--seed S --exp_name NAME --output_dir models/NAME/seedS` (with several
stages `--output_dir models/NAME/seedS/<script name>`, e.g. .../seed1/train_reward) and, unless --no_track,
`--track --wandb_project_name P` (and `--wandb_entity E`). The wandb group (default NAME) and tags reach wandb.init
through the WANDB_RUN_GROUP and WANDB_TAGS environment variables, set on each stage. A flag that a command already
sets is not appended, except --seed, which only the launcher sets. Placeholders in a command: {seed}, {name} and
{run_dir} (models/NAME/seedS). Local jobs write their output to <run_dir>/launch.log; --dry_run prints the exact
command line of each seed and runs nothing.
"""

import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

import tyro
from rich.console import Console
from rich.table import Column, Table

SLURM_PLACEHOLDERS = ("command", "seed", "job_name", "run_dir", "workdir")


@dataclass
class Args:
    command: Annotated[list[str], tyro.conf.UseAppendAction]
    """shell command of one stage; give --command again for the next stage of the same seed (e.g. reward, policy)"""
    name: str | None = None
    """experiment name: --exp_name, wandb group and models/NAME/ (default: the last stage's script name)"""
    seeds: list[int] | None = None
    """seeds to run (default: 1 .. --num_seeds)"""
    num_seeds: int = 3
    """run seeds 1 .. num_seeds when --seeds is not given"""
    workers: int = 1
    """local jobs running at the same time (1: one seed after the other, its output also shown here)"""
    output_root: str = "models"
    """each seed writes to OUTPUT_ROOT/NAME/seedS"""
    slurm_template: str | None = None
    """write one sbatch file per seed (<run_dir>/job.sbatch) from this template instead of running here; it fills
    {command}, {seed}, {job_name}, {run_dir} and {workdir} (see benchmark/slurm_template.sh)"""
    submit: bool = False
    """with --slurm_template: also submit each file with sbatch"""
    track: bool = True
    """log every run to Weights & Biases (appends --track and the wandb flags; WANDB_MODE=offline works too)"""
    wandb_project: str = "lm_human_preference_details"
    """wandb project of every run (--wandb_project_name of the scripts)"""
    wandb_entity: str | None = None
    """wandb entity (team); None: your default entity"""
    wandb_group: str | None = None
    """wandb group of every run (WANDB_RUN_GROUP; default: NAME)"""
    wandb_tags: list[str] = field(default_factory=list)
    """wandb tags of every run (WANDB_TAGS)"""
    dry_run: bool = False
    """print the command line of each seed and exit"""


@dataclass
class Job:
    """One seed: its output directory and the exact shell line that runs all its stages."""

    seed: int
    run_dir: str
    command: str


def script_name(tokens: list[str]) -> str | None:
    """Stem of the first `.py` argument of a command (train_policy for `accelerate launch train_policy.py`)."""
    return next((os.path.splitext(os.path.basename(t))[0] for t in tokens if t.endswith(".py")), None)


def has_flag(tokens: list[str], flag: str) -> bool:
    """True when `flag` (or `flag=value`) is among the tokens."""
    return any(token == flag or token.startswith(flag + "=") for token in tokens)


def build_jobs(args: Args) -> tuple[str, list[Job]]:
    """The experiment name and the shell line of every seed, the launcher's flags and wandb environment added to
    each stage."""
    stages = [shlex.split(command) for command in args.command]
    for tokens in stages:
        if "&&" in tokens or ";" in tokens:
            raise SystemExit("error: give each stage its own --command instead of joining them with && or ;")
        if has_flag(tokens, "--seed"):
            raise SystemExit("error: the launcher sets --seed; remove it from --command")
    names = [script_name(tokens) or f"stage{i}" for i, tokens in enumerate(stages, 1)]
    if len(set(names)) < len(names):
        raise SystemExit(f"error: stages must run different scripts to get their own --output_dir, got {names}")
    name = args.name or names[-1]
    env = {}
    if args.track:
        env["WANDB_RUN_GROUP"] = args.wandb_group or name
        if args.wandb_tags:
            env["WANDB_TAGS"] = ",".join(args.wandb_tags)
    env_prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())

    jobs = []
    for seed in args.seeds or range(1, args.num_seeds + 1):
        run_dir = os.path.join(args.output_root, name, f"seed{seed}")
        lines = []
        for command, tokens, stage in zip(args.command, stages, names):
            output_dir = run_dir if len(stages) == 1 else os.path.join(run_dir, stage)
            flags = [("--seed", str(seed)), ("--exp_name", name), ("--output_dir", output_dir)]
            if args.track:
                flags += [("--track", None), ("--wandb_project_name", args.wandb_project)]
                flags += [("--wandb_entity", args.wandb_entity)] if args.wandb_entity else []
            added = [flag if value is None else f"{flag} {shlex.quote(value)}" for flag, value in flags]
            added = [text for text, (flag, _) in zip(added, flags) if not has_flag(tokens, flag)]
            command = command.replace("{seed}", str(seed)).replace("{name}", name).replace("{run_dir}", run_dir)
            lines.append(" ".join(part for part in (env_prefix, command.strip(), *added) if part))
        jobs.append(Job(seed, run_dir, " && ".join(lines)))
    return name, jobs


def run_job(job: Job, echo: bool) -> tuple[int, float]:
    """Run a job's shell line, its output into <run_dir>/launch.log (and here when `echo`); -> exit code, seconds."""
    os.makedirs(job.run_dir, exist_ok=True)
    start = time.time()
    with open(os.path.join(job.run_dir, "launch.log"), "w", buffering=1) as log:
        log.write(f"$ {job.command}\n")
        process = subprocess.Popen(
            job.command, shell=True, executable="/bin/bash", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in process.stdout:
            log.write(line)
            if echo:
                sys.stdout.write(line)
        returncode = process.wait()
    return returncode, time.time() - start


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace {command}, {seed}, ... in one pass, so that text inside a filled value is never replaced again."""
    return re.sub(r"\{(" + "|".join(SLURM_PLACEHOLDERS) + r")\}", lambda match: values[match.group(1)], template)


def write_slurm_files(jobs: list[Job], template_path: str, name: str) -> list[str]:
    """One sbatch file per seed, <run_dir>/job.sbatch, from the template; -> their paths."""
    with open(template_path) as f:
        template = f.read()
    if "{command}" not in template:
        raise SystemExit(f"error: the Slurm template {template_path} has no {{command}} placeholder")
    paths = []
    for job in jobs:
        values = {
            "command": job.command,
            "seed": str(job.seed),
            "job_name": f"{name}-seed{job.seed}",
            "run_dir": job.run_dir,
            "workdir": os.getcwd(),
        }
        os.makedirs(job.run_dir, exist_ok=True)
        path = os.path.join(job.run_dir, "job.sbatch")
        with open(path, "w") as f:
            f.write(fill_template(template, values))
        paths.append(path)
    return paths


def print_whole(console: Console, table: Table) -> None:
    """The table at its natural width when the console is narrower: the terminal wraps its lines, but no path in it is
    cut or folded."""
    natural = console.measure(table, options=console.options.update(max_width=sys.maxsize)).maximum
    if natural > console.width:
        table.width = natural
    console.print(table, crop=False)


def main(args: Args) -> int:
    """Build the jobs, then print, write or run them; -> exit code (1 when a local job failed)."""
    if args.workers < 1:
        raise SystemExit("error: --workers must be at least 1")
    name, jobs = build_jobs(args)
    if args.dry_run:
        for job in jobs:
            print(job.command)
        return 0
    console = Console(soft_wrap=True)  # a printed path stays whole, for the user to copy
    if args.slurm_template:
        status_column = "submitted" if args.submit else "to submit"
        table = Table("seed", Column("sbatch file", no_wrap=True), status_column, title=f"{name}: Slurm jobs")
        for job, path in zip(jobs, write_slurm_files(jobs, args.slurm_template, name)):
            status = f"sbatch {path}"
            if args.submit:
                try:
                    result = subprocess.run(["sbatch", path], capture_output=True, text=True, check=False)
                except FileNotFoundError:
                    raise SystemExit("error: --submit needs Slurm's sbatch command, which is not on PATH") from None
                if result.returncode != 0:
                    raise SystemExit(f"error: sbatch {path} failed: {result.stderr.strip()}")
                status = result.stdout.strip()
            table.add_row(str(job.seed), path, status)
        print_whole(console, table)
        return 0

    for job in jobs:
        console.print(f"[bold]seed {job.seed}[/bold] -> {job.run_dir}/launch.log", highlight=False)
    with ThreadPoolExecutor(max_workers=args.workers) as pool:
        results = list(pool.map(lambda job: run_job(job, echo=args.workers == 1), jobs))
    table = Table("seed", "exit code", "minutes", Column("log", no_wrap=True), title=f"{name}: {len(jobs)} seeds")
    for job, (returncode, seconds) in zip(jobs, results):
        status = "[green]0[/green]" if returncode == 0 else f"[red]{returncode}[/red]"
        table.add_row(str(job.seed), status, f"{seconds / 60:.1f}", os.path.join(job.run_dir, "launch.log"))
    print_whole(console, table)
    return int(any(returncode != 0 for returncode, _ in results))


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args, description=__doc__, use_underscores=True)))
