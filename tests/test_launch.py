"""benchmark/launch.py (seeds x command, locally or through Slurm) and the benchmark shell files built on it."""

import os
import re
import shlex
import subprocess
import sys

import pytest

import train_policy
import train_reward
from lm_human_preference_details.tasks import TASKS
from tests.planted import REPO
from tests.test_train_policy import save_reward_model

SHELL_FILES = ["oai_sentiment.sh", "oai_descriptiveness.sh", "oai_tldr.sh", "oai_cnndm.sh", "ablations.sh"]


def launch(*flags: str, cwd=REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    """benchmark/launch.py as a user runs it."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "launch.py"), *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_dry_run_prints_the_exact_command_of_each_seed():
    result = launch(
        "--command", "python train_policy.py --task sentiment --ppo.lr 2e-5", "--name", "lr2e-5",
        "--num_seeds", "3", "--wandb_project", "proj", "--wandb_entity", "team", "--wandb_tags", "sweep", "lr",
        "--dry_run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"WANDB_RUN_GROUP=lr2e-5 WANDB_TAGS=sweep,lr python train_policy.py --task sentiment --ppo.lr 2e-5 --seed {s} "
        f"--exp_name lr2e-5 --output_dir models/lr2e-5/seed{s} --track --wandb_project_name proj --wandb_entity team"
        for s in (1, 2, 3)
    ]


def test_dry_run_of_a_reward_then_policy_pipeline():
    result = launch(
        "--command", "accelerate launch --num_processes 8 train_reward.py --task tldr",
        "--command", "accelerate launch --num_processes 8 train_policy.py --task tldr "
                     "--rewards.trained_model {run_dir}/train_reward",
        "--seeds", "4", "7", "--wandb_group", "grp", "--output_root", "runs", "--dry_run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    env = "WANDB_RUN_GROUP=grp"
    wandb = "--track --wandb_project_name lm_human_preference_details"
    assert result.stdout.splitlines() == [
        f"{env} accelerate launch --num_processes 8 train_reward.py --task tldr --seed {s} --exp_name train_policy "
        f"--output_dir runs/train_policy/seed{s}/train_reward {wandb} && "
        f"{env} accelerate launch --num_processes 8 train_policy.py --task tldr "
        f"--rewards.trained_model runs/train_policy/seed{s}/train_reward --seed {s} --exp_name train_policy "
        f"--output_dir runs/train_policy/seed{s}/train_policy {wandb}"
        for s in (4, 7)
    ]


def test_flags_already_in_the_command_are_kept_and_seed_is_refused():
    result = launch("--command", "python x.py --output_dir elsewhere/{seed} --exp_name mine", "--num_seeds", "1",
                    "--no_track", "--dry_run")  # fmt: skip
    assert result.stdout.splitlines() == ["python x.py --output_dir elsewhere/1 --exp_name mine --seed 1"]
    result = launch("--command", "python x.py --seed 3", "--dry_run")
    assert result.returncode != 0 and "the launcher sets --seed" in result.stderr
    result = launch("--command", "python a.py && python b.py", "--dry_run")
    assert result.returncode != 0 and "its own --command" in result.stderr


JOB = """
import os, pathlib, sys, time
run_dir = pathlib.Path(sys.argv[sys.argv.index("--output_dir") + 1])
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "started").touch()
partners = [run_dir.parent / f"seed{s}" / "started" for s in (1, 2)]
deadline = time.time() + 60
while not all(p.exists() for p in partners) and time.time() < deadline:
    time.sleep(0.05)
print("together" if all(p.exists() for p in partners) else "alone")
print(os.environ.get("WANDB_RUN_GROUP"), os.environ.get("WANDB_TAGS"), sys.argv[1:])
"""


def test_two_workers_run_seeds_at_once_and_keep_a_log_per_seed(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    result = launch(
        "--command", f"{sys.executable} job.py", "--name", "par", "--num_seeds", "3", "--workers", "2",
        "--wandb_project", "proj", "--wandb_tags", "t1", "t2", "--output_root", "out", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for seed in (1, 2, 3):
        log = (tmp_path / "out" / "par" / f"seed{seed}" / "launch.log").read_text().splitlines()
        argv = ["--seed", str(seed), "--exp_name", "par", "--output_dir", f"out/par/seed{seed}", "--track",
                "--wandb_project_name", "proj"]  # fmt: skip
        assert log[0].startswith("$ WANDB_RUN_GROUP=par WANDB_TAGS=t1,t2 ")
        # seeds 1 and 2 only finish when both have started: the two workers ran them at the same time
        assert log[1:] == ["together", f"par t1,t2 {argv}"]
    assert re.search(r"│ 3\s+│ 0\s+│", result.stdout)


def test_log_and_sbatch_paths_longer_than_the_console_are_printed_whole(tmp_path):
    root = tmp_path / ("x" * 150)  # a path longer than the 80-column console
    (tmp_path / "job.py").write_text("print('ran')\n")
    ran = launch("--command", f"{sys.executable} job.py", "--name", "long", "--num_seeds", "1", "--output_root",
                 str(root), cwd=tmp_path, env={"COLUMNS": "80"})  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    log = str(root / "long" / "seed1" / "launch.log")
    lines = ran.stdout.splitlines()
    assert f"seed 1 -> {log}" in lines and any(f"│ {log} │" in line for line in lines)
    template = str(REPO / "benchmark" / "slurm_template.sh")
    slurm = launch("--command", "python x.py", "--name", "long", "--num_seeds", "1", "--slurm_template", template,
                   "--output_root", str(root), cwd=tmp_path, env={"COLUMNS": "80"})  # fmt: skip
    assert slurm.returncode == 0, slurm.stdout + slurm.stderr
    assert any(f"│ {root / 'long' / 'seed1' / 'job.sbatch'} │" in line for line in slurm.stdout.splitlines())


STAGE_A = """
import pathlib, sys
out = pathlib.Path(sys.argv[sys.argv.index("--output_dir") + 1])
out.mkdir(parents=True)
seed = sys.argv[sys.argv.index("--seed") + 1]
(out / "model.txt").write_text("reward model of seed " + seed)
print("stage a, seed", seed)
sys.exit(1 if seed == "2" else 0)
"""
STAGE_B = """
import pathlib, sys
print("stage b read:", pathlib.Path(sys.argv[sys.argv.index("--reward") + 1]).read_text())
"""


def test_stages_run_in_order_and_a_failed_stage_stops_its_seed(tmp_path):
    (tmp_path / "stage_a.py").write_text(STAGE_A)
    (tmp_path / "stage_b.py").write_text(STAGE_B)
    result = launch("--command", f"{sys.executable} stage_a.py",
                    "--command", f"{sys.executable} stage_b.py --reward {{run_dir}}/stage_a/model.txt",
                    "--name", "pipe", "--seeds", "1", "2", "--no_track", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1  # seed 2's first stage failed
    assert "stage b read: reward model of seed 1" in result.stdout  # --workers 1 also shows the output here
    log1 = (tmp_path / "models" / "pipe" / "seed1" / "launch.log").read_text()
    log2 = (tmp_path / "models" / "pipe" / "seed2" / "launch.log").read_text()
    assert log1.endswith("stage a, seed 1\nstage b read: reward model of seed 1\n")
    assert log2.endswith("stage a, seed 2\n")  # && stopped the seed at its failed stage
    assert (tmp_path / "models" / "pipe" / "seed2" / "stage_a" / "model.txt").exists()


def test_slurm_template_gives_one_filled_sbatch_file_per_seed(tmp_path):
    result = launch("--command", "python train_policy.py --task sentiment", "--name", "slurmy", "--num_seeds", "2",
                    "--slurm_template", str(REPO / "benchmark" / "slurm_template.sh"), "--output_root", "out",
                    cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for seed in (1, 2):
        text = (tmp_path / "out" / "slurmy" / f"seed{seed}" / "job.sbatch").read_text()
        assert not re.search(r"\{(command|seed|job_name|run_dir|workdir)\}", text)
        assert f"#SBATCH --job-name=slurmy-seed{seed}\n" in text
        assert f"#SBATCH --output=out/slurmy/seed{seed}/slurm-%j.log\n" in text
        assert f"#SBATCH --chdir={tmp_path}\n" in text
        assert f'echo "seed {seed} on $(hostname), job ${{SLURM_JOB_ID:-none}}"' in text
        assert text.rstrip().endswith(
            f"WANDB_RUN_GROUP=slurmy python train_policy.py --task sentiment --seed {seed} --exp_name slurmy "
            f"--output_dir out/slurmy/seed{seed} --track --wandb_project_name lm_human_preference_details"
        )
        assert not (tmp_path / "out" / "slurmy" / f"seed{seed}" / "launch.log").exists()  # nothing ran here
    (tmp_path / "bad.sh").write_text("#!/bin/bash\necho {seed}\n")
    result = launch("--command", "python x.py", "--slurm_template", "bad.sh", cwd=tmp_path)
    assert result.returncode != 0 and "no {command} placeholder" in result.stderr


def shell_stages(shell_file: str) -> list[tuple[dict, str, list[str]]]:
    """(environment, script, flags) of every stage the shell file's dry run prints for seeds 1 and 2."""
    result = subprocess.run(["bash", str(REPO / "benchmark" / shell_file)], capture_output=True, text=True,
                            check=False, env={**os.environ, "DRY_RUN": "1", "NUM_SEEDS": "2"}, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    stages = []
    for line in result.stdout.splitlines():
        for stage in line.split(" && "):
            tokens = shlex.split(stage)
            env = {}
            while re.fullmatch(r"[A-Z_]+=.*", tokens[0]):
                key, value = tokens.pop(0).split("=", 1)
                env[key] = value
            assert tokens[:4] == ["accelerate", "launch", "--num_processes", "8"]
            stages.append((env, tokens[4], tokens[5:]))
    return stages


def parse_stage(script: str, flags: list[str]):
    """The stage's flags through its script's own parser (OAI presets via --task, tyro for the rest)."""
    if script == "train_policy.py":
        return train_policy.parse(flags)
    assert script == "train_reward.py"
    return train_reward.parse(flags)


@pytest.mark.parametrize("shell_file", SHELL_FILES)
def test_shell_file_flags_are_accepted_by_the_scripts(shell_file):
    stages = shell_stages(shell_file)
    assert len(stages) == {"ablations.sh": 12}.get(shell_file, 4)  # stages x 2 seeds
    task = "sentiment" if shell_file == "ablations.sh" else shell_file[len("oai_") : -len(".sh")]
    for env, script, flags in stages:
        args = parse_stage(script, flags)
        assert args.run.track and args.run.wandb_project_name == "lm_human_preference_details"
        assert env["WANDB_RUN_GROUP"] == args.run.exp_name and task in env["WANDB_TAGS"].split(",")
        assert args.run.output_dir.startswith(f"models/{args.run.exp_name}/seed{args.seed}/")
        assert args.task == TASKS[task]  # OAI's task settings, unchanged
        if script == "train_policy.py":
            assert args.task_id == task
            assert args.rewards.trained_model.endswith(f"/seed{args.seed}/train_reward")
        else:
            assert args.label_dataset.startswith(task + "/")


def test_ablations_change_only_what_they_name():
    policies = {args.run.exp_name: args for env, script, flags in shell_stages("ablations.sh")
                if script == "train_policy.py" for args in [parse_stage(script, flags)] if args.seed == 1}  # fmt: skip
    rewards = {args.run.exp_name: args for env, script, flags in shell_stages("ablations.sh")
               if script == "train_reward.py" for args in [parse_stage(script, flags)] if args.seed == 1}  # fmt: skip
    baseline = train_policy.task_presets()["sentiment"]
    assert baseline.use_tensorflow_adam and baseline.ppo.whiten_rewards and baseline.rewards.adaptive_kl.enabled
    assert not policies["ablation_torch_adam"].use_tensorflow_adam
    assert not rewards["ablation_torch_adam"].use_tensorflow_adam
    assert not policies["ablation_no_whiten_rewards"].ppo.whiten_rewards
    assert policies["ablation_no_whiten_rewards"].rewards.trained_model == "models/oai_sentiment/seed1/train_reward"
    fixed = policies["ablation_fixed_kl"]
    assert not fixed.rewards.adaptive_kl.enabled and fixed.rewards.kl_coef == baseline.rewards.kl_coef
    assert fixed.run.output_dir == "models/ablation_fixed_kl/seed1/train_policy"
    no_norm = rewards["ablation_no_reward_normalization"]
    assert not no_norm.normalize_before and not no_norm.normalize_after
    for name, args in policies.items():
        assert args.ppo.whiten_rewards == (name != "ablation_no_whiten_rewards")
        assert args.rewards.adaptive_kl.enabled == (name != "ablation_fixed_kl")
        assert args.use_tensorflow_adam == (name != "ablation_torch_adam")


def test_sentiment_policy_command_passes_the_scripts_dry_run(tmp_path, tiny_model_dir):
    (_, script, flags) = shell_stages("oai_sentiment.sh")[1]
    assert script == "train_policy.py"
    # the dry run checks its inputs: the reward model the shell file's first stage writes, here a tiny stand-in
    reward_dir = flags[flags.index("--rewards.trained_model") + 1]
    save_reward_model(tmp_path / reward_dir, tiny_model_dir, TASKS["sentiment"], task_name="sentiment")
    result = subprocess.run([sys.executable, str(REPO / script), *flags, "--dry_run"], cwd=tmp_path,
                            capture_output=True, text=True, check=False, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "512 (512 per process)" in result.stdout and "1954" in result.stdout


def test_shell_files_run_the_launcher_with_the_interpreter_named_by_python(tmp_path):
    log = tmp_path / "calls.log"
    fake = tmp_path / "fake-python"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    for shell_file in SHELL_FILES:
        log.unlink(missing_ok=True)
        env = {**os.environ, "PYTHON": str(fake), "DRY_RUN": "1"}
        result = subprocess.run(["bash", str(REPO / "benchmark" / shell_file)], capture_output=True, text=True,
                                check=False, env=env, timeout=60)  # fmt: skip
        assert result.returncode == 0, result.stderr
        calls = log.read_text().splitlines()
        launches = (REPO / "benchmark" / shell_file).read_text().count("\nlaunch --name") or 1
        assert len(calls) == launches and all(call.startswith("benchmark/launch.py --") for call in calls), calls
        assert all(call.endswith("--dry_run") for call in calls), calls
