"""The plumbing around train_policy.py's algorithm: input checks, the start-up table, tracking, the sample table,
progress, checkpoints, the policy's save and its upload. Nothing here changes what a PPO update computes."""

import dataclasses
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from accelerate import Accelerator
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details import (
    checkpoint,
    cli,
    devices,
    distributed,
    files,
    labelers,
    lora,
    resumable,
    sharded,
    tracking,
    validation,
)
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.hub import HubUnavailableError, hub_reachable
from lm_human_preference_details.modeling import CRITIC_DIR, PolicyWithValueHead, read_reward_metadata
from lm_human_preference_details.rewards import Reward, RewardModelReward, reward_model_dir
from lm_human_preference_details.settings import PolicyArgs, PolicyRewardFlags, recorded
from lm_human_preference_details.sizes import Sizes
from lm_human_preference_details.tasks import PassRateAlarm, TaskHParams, resolve_truncation, task_differences
from lm_human_preference_details.tokenizer import check_same_tokenizer, load_tokenizer

A = TypeVar("A", bound=PolicyArgs)


def print_setup(console, args: PolicyArgs, sizes: Sizes, tf32: str, task_changes: list[str], oai_ranks: int) -> None:
    """The start-up table of resolved settings and per-process sizes, and a warning when the processes cannot whiten
    as OAI's `oai_ranks` ranks did (main process only)."""
    ppo, task, kl = args.ppo, args.task, args.rewards.adaptive_kl
    cli.print_table(
        console,
        "policy training (train_policy.py)" + (" - dry run" if args.run.dry_run else ""),
        {
            "task": args.task_id,
            "base model": args.base_model,
            "lengths": f"query {task.query_length}, response {task.response_length} tokens",
            "temperature": task.temperature,
            "lr": f"{ppo.lr:g}, annealed linearly to 0",
            "kl_coef": f"{args.rewards.kl_coef:g}, "
            + (f"adaptive to KL target {kl.target:g} (horizon {kl.horizon})" if kl.enabled else "fixed"),
            "seeds": f"seed {args.seed} (process r: seed + 100003 r), data_seed {args.data_seed}",
            "processes": sizes.world,
            "episodes per update": f"{ppo.batch_size} ({sizes.batch} per process)",
            "minibatch per process": f"{sizes.minibatch} x {ppo.nminibatches} per epoch, {ppo.noptepochs} epochs",
            "micro-batch": f"{sizes.micro} x {ppo.gradient_accumulation_steps}",
            "virtual ranks per process": f"{sizes.virtual_ranks} x {sizes.group} episodes "
            f"({sizes.world * sizes.virtual_ranks} ranks in all), whitened in minibatches of {sizes.whiten_group}",
            "updates": sizes.nupdates,
            "optimizer steps": sizes.nupdates * ppo.noptepochs * ppo.nminibatches,
            "reward model": args.rewards.trained_model,
            **({"critic (--ppo.value_model)": args.ppo.value_model} if args.ppo.value_model else {}),
            **({"LoRA": lora.describe(args.lora)} if args.lora.rank else {}),
            **({"FSDP (--fsdp)": describe_fsdp(sizes.world)} if args.run.fsdp else {}),
            "TF32": tf32,
            "deterministic": devices.describe_deterministic(),
            **({"task from the reward model": "; ".join(task_changes)} if task_changes else {}),
            "output dir": args.run.output_dir,
        },
    )
    if sizes.not_oai_ranks:
        console.print(
            f"warning: each process whitens its {sizes.batch} episodes as one rank, not as OAI's {oai_ranks} ranks: "
            f"{sizes.not_oai_ranks}; --ppo.whiten_group_size 0 chooses this without the warning",
            style="bold red",
            markup=False,
        )


def check_reward_model(rm_metadata: dict, tokenizer, args: PolicyArgs, print_fn) -> None:
    """The reward model's tokenizer, task settings and task name checked against the policy run's (ValueError when
    they differ, unless --rewards.allow_task_mismatch, which prints a warning instead)."""
    check_same_tokenizer(
        rm_metadata,
        tokenizer,
        f"the reward model '{args.rewards.trained_model}' (--rewards.trained_model)",
        f"the policy uses tokenizer '{args.base_model}'",
    )
    if mismatch := check_reward_model_task(rm_metadata, args.task, args.rewards):
        print_fn(f"warning: --rewards.allow_task_mismatch: the reward model's task differs: {mismatch}")
    if warning := check_reward_model_task_name(rm_metadata, args.task_id, args.rewards):
        print_fn(f"warning: {warning}")
    for warning in label_warnings(rm_metadata, args.rewards.trained_model):
        print_fn(f"warning: {warning}")


def label_warnings(rm_metadata: dict, trained_model: str) -> list[str]:
    """The warnings train_reward.py gave about the reward model's labels (a task nobody checked, a labeler of another
    thing), each one line naming the reward model."""
    warnings = rm_metadata.get("label_warnings") or []
    return [f"the reward model '{trained_model}' was trained with a warning: {warning}" for warning in warnings]


def check_judge_tasks(args: PolicyArgs, reward: Reward, gold: labelers.Labeler | None, print_fn) -> None:
    """One warning line for each judge that measures another thing than the run's --task is about: a programmatic
    reward or the gold judge (vader on a descriptiveness run); a reward model's task is checked by
    check_reward_model."""
    judges = [(gold.measures, args.rewards.gold_model, "--rewards.gold_model")] if gold is not None else []
    if reward.metadata is None:
        judges.insert(0, (reward.measures, args.rewards.trained_model, "--rewards.trained_model"))
    for measures, name, flag in judges:
        if warning := labelers.judge_task_mismatch(measures, name, args.task_id, flag):
            print_fn(f"warning: {warning}")


def start_tracker(
    args: PolicyArgs, accelerator: Accelerator, loop: resumable.CheckpointedLoop, nupdates: int
) -> tuple[tracking.Tracker, dict]:
    """TensorBoard (and wandb) for this run, continuing a resumed run's (`loop.resumed`); clears a previous run's
    outputs with --overwrite_output_dir; -> the tracker and the metadata every checkpoint records."""
    resumed, settings = loop.resumed, loop.settings
    if resumed is None and args.run.overwrite_output_dir and accelerator.is_main_process:
        # the previous run's critic, which a run without one would leave beside a policy it does not belong to
        shutil.rmtree(os.path.join(args.run.output_dir, CRITIC_DIR), ignore_errors=True)
    config = {**recorded(args), "world_size": settings["world_size"], "nupdates": nupdates}
    tracker, run_name = resumable.start_tracker(args.run, args.seed, accelerator, resumed, args.task_id, config)
    meta = {"settings": settings, "run_name": run_name, "wandb_id": tracker.wandb_id}
    meta["reward_normalization"] = args.rewards.normalization
    return tracker, meta


def progress_bar(console, accelerator: Accelerator, nupdates: int, first_update: int) -> tuple[Progress, Any]:
    """The PPO updates' progress bar (main process only) and its task."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    progress = Progress(*columns, console=console, disable=not accelerator.is_main_process)
    return progress, progress.add_task("PPO updates", total=nupdates, completed=first_update)


def check_reward_model_task(rm_metadata: dict, task: TaskHParams, rewards: PolicyRewardFlags) -> str | None:
    """ValueError listing where the reward model's task settings differ from the policy's, unless
    --rewards.allow_task_mismatch; -> the differences (None when equal)."""
    # OAI asserts that the reward model's task hyperparameters equal the policy's, every field
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L411
    differences = task_differences(rm_metadata.get("task"), task)
    if not differences:
        return None
    listed = "; ".join(
        f"{name}: reward model {saved!r}, policy {ours!r}" for name, (saved, ours) in differences.items()
    )
    if not rewards.allow_task_mismatch:
        raise ValueError(
            f"the reward model '{rewards.trained_model}' was trained for other task settings than this run's: "
            f"{listed}. Add its settings to the command: {task_flags(differences)} (or pass "
            "--rewards.task_from_reward_model), train a reward model with this run's, or pass "
            "--rewards.allow_task_mismatch to use it anyway."
        )
    return listed


def check_reward_model_task_name(rm_metadata: dict, task_id: str, rewards: PolicyRewardFlags) -> str | None:
    """ValueError when the reward model was trained for another --task (sentiment and descriptiveness have equal task
    settings, only their labels differ), unless --rewards.allow_task_mismatch; -> a warning, or None when they agree."""
    saved = rm_metadata.get("task_name")
    labels = f" on labels '{rm_metadata['label_dataset']}'" if rm_metadata.get("label_dataset") else ""
    if saved is None:
        return (
            f"the reward model '{rewards.trained_model}' records no task name (saved by an older train_reward.py); "
            f"make sure it was trained for --task {task_id}"
        )
    if saved == task_id:
        return None
    mismatch = f"the reward model '{rewards.trained_model}' was trained for --task {saved}{labels}"
    mismatch += f", this run is --task {task_id}"
    if not rewards.allow_task_mismatch:
        raise ValueError(
            f"{mismatch}; pass --rewards.trained_model DIR of a reward model trained with train_reward.py --task "
            f"{task_id}, or --rewards.allow_task_mismatch to use it anyway."
        )
    return f"--rewards.allow_task_mismatch: {mismatch}"


def check_policy_inputs(args: PolicyArgs, accelerator: Accelerator) -> None:
    """What --dry_run checks beyond the flags: the reward model's files and task, a local query file, a gold reward
    model's directory, then the tokenizers and every model's context (from the hub: not checked when it is
    unreachable); errors name the flag."""
    if args.task.query_dataset.lower().endswith((".txt", ".jsonl")):
        load_texts(args.task.query_dataset)
    gold = args.rewards.gold_model or ""
    if gold.startswith("reward_model:") and validation.labeler_path(gold) is None:
        raise FileNotFoundError(f"--rewards.gold_model '{gold}': no such directory; pass reward_model:DIR.")
    rm_metadata = None  # a programmatic reward: its spec was checked with the flags
    if (reward_dir := reward_model_dir(args.rewards.trained_model)) is not None:
        rm_metadata = read_reward_metadata(reward_dir)
        files.check_complete_save(reward_dir, "--rewards.trained_model")
        if mismatch := check_reward_model_task(rm_metadata, args.task, args.rewards):
            accelerator.print(f"warning: --rewards.allow_task_mismatch: the reward model's task differs: {mismatch}")
        if warning := check_reward_model_task_name(rm_metadata, args.task_id, args.rewards):
            accelerator.print(f"warning: {warning}")
        for warning in label_warnings(rm_metadata, args.rewards.trained_model):
            accelerator.print(f"warning: {warning}")
    with cli.unchecked_when_offline(accelerator.print, "the tokenizers and context lengths"):
        tokenizer = load_tokenizer(args.base_model)
        task = resolve_truncation(args.task, tokenizer)  # --task.truncate_text is one token of it, the id agrees
        if rm_metadata is not None:
            check_same_tokenizer(
                rm_metadata,
                tokenizer,
                f"the reward model '{args.rewards.trained_model}' (--rewards.trained_model)",
                f"the policy uses tokenizer '{args.base_model}'",
            )
        validation.check_policy_context(dataclasses.replace(args, task=task), tokenizer)


def dry_run(args: PolicyArgs, accelerator: Accelerator) -> list:
    """--dry_run: every input checked (`check_policy_inputs`), nothing trained or written; -> main's empty history."""
    check_policy_inputs(args, accelerator)
    accelerator.print("dry run: inputs checked; nothing trained or written")
    return []


def check_hub_for_push(args: PolicyArgs) -> None:
    """HubUnavailableError before training when --push_to_hub could not upload at the end."""
    if args.run.push_to_hub and not hub_reachable():
        raise HubUnavailableError("--push_to_hub needs the Hugging Face hub, which is unreachable; drop the flag")


def task_flags(differences: dict[str, tuple]) -> str:
    """The `--task.NAME VALUE` flags (quoted for a POSIX shell) that set the saved side of `differences`."""

    def quote(value) -> str:
        text = str(value)
        if "\n" in text:  # bash's $'...' keeps the newline as \n on one line
            return "$'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
        return shlex.quote(text)

    recorded = {name: saved for name, (saved, _) in differences.items() if saved != "<not recorded>"}
    return " ".join(f"--task.{name} {quote(saved)}" for name, saved in recorded.items())


def task_from_reward_model(args: A) -> tuple[A, list[str]]:
    """With --rewards.task_from_reward_model, `args` with the reward model's task settings; -> args, what changed."""
    if not args.rewards.task_from_reward_model:
        return args, []
    if (reward_dir := reward_model_dir(args.rewards.trained_model)) is None:
        raise ValueError(
            f"--rewards.task_from_reward_model needs a reward-model directory, but --rewards.trained_model is the "
            f"programmatic reward '{args.rewards.trained_model}'; drop the flag and pass the --task.* flags."
        )
    saved = read_reward_metadata(reward_dir).get("task")
    if not isinstance(saved, dict):
        raise ValueError(
            f"--rewards.task_from_reward_model: the reward model '{args.rewards.trained_model}' records no task "
            "settings; pass its --task.* flags instead."
        )
    changed = task_differences(saved, args.task)
    fields = {f.name for f in dataclasses.fields(TaskHParams)}
    task = TaskHParams(**{k: v for k, v in saved.items() if k in fields})
    return dataclasses.replace(args, task=task), [f"{k}: {ours!r} -> {saved!r}" for k, (saved, ours) in changed.items()]


class DivergenceWatch:
    """Tells a diverged PPO run by its reduced statistics after each update: objective/kl above `kl_limit`, or no
    response passing the truncation filter after some did, for `patience` updates in a row. Detection only: it reads
    the statistics the run logs and changes nothing the run computes. `diverged` holds the first detection."""

    def __init__(self, args: PolicyArgs):
        self.patience = args.run.divergence_updates
        target = args.rewards.adaptive_kl.target
        self.kl_limit = args.run.divergence_kl if args.run.divergence_kl is not None else 10 * target
        self.kl_source = "--divergence_kl" if args.run.divergence_kl is not None else f"10 x the KL target {target:g}"
        self.lr, self.kl_coef, self.penalty = args.ppo.lr, args.rewards.kl_coef, args.task.penalty_reward_value
        self.high_kl = self.no_pass = 0
        self.passed: tuple[float, int] | None = None  # the highest filter pass rate so far, and its update
        self.diverged: dict | None = None

    def update(self, stats: dict[str, float], update: int) -> str | None:
        """Count update `update`'s statistics; -> the `diverged` line the first time a criterion has held for
        `patience` updates, else None."""
        kl, rate = stats["objective/kl"], stats["debug/filter_pass_rate"]
        self.high_kl = self.high_kl + 1 if kl > self.kl_limit else 0
        self.no_pass = self.no_pass + 1 if rate == 0 and self.passed is not None else 0
        if rate > 0 and (self.passed is None or rate > self.passed[0]):
            self.passed = (rate, update)
        if self.diverged is not None or self.patience <= 0:
            return None
        if self.high_kl >= self.patience:
            reason = (
                f"objective/kl stayed above {self.kl_limit:g} nats ({self.kl_source}) for {self.patience} updates "
                f"(now {kl:.1f}): the policy is far from its reference policy"
            )
        elif self.no_pass >= self.patience:
            reason = (
                f"no response passed the truncation filter for {self.patience} updates (after a pass rate of "
                f"{self.passed[0]:.3f} at update {self.passed[1]}): every score is the penalty "
                f"--task.penalty_reward_value {self.penalty:g}, the policy collapsed"
            )
        else:
            return None
        self.diverged = {"update": update, "reason": reason}
        return (
            f"diverged at update {update}: {reason}. Likely flags: --ppo.lr {self.lr:g} (too high? OAI uses 1e-5 for "
            f"books, 2e-6 for tldr and cnndm), --rewards.kl_coef {self.kl_coef:g}. The run trains on; it ends with "
            f"exit status {cli.DIVERGED_EXIT_CODE} (--allow_divergence: 0)."
        )

    def state_dict(self) -> dict[str, Any]:
        """What carries over to the next update: the counts in a row, the best pass rate, the first detection."""
        return {"high_kl": self.high_kl, "no_pass": self.no_pass, "passed": self.passed, "diverged": self.diverged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The watch as a checkpoint saved it: a resumed run reports the divergence the run had before the kill."""
        self.high_kl, self.no_pass, self.diverged = state["high_kl"], state["no_pass"], state["diverged"]
        self.passed = tuple(state["passed"]) if state["passed"] is not None else None


class PhaseTimer:
    """Time between marks without host syncs: CUDA events on GPU (read after the update's one sync), clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        """Record the current point of the (GPU) timeline."""
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) / 1000 if self.cuda else b - a for a, b in pairs]

    def durations(self) -> dict[str, float]:
        """Seconds of each phase between consecutive marks, as `debug/time/<phase>`."""
        return {f"debug/time/{phase}": s for phase, s in zip(("rollout", "scoring", "optimisation"), self.seconds())}


def sample_table_rows(
    tokenizer: PreTrainedTokenizerBase,
    pad_id: int,
    queries: torch.Tensor,
    responses: torch.Tensor,
    scores: torch.Tensor,
    kl_sums: torch.Tensor,
    kl_coef: float,
    n: int,
) -> list[list]:
    """(query, truncated response, score, kl, total) for the first n episodes; total uses the initial kl_coef as OAI."""

    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L264-L279
    def text(tokens: torch.Tensor) -> str:
        """Decoded tokens without PADs, newlines shown as ⏎ (as OAI prints them)."""
        return tokenizer.decode(tokens[tokens != pad_id].tolist()).replace("\n", "⏎")

    queries, responses, scores, kl_sums = queries[:n].cpu(), responses[:n].cpu(), scores[:n].cpu(), kl_sums[:n].cpu()
    return [
        [
            text(q),
            text(r),
            cli.number(s.item(), 4),
            cli.number(k.item(), 4),
            cli.number(s.item() - kl_coef * k.item(), 4),
        ]
        for q, r, s, k in zip(queries, responses, scores, kl_sums)
    ]


def print_samples(console, tracker: tracking.Tracker, rows: list[list], update: int) -> None:
    """The sample table on the console and in the trackers."""
    columns = ["query", "response (truncated)", "score", "kl", "total"]
    table = Table(*columns, title=f"update {update}", show_lines=True)
    for row in rows:
        table.add_row(*map(str, row))
    console.print(table)
    tracker.log_table("samples", columns, rows, step=update)


class SavedCritic(Protocol):
    """A separate critic (--ppo.value_model) as the plumbing saves it: a module that writes itself to a directory."""

    def save(self, directory: str) -> None: ...


def save_policy(
    policy: PolicyWithValueHead,
    tokenizer: PreTrainedTokenizerBase,
    args: PolicyArgs,
    output_dir: str,
    critic: SavedCritic | None = None,
) -> None:
    """Write the policy (AutoModelForCausalLM-loadable + value_head.safetensors), tokenizer and args.json, and a
    separate critic in critic/; a failed save (e.g. disk full) leaves `output_dir` as it was."""

    def write(path: str) -> None:
        if lora.peft_model_of(policy) is None:
            policy.save(path, tokenizer)
        else:  # the merged model in the same layout, the adapters in adapter/
            lora.save_policy(policy, tokenizer, path)
            tracking.save_args(args, os.path.join(path, lora.ADAPTER_DIR))
        if critic is not None:
            critic.save(os.path.join(path, CRITIC_DIR))
        tracking.save_args(args, path)

    validation.save_atomically(output_dir, write)


RESUME_IGNORED = (
    *resumable.RESUME_IGNORED,
    "log_interval",
    "filter_warning_rate",
    "divergence_updates",
    "divergence_kl",
    "allow_divergence",
    "save_checkpoints",
    "print_samples",
    "push_to_hub",
    "hf_repo_id",
    "compile_sampler",
    "rollout_micro_batch_size",
)
"""settings that may change on --resume: they do not change what the run computes (beyond float rounding)"""


@dataclass
class TrainingState:
    """Everything that carries over from one update to the next, as checkpoints save and restore it."""

    policy: PolicyWithValueHead
    optimizer: torch.optim.Optimizer
    kl_ctl: Any  # train_policy.FixedKLController or AdaptiveKLController
    query_stream: QueryStream
    generator: torch.Generator
    order_rngs: list[np.random.RandomState]
    critic: torch.nn.Module | None = None
    """a separate critic (--ppo.value_model); its Adam moments are in `optimizer`'s state"""
    trained: torch.nn.Module | None = None
    """the module `optimizer` trains (`distributed.data_parallel`'s): the policy, or the policy with the critic"""
    fsdp: bool = False
    """--fsdp: checkpoints hold `trained`'s weights and Adam state as every process's shards (`sharded`), not in
    state.pt, and resume on any number of processes"""
    report: "RunReport | None" = None
    """the run's report, whose divergence watch and summary carry over"""

    def restore(self, resumed: checkpoint.Resumed, accelerator: Accelerator, seed: int) -> None:
        """Weights, Adam moments and step, kl_coef, query position and every RNG as the checkpoint holds them (an
        --fsdp checkpoint of another number of processes: see `restore_other_layout`)."""
        has_critic = "critic" in resumed.shared or resumed.shared.get("sharded_critic", False)
        if (self.critic is None) == has_critic:
            raise ValueError(
                f"checkpoint '{resumed.path}' was written "
                + ("without" if self.critic is not None else "with")
                + " a separate critic (--ppo.value_model), this run has "
                + ("one" if self.critic is not None else "none")
                + "; resume with the checkpoint's --ppo.value_model."
            )
        if self.fsdp != sharded.is_sharded_checkpoint(resumed.meta):
            flags = ("without", "whole in state.pt", "with"), ("with", "sharded", "without")
            written, weights, run = flags[0] if self.fsdp else flags[1]
            raise ValueError(
                f"checkpoint '{resumed.path}' was written {written} --fsdp (its weights {weights}), this run is {run} "
                "it; resume with the checkpoint's --fsdp."
            )
        if self.fsdp:
            sharded.load(resumed.path, self.trained, self.optimizer)
        else:
            self.policy.load_state_dict(resumed.shared["policy"])
            if self.critic is not None:
                self.critic.load_state_dict(resumed.shared["critic"])
            self.optimizer.load_state_dict(resumed.shared["optimizer"])
        self.kl_ctl.value = resumed.shared["kl_coef"]
        if self.report is not None:
            self.report.load_state_dict(resumed.shared.get("report"))
        if self.fsdp and resumed.meta["world_size"] != accelerator.num_processes:
            self.restore_other_layout(resumed, accelerator, seed)
            return
        self.query_stream.load_state_dict(resumed.local["query_stream"])
        devices.restore_rng_states(resumed.local["rng"], self.generator, self.order_rngs)

    def restore_other_layout(self, resumed: checkpoint.Resumed, accelerator: Accelerator, seed: int) -> None:
        """The per-process state of an --fsdp checkpoint that another number of processes wrote: the query stream
        continues at the global position where the writing run stopped (every process had handed out its share of the
        same first N queries; its last process holds the last), and every RNG is reseeded from the seed, this
        process's rank and the step, so sampling and the PPO epochs' orders differ from an uninterrupted run."""
        written = resumed.meta["world_size"]
        last = checkpoint.load_process_state(resumed, written - 1)["query_stream"]
        stream = self.query_stream
        self.query_stream.load_state_dict({**last, "rank": stream.rank, "world_size": stream.world_size})
        devices.reseed_rngs(seed, accelerator.process_index, resumed.step, self.generator, self.order_rngs)
        accelerator.print(
            f"warning: checkpoint '{resumed.path}' was written by {written} processes, this run has "
            f"{accelerator.num_processes}: the weights, Adam moments, kl_coef and query position carry over, but every "
            "process's random numbers are reseeded from --seed, its rank and the step, so the samples and minibatch "
            f"orders differ from those of an uninterrupted {written}-process run"
        )


def check_args(args: PolicyArgs) -> None:
    """Every flag checked before anything loads (`validation.check_policy_args`, the LoRA and --fsdp flags): one
    ValueError line naming the flag."""
    validation.check_policy_args(args)
    lora.check_lora_args(args.lora)
    check_fsdp_flags(args)


def check_fsdp_flags(args: PolicyArgs) -> None:
    """ValueError in one line for a flag that --fsdp cannot run with."""
    if args.run.fsdp and args.lora.rank:
        raise ValueError(
            f"--fsdp with --lora.rank {args.lora.rank}: the LoRA adapters on a frozen trunk are not sharded (their "
            "gradients and Adam moments are small anyway); drop one of the two flags."
        )


def describe_fsdp(processes: int) -> str:
    """--fsdp in the start-up table: what is sharded over how many processes."""
    if processes == 1:
        return (
            "one process: nothing to shard, the model stays whole; checkpoints are sharded ones, which a run on "
            "several processes continues"
        )
    return (
        f"the policy (and a critic), the reference policy and a reward model sharded over {processes} processes; the "
        "policy gathered once per rollout"
    )


def prepare_host_twins(saves: checkpoint.BackgroundSaves, accelerator: Accelerator, *modules: torch.nn.Module) -> None:
    """Before --fsdp shards them: the main process's host twins of `modules` (the policy, a critic), into which each
    save gathers the whole weights for the Hugging Face directories (`save_checkpoint`)."""
    if accelerator.is_main_process:
        for module in modules:
            saves.host_copy(module)


def shard_frozen_models(accelerator: Accelerator, reference: lora.ReferencePolicy, reward: Reward) -> None:
    """--fsdp: the reference policy and a reward model of train_reward.py sharded like the policy, each process holding
    1/N of their weights (a programmatic reward or a classifier stays whole)."""
    distributed.shard_frozen(reference.copy, accelerator)
    if isinstance(reward, RewardModelReward):
        distributed.shard_frozen(reward.model, accelerator)


def host_models(
    saves: checkpoint.BackgroundSaves, state: TrainingState, whole: dict[str, torch.Tensor] | None
) -> tuple[PolicyWithValueHead, torch.nn.Module | None]:
    """Host twins of the policy and the critic holding their current weights (main process, after `saves.wait()`):
    copied from the modules, or from `whole`, the gathered weights of a sharded `trained` module."""
    if whole is None:
        critic = saves.host_copy(state.critic) if state.critic is not None else None
        return saves.host_copy(state.policy), critic
    if state.critic is None:
        return saves.host_copy(state.policy, whole), None
    # PolicyWithCritic: its state_dict's names are the policy's and the critic's behind their attribute names
    parts = {"policy.": {}, "critic.": {}}
    for name, tensor in whole.items():
        prefix = name[: name.index(".") + 1]
        parts[prefix][name.removeprefix(prefix)] = tensor
    return saves.host_copy(state.policy, parts["policy."]), saves.host_copy(state.critic, parts["critic."])


def save_checkpoint(
    args: PolicyArgs,
    accelerator: Accelerator,
    updates: int,
    nupdates: int,
    state: TrainingState,
    tokenizer: PreTrainedTokenizerBase,
    tracker: tracking.Tracker,
    meta: dict,
    start_time: float,
    saves: checkpoint.BackgroundSaves,
) -> None:
    """After `updates` of `nupdates` updates: the training state (every process) in
    OUTPUT_DIR/training_state/step{updates}, then the policy at the top of OUTPUT_DIR and, with --save_checkpoints (not
    after the last update), in checkpoints/update{updates}; all atomic.
    The main process writes them in the background (`saves`) from a copy in host memory taken now. Under --fsdp every
    process first writes its shards of the weights and Adam state into the checkpoint, synchronously (DCP's
    async_save is not used), and the whole weights are gathered onto the main process for the policy's directory."""
    local = {
        "query_stream": state.query_stream.state_dict(),
        "rng": devices.rng_states(state.generator, state.order_rngs),
    }
    tracker.flush()
    # every process takes part in the gathering of a sharded module's whole weights (None elsewhere)
    whole = sharded.full_state_dict(state.trained) if sharded.is_sharded(state.trained) else None
    shared, write_policies = None, None
    if accelerator.is_main_process:
        saves.wait()  # the twin below is still read by the previous write until it ends
        policy, critic = host_models(saves, state, whole)
        del whole
        if state.fsdp:  # the weights and Adam state are in the shards
            weights = {"sharded_critic": critic is not None}
        else:
            weights = {
                "policy": policy.state_dict(),
                **({"critic": critic.state_dict()} if critic is not None else {}),
                "optimizer": checkpoint.to_host(state.optimizer.state_dict()),
            }
        shared = {**weights, "kl_coef": state.kl_ctl.value, "elapsed_time": time.time() - start_time}
        if state.report is not None:
            shared["report"] = state.report.state_dict(state.kl_ctl.value)
        snapshot = args.run.save_checkpoints and updates < nupdates

        def write_policies() -> None:
            save_policy(policy, tokenizer, args, args.run.output_dir, critic)
            if snapshot:
                snapshot_dir = os.path.join(args.run.output_dir, "checkpoints", f"update{updates}")
                save_policy(policy, tokenizer, args, snapshot_dir, critic)

    write_shards = None
    if state.fsdp:

        def write_shards(directory: str) -> None:
            sharded.save(directory, state.trained, state.optimizer)

    checkpoint.save_training_state(
        args.run.output_dir,
        updates,
        accelerator,
        meta,
        shared,
        local,
        args.run.keep_checkpoints,
        saves,
        write_policies,
        write_shards,
    )


def push_to_hub(args: PolicyArgs) -> str:
    """Upload output_dir (policy, value head, tokenizer, args; no logs) to the hub; returns the repo id."""
    from huggingface_hub import HfApi

    api = HfApi()
    name = args.run.hf_repo_id or f"{args.run.exp_name}__{args.task_id}__seed{args.seed}"
    repo_id = api.create_repo(name, exist_ok=True)
    api.upload_folder(folder_path=args.run.output_dir, repo_id=repo_id.repo_id, ignore_patterns=["tb/*", "wandb/*"])
    return repo_id.repo_id


def progress_text(stats: dict[str, float]) -> str:
    """The progress bar's text after an update: its score, KL and (with a gold judge) gold score."""
    text = f"score {cli.number(stats['objective/score'])} kl {cli.number(stats['objective/kl'])}"
    if "objective/gold_score" in stats:
        text += f" gold {cli.number(stats['objective/gold_score'])}"
    return text


def run_summary(
    history: list[dict[str, float]], first_update: int, nupdates: int, kl_coef: float, diverged: dict | None
) -> dict:
    """What this run's updates did, every start value from its first update (the resume point of a resumed run):
    updates run, score and KL at the first and last update, kl_coef at the first update and after the last, and the
    divergence (None: none detected)."""
    first, final = history[0], history[-1]
    return {
        "updates": {"first": first_update, "last": first_update + len(history) - 1, "of": nupdates},
        "resumed": first_update > 0,
        "episodes": int(final["elapsed/episodes"]),
        "time_s": final["elapsed/time"],
        "objective/score": [first["objective/score"], final["objective/score"]],
        "objective/kl": [first["objective/kl"], final["objective/kl"]],
        "kl_coef": [first["objective/kl_coef"], kl_coef],
        "diverged": diverged,
    }


def print_summary(
    console, args: PolicyArgs, summary: dict, hub: str | None, title: str = "policy training done"
) -> None:
    """The closing table: updates run, score and KL at this run's first and last update, kl_coef from its first
    update to after its last (a resumed run's start values are the resume point's), the divergence, where the outputs
    went."""
    updates = summary["updates"]
    span = f"update {updates['first']} -> {updates['last']}"
    count = updates["last"] - updates["first"] + 1
    done = f"{count} of {updates['of']}, resumed at update {updates['first']}" if summary["resumed"] else f"{count}"

    def change(name: str, digits: int = 3) -> str:
        return " -> ".join(cli.number(value, digits) for value in summary[name])

    table = {
        "updates": f"{done} ({summary['episodes']} episodes, {summary['time_s']:.0f} s)",
        f"objective/score ({span})": change("objective/score"),
        f"objective/kl ({span})": change("objective/kl"),
        f"kl_coef (update {updates['first']} -> after {updates['last']})": change("kl_coef", 4),
        **(
            {"diverged": f"at update {summary['diverged']['update']}: {summary['diverged']['reason']}"}
            if summary["diverged"]
            else {}
        ),
        "policy, value head, tokenizer": args.run.output_dir,
        **({"critic": os.path.join(args.run.output_dir, CRITIC_DIR)} if args.ppo.value_model else {}),
        "TensorBoard": f"{args.run.output_dir}/tb",
        "summary": os.path.join(args.run.output_dir, resumable.SUMMARY_FILE),
        **({"hub": hub} if hub else {}),
    }
    cli.print_table(console, title, table)


class RunReport:
    """What a policy run shows and keeps of its updates: the tracker's logs, the history of statistics, the sample
    table every --log_interval updates, the truncation filter's and the divergence's warnings, the progress bar; at
    the end the summary, the upload and the divergence's exit status. Nothing here changes what an update computes."""

    def __init__(
        self,
        args: PolicyArgs,
        accelerator: Accelerator,
        console,
        tracker: tracking.Tracker,
        tokenizer: PreTrainedTokenizerBase,
        nupdates: int,
        first_update: int,
        run_name: str,
    ):
        self.args, self.accelerator, self.console = args, accelerator, console
        self.tracker, self.tokenizer = tracker, tokenizer
        self.nupdates, self.first_update, self.run_name = nupdates, first_update, run_name
        self.progress, self.bar = progress_bar(console, accelerator, nupdates, first_update)
        self.pass_rate_alarm = PassRateAlarm(args.run.filter_warning_rate, args.run.log_interval)
        self.divergence = DivergenceWatch(args)  # detection only: reads the reduced statistics
        self.history: list[dict[str, float]] = []
        self.summary: dict | None = None  # the run's summary once its last update is in (or its checkpoint's)

    def state_dict(self, kl_coef: float) -> dict[str, Any]:
        """What a checkpoint keeps of the report: the divergence watch, and after the last update the summary that
        summary.json gets (a kill before that file is written leaves it in the last checkpoint)."""
        if self.history and self.first_update + len(self.history) == self.nupdates:
            self.summary = run_summary(
                self.history, self.first_update, self.nupdates, kl_coef, self.divergence.diverged
            )
        return {"divergence": self.divergence.state_dict(), "summary": self.summary}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The report as a checkpoint kept it (None: a checkpoint written before reports were kept)."""
        if state is not None:
            self.divergence.load_state_dict(state["divergence"])
            self.summary = state["summary"]

    def __enter__(self) -> "RunReport":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self.progress.__exit__(*exc_info)

    def _warn(self, line: str | None) -> None:
        if line and self.accelerator.is_main_process:
            self.console.print(line, style="bold red", markup=False)

    def update(self, stats: dict[str, float], update: int, samples: tuple[torch.Tensor, ...]) -> None:
        """Log update `update`'s reduced statistics; `samples`: its queries, truncated responses, scores and KL sums,
        for the sample table (spec P19)."""
        self.tracker.log(stats, step=update)
        self.history.append(stats)
        args = self.args
        if update % args.run.log_interval == 0 and self.accelerator.is_main_process:
            pad_id = self.tokenizer.pad_token_id
            rows = sample_table_rows(self.tokenizer, pad_id, *samples, args.rewards.kl_coef, args.run.print_samples)
            print_samples(self.console, self.tracker, rows, update)
        self._warn(self.pass_rate_alarm.update(stats["debug/filter_pass_rate"], update, args.task))
        self._warn(self.divergence.update(stats, update))
        self.progress.update(self.bar, advance=1, description=progress_text(stats))

    def finish(self, kl_coef: float) -> list[dict[str, float]]:
        """OUTPUT_DIR/summary.json and the closing table, the upload with --push_to_hub; cli.Stopped with the
        divergence's exit status when the run diverged (unless --allow_divergence); -> the history."""
        args = self.args
        if self.history:
            self.summary = run_summary(
                self.history, self.first_update, self.nupdates, kl_coef, self.divergence.diverged
            )
        if self.summary is None:  # a run that trained nothing and whose checkpoint keeps no summary
            return self.history
        failed = self.summary["diverged"] is not None and not args.run.allow_divergence
        if self.accelerator.is_main_process:
            resumable.write_summary(args.run.output_dir, self.run_name, self.summary)
            hub = None
            if args.run.push_to_hub:  # a diverged policy is not published
                hub = "not uploaded: the run diverged" if failed else push_to_hub(args)
            print_summary(self.console, args, self.summary, hub)
        stop_if_diverged(args, self.summary, self.accelerator.is_main_process)
        return self.history


def stop_if_diverged(args: PolicyArgs, summary: dict, main_process: bool) -> None:
    """cli.Stopped with the divergence's exit status when the run `summary` tells diverged (unless
    --allow_divergence)."""
    diverged = summary["diverged"]
    if diverged is not None and not args.run.allow_divergence:
        message = (
            f"the run diverged at update {diverged['update']} (see the line then and "
            f"{args.run.output_dir}/{resumable.SUMMARY_FILE}); its policy and checkpoints are saved, from the diverged "
            "run. Lower the flag it names and train again, or pass --allow_divergence to end with status 0."
        )
        raise cli.Stopped(message if main_process else "", cli.DIVERGED_EXIT_CODE)


def report_finished(console, args: PolicyArgs, summary: dict, accelerator: Accelerator) -> list:
    """A finished run, rerun: its closing table from summary.json, every file kept as it is, and the exit status it
    ended with; -> main's empty history (nothing trained)."""
    if accelerator.is_main_process:
        print_summary(console, args, summary, None, "policy training already finished: kept as it is")
    stop_if_diverged(args, summary, accelerator.is_main_process)
    return []
