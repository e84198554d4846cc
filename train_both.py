"""The whole pipeline in one command: train the reward model, then the policy against it, with one task's settings;
with --sft_dataset, first a supervised fine-tuning of the base model that both then start from (the successor recipe).

OAI trains the reward model first when `rewards.train_new_model` is set (every launch.py experiment), in the same job,
saves it under the policy's save_dir and then loads it:
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L410-L417

Run:   python train_both.py --task sentiment --output_dir runs/sentiment
       accelerate launch --num_processes 8 train_both.py --task sentiment --output_dir runs/sentiment
Flags: --task NAME picks OAI's experiment for both stages. A flag that train_reward.py and train_policy.py both take
(--task.*, --base_model, --seed, --data_seed, --track, --save_interval, ...) goes to both; a flag that only one takes
goes to that one (--labels.num_train, --label_dataset, --ppo.lr, --rewards.kl_coef, ...); --reward_stage.FLAG or
--policy_stage.FLAG gives a flag to one stage only (e.g. --reward_stage.seed 2). The reward model is written to
OUTPUT_DIR/reward_model, the policy to OUTPUT_DIR/policy (its --rewards.trained_model is OUTPUT_DIR/reward_model).
SFT:   python train_both.py --sft_dataset sft.jsonl --base_model gpt2 --sft_stage.lr 1e-5 ... --output_dir runs/nplus
--sft_dataset FILE (train_sft.py's --dataset) adds a first stage: train_sft.py fine-tunes --base_model on it into
OUTPUT_DIR/sft, and the reward model and the policy start from OUTPUT_DIR/sft (their --base_model). It takes the flags
that all three scripts take (--base_model, --seed, --track, ...) and --sft_stage.FLAG (e.g. --sft_stage.lr 1e-5); the
others go to the reward and policy stages as above.
Resume: after a kill or Ctrl-C, run the same command again: a finished SFT model and reward model are kept, a started
stage continues from its newest checkpoint (--resume auto), so the outputs are those of an uninterrupted run.
"""

import dataclasses
import json
import os
import shlex
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import train_policy
import train_reward
import train_sft
from lm_human_preference_details import checkpoint, cli, files, resumable, settings
from lm_human_preference_details.modeling import REWARD_CONFIG_FILE

STAGES = ("reward_stage", "policy_stage")
"""prefixes of the flags meant for one stage only"""
SFT_STAGE = "sft_stage"
"""prefix of the flags meant for the SFT stage only"""
PIPELINE_FLAGS = ("output_dir", "resume", "dry_run", "sft_dataset")
"""flags of the pipeline itself, not passed on as they are"""
SFT_DIR = "sft"
"""the SFT stage's directory in OUTPUT_DIR"""


@dataclass
class Pipeline:
    """The two stages' parsed settings."""

    output_dir: str
    """the pipeline's directory: reward_model/ and policy/ inside it"""
    reward: train_reward.Args
    """train_reward.py's settings"""
    policy: train_policy.Args
    """train_policy.py's settings"""
    commands: tuple[str, ...] = ("", "")
    """the stages as command lines of their own scripts (train_sft.py first with --sft_dataset)"""
    sft: train_sft.Args | None = None
    """train_sft.py's settings; None: no SFT stage (no --sft_dataset)"""


def flag_names(args_type: type, prefix: str = "") -> set[str]:
    """Every `--flag` name a script's Args dataclass takes (nested groups dotted, the run group's plain, booleans also
    as no_NAME)."""
    names, hints = set(), typing.get_type_hints(args_type, include_extras=True)
    for field in dataclasses.fields(args_type):
        name = f"{prefix}{field.name}"
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if dataclasses.is_dataclass(default):
            unprefixed = any(getattr(m, "name", None) == "" for m in getattr(hints[field.name], "__metadata__", ()))
            names |= flag_names(type(default), prefix if unprefixed else f"{name}.")
        else:
            names |= {name, f"{prefix}no_{field.name}"}
    return names


def group_flags(argv: Sequence[str]) -> list[list[str]]:
    """argv cut into [--flag, value...] groups; ValueError for a value with no flag before it."""
    groups: list[list[str]] = []
    for token in argv:
        if token.startswith("--"):
            groups.append([token])
        elif groups:
            groups[-1].append(token)
        else:
            raise ValueError(f"'{token}' follows no flag; train_both.py takes --flag value pairs only.")
    return groups


def route_flags(argv: Sequence[str]) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """Split argv into the pipeline's own flags, train_reward.py's argv and train_policy.py's argv."""
    own, reward_argv, policy_argv, _ = route_stage_flags(argv)
    return own, reward_argv, policy_argv


def route_stage_flags(argv: Sequence[str]) -> tuple[dict[str, list[str]], list[str], list[str], list[str]]:
    """Split argv into the pipeline's own flags and the argv of train_reward.py, train_policy.py and train_sft.py: the
    SFT stage takes --sft_stage.FLAG and the flags that all three scripts take."""
    takes = {"reward_stage": flag_names(train_reward.Args), "policy_stage": flag_names(train_policy.Args)}
    sft_takes = flag_names(train_sft.Args) & takes["reward_stage"] & takes["policy_stage"]
    own: dict[str, list[str]] = {}
    stage_argv: dict[str, list[str]] = {stage: [] for stage in (*STAGES, SFT_STAGE)}
    for group in group_flags(argv):
        name, _, inline = group[0][2:].partition("=")
        values = [inline] if inline else group[1:]
        stage, _, rest = name.partition(".")
        if stage in (*STAGES, SFT_STAGE) and rest:  # --reward_stage.FLAG: that stage only
            stage_argv[stage] += [f"--{rest}", *values]
        elif name in PIPELINE_FLAGS:
            own[name] = values
        elif name == "task":  # the preset, for both
            for stage in STAGES:
                stage_argv[stage] += ["--task", *values]
        else:
            targets = [stage for stage in STAGES if name in takes[stage]]
            if not targets:
                raise ValueError(
                    f"--{name} is a flag of neither train_reward.py nor train_policy.py; see their --help (or "
                    "train_both.py --help)."
                )
            for stage in targets:
                stage_argv[stage] += [f"--{name}", *values]
            if name in sft_takes:
                stage_argv[SFT_STAGE] += [f"--{name}", *values]
    return own, stage_argv["reward_stage"], stage_argv["policy_stage"], stage_argv[SFT_STAGE]


def parse(argv: list[str] | None = None) -> Pipeline:
    """Both stages' settings from one command line (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        raise SystemExit(0)
    own, reward_argv, policy_argv, sft_argv = route_stage_flags(cli.pop_flag(argv, "--debug")[1])
    if own.get("resume", ["auto"]) != ["auto"]:
        raise ValueError(
            "train_both.py always resumes each stage from its newest checkpoint; drop --resume or pass auto."
        )
    output_dir = (own.get("output_dir") or ["models/pipeline"])[0]
    reward_dir, policy_dir = os.path.join(output_dir, "reward_model"), os.path.join(output_dir, "policy")
    dry_run = ["--dry_run"] if "dry_run" in own else []
    sft_dataset = own.get("sft_dataset")
    if sft_dataset is not None and len(sft_dataset) != 1:
        raise ValueError("--sft_dataset takes one value: the supervised pairs (train_sft.py's --dataset).")
    stray = [flag.partition("=")[0] for flag in argv if flag.startswith(f"--{SFT_STAGE}.")]
    if sft_dataset is None and stray:
        raise ValueError(f"{stray[0]} is a flag of the SFT stage, which runs only with --sft_dataset FILE.")
    sft_args, commands = None, ()
    if sft_dataset is not None:  # the SFT model is the other stages' base model
        sft_dir = os.path.join(output_dir, SFT_DIR)
        sft_argv = [*sft_argv, *dry_run, "--dataset", sft_dataset[0], "--output_dir", sft_dir]
        sft_args, commands = train_sft.parse(sft_argv), (shlex.join(["train_sft.py", *sft_argv]),)
        reward_argv, policy_argv = [*reward_argv, "--base_model", sft_dir], [*policy_argv, "--base_model", sft_dir]
    reward_argv = [*reward_argv, *dry_run, "--output_dir", reward_dir]
    policy_argv = [*policy_argv, *dry_run, "--output_dir", policy_dir, "--rewards.trained_model", reward_dir]
    commands += (shlex.join(["train_reward.py", *reward_argv]), shlex.join(["train_policy.py", *policy_argv]))
    return Pipeline(output_dir, train_reward.parse(reward_argv), train_policy.parse(policy_argv), commands, sft_args)


def sft_finished(args: train_sft.Args) -> bool:
    """Whether args.run.output_dir holds the model that these settings fine-tune: its final save (the model, then
    args.json) is complete and args.json records these settings."""
    args_path = os.path.join(args.run.output_dir, "args.json")
    if not os.path.isfile(args_path) or os.path.exists(os.path.join(args.run.output_dir, files.SAVING_MARKER)):
        return False
    try:
        with open(args_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return False  # cut short: the stage's --resume auto continues from its newest checkpoint
    current = json.loads(json.dumps(settings.recorded(args)))
    return not resumable.setting_differences(saved, current, train_sft.RESUME_IGNORED)


def reward_model_finished(args: train_reward.Args) -> bool:
    """Whether args.run.output_dir holds the reward model that these settings train: its final save is complete and its
    newest checkpoint is its last step, written with these settings."""
    saved = checkpoint.list_checkpoints(args.run.output_dir)
    if not saved or not os.path.isfile(os.path.join(args.run.output_dir, REWARD_CONFIG_FILE)):
        return False
    if os.path.exists(os.path.join(args.run.output_dir, files.SAVING_MARKER)):
        return False
    step, path = saved[-1]
    try:
        meta = checkpoint.read_meta(path)
    except (checkpoint.CheckpointDamaged, FileNotFoundError):
        return False  # the reward stage's --resume auto moves it aside and continues from an intact one
    current = json.loads(json.dumps({**settings.recorded(args), "world_size": int(os.environ.get("WORLD_SIZE", "1"))}))
    differences = resumable.setting_differences(meta["settings"], current, resumable.RESUME_IGNORED)
    return step == args.labels.num_train // args.batch_size and not differences


def main(pipeline: Pipeline) -> dict:
    """Train (or finish) the SFT model (with --sft_dataset), the reward model, then the policy; -> the SFT and reward
    stages' figures and the policy's history."""
    reward, policy, sft = pipeline.reward, pipeline.policy, pipeline.sft
    main_process = os.environ.get("RANK", "0") == "0"
    if main_process:
        print("\n".join(f"stage {i}: {command}" for i, command in enumerate(pipeline.commands, 1)))
    results = {}
    # 0. with --sft_dataset: the SFT model, kept when finished with these settings, else trained or continued
    if sft is not None:
        if sft.run.dry_run or not sft_finished(sft):
            sft = settings.with_run(sft, resume="auto")
            results["sft"] = {k: v for k, v in train_sft.main(sft).items() if k != "model"}
        elif main_process:
            print(f"SFT model: {sft.run.output_dir} is finished with these settings; kept")
        if sft.run.dry_run and not os.path.isfile(os.path.join(sft.run.output_dir, "args.json")):
            if main_process:
                print(
                    f"reward model and policy: their dry runs read the SFT model, which {sft.run.output_dir} lacks yet"
                )
            return results
    # 1. the reward model: kept when finished with these settings, else trained or continued from its checkpoint
    if reward.run.dry_run or not reward_model_finished(reward):
        reward = settings.with_run(reward, resume="auto")
        results["reward"] = {k: v for k, v in train_reward.main(reward).items() if k != "model"}
    elif main_process:
        print(f"reward model: {reward.run.output_dir} is finished with these settings; kept")
    # 2. the policy against it, with the same task settings (its own check refuses any other); a finished policy run
    # resumed writes its policy again (a kill may have cut that save)
    if policy.run.dry_run and not os.path.isfile(os.path.join(reward.run.output_dir, REWARD_CONFIG_FILE)):
        if main_process:
            print(f"policy: its dry run checks the reward model, which {reward.run.output_dir} does not hold yet")
        return results
    results["policy"] = train_policy.main(settings.with_run(policy, resume="auto"))
    if main_process and not policy.run.dry_run:
        print(f"pipeline done: reward model {reward.run.output_dir}, policy {policy.run.output_dir}")
    return results


if __name__ == "__main__":
    cli.run(main, parse)
