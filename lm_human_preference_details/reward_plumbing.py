"""The plumbing around train_reward.py's algorithm: the label file's checks, the start-up table, tracking, progress,
checkpoints and the reward model's save. Nothing here changes what a training step computes."""

import dataclasses
import functools
import os

import torch
from accelerate import Accelerator
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import AutoModel

from lm_human_preference_details import checkpoint, cli, devices, resumable, sharded, validation
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import (
    Labels,
    LabelType,
    check_label_tokenizer,
    check_label_tokens,
    get_label_type,
    label_file_task,
)
from lm_human_preference_details.modeling import RewardModel, model_vocab_size
from lm_human_preference_details.settings import RewardArgs, recorded
from lm_human_preference_details.sizes import RewardSizes, ceil_div
from lm_human_preference_details.tasks import resolve_truncation
from lm_human_preference_details.text_prefs import load_labels_or_pairs
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from lm_human_preference_details.tracking import Tracker, save_args


def print_setup(console, args: RewardArgs, sizes: RewardSizes, tf32: str, label_warnings: list[str]) -> None:
    """The start-up table of resolved settings and per-process sizes, and the warnings about the label file's task
    (main process only)."""
    normalize_batches = ceil_div(args.normalize_samples, args.rollout_batch_size)
    cli.print_table(
        console,
        "reward training (train_reward.py)" + (" - dry run" if args.run.dry_run else ""),
        {
            "task": args.task_id,
            "base model": args.base_model,
            "lengths": f"query {args.task.query_length}, response {args.task.response_length} tokens",
            "temperature": args.task.temperature,
            "lr": f"{args.lr:g}, annealed linearly to {args.lr * args.batch_size / args.labels.num_train:g}",
            "seeds": f"seed {args.seed} (process r: seed + 100003 r), data_seed {args.data_seed}",
            "processes": sizes.world,
            "labels per step": f"{args.batch_size} ({sizes.batch} per process)",
            "micro-batch": f"{sizes.micro} x {args.gradient_accumulation_steps}",
            "steps": f"{sizes.steps} (one epoch over {args.labels.num_train} labels)",
            "label type": args.labels.type,
            "normalization samples": f"{normalize_batches} x {args.rollout_batch_size}"
            if args.normalize_samples
            else "0 (normalization skipped)",
            "label file": args.label_dataset,
            "TF32": tf32,
            "deterministic": devices.describe_deterministic(),
            "output dir": args.run.output_dir,
        },
    )
    for warning in label_warnings:
        console.print(f"warning: {warning}", style="bold red", markup=False)


def check_inputs(args: RewardArgs, accelerator: Accelerator) -> None:
    """What --dry_run checks beyond the flags: a local query file, the models' context and the label file (when it
    can be read)."""
    if args.task.query_dataset.lower().endswith((".txt", ".jsonl")):
        load_texts(args.task.query_dataset)
    with cli.unchecked_when_offline(accelerator.print, "the context lengths and the label file"):
        tokenizer = load_tokenizer(args.base_model)
        task = resolve_truncation(args.task, tokenizer)  # --task.truncate_text is one token of it, the id agrees
        validation.check_reward_context(dataclasses.replace(args, task=task), tokenizer)
        rows = len(read_labels(args, tokenizer))
        accelerator.print(f"dry run: every input checked ({rows} label rows); nothing written")


def read_labels(args: RewardArgs, tokenizer=None) -> Labels:
    """The label file, checked against the run: its tokenizer, type, lengths, rows (>= num_train), token ids."""
    tokenizer = tokenizer or load_tokenizer(args.base_model)
    pad_id = tokenizer.pad_token_id
    check_label_tokenizer(args.label_dataset, tokenizer_fingerprint(tokenizer), args.base_model)
    labels = load_labels_or_pairs(
        args.label_dataset,
        args.task.query_length,
        args.task.response_length,
        pad_id,
        args.labels.num_train,
        get_label_type(args.labels.type).name,
        tokenizer,
        eos_id=tokenizer.eos_token_id if args.task.end_at_eos else None,  # responses that end at EOS (nplus N3)
    )
    check_label_tokens(labels, model_vocab_size(args.base_model), pad_id, args.label_dataset)
    return labels


def start_tracker(args: RewardArgs, accelerator: Accelerator, loop: resumable.CheckpointedLoop) -> tuple[Tracker, dict]:
    """TensorBoard (and wandb) for this run, continuing a resumed run's (`loop.resumed`); -> the tracker and the
    metadata every checkpoint records."""
    config = {**recorded(args), "world_size": loop.settings["world_size"]}
    tracker, name = resumable.start_tracker(args.run, args.seed, accelerator, loop.resumed, args.task_id, config)
    return tracker, {"settings": loop.settings, "run_name": name, "wandb_id": tracker.wandb_id}


def print_normalization(print_fn, when: str, result: dict, target: tuple[float, float], debug: bool) -> None:
    """What a normalization measured, against its target (and OAI's check on fresh samples with --debug_normalize)."""
    print_fn(
        f"normalize {when}: mean {cli.number(result['mean'], 4)} +- {cli.number(result['std'], 4)}, target "
        f"{cli.number(target[0], 4)} +- {cli.number(target[1], 4)}"
    )
    if debug:
        check = f"{cli.number(result['debug_mean'], 4)} +- {cli.number(result['debug_std'], 4)}"
        print_fn(f"normalize {when}: after normalize {check}")


def restore(
    resumed: checkpoint.Resumed,
    accelerator: Accelerator,
    args: RewardArgs,
    reward_model,
    optimizer,
    query_stream: QueryStream,
    generator: torch.Generator,
) -> None:
    """Weights, Adam moments and step, query position and RNGs as the checkpoint holds them; under --fsdp the weights
    and moments from its shards (`sharded.load`), also on another number of processes (`query_stream_state`; each
    process's RNGs are then reseeded, with a warning)."""
    if sharded.is_sharded_checkpoint(resumed.meta) != args.run.fsdp:
        written = "with" if not args.run.fsdp else "without"
        raise ValueError(f"checkpoint '{resumed.path}' was written {written} --fsdp: resume it {written} --fsdp.")
    if args.run.fsdp:
        sharded.load(resumed.path, reward_model, optimizer)
    else:
        reward_model.load_state_dict(resumed.shared["model"])
        optimizer.load_state_dict(resumed.shared["optimizer"])
    query_stream.load_state_dict(query_stream_state(resumed, query_stream))
    written = int(resumed.meta["world_size"])
    if written == accelerator.num_processes:
        devices.restore_rng_states(resumed.local["rng"], generator)
        return
    # the RNGs of the processes that wrote it cannot be divided among another number of processes
    devices.reseed_rngs(args.seed, accelerator.process_index, resumed.step, generator)
    accelerator.print(
        f"warning: checkpoint '{resumed.path}' was written by {written} processes, this run has "
        f"{accelerator.num_processes}: the weights, Adam moments, label order and query position carry over, but every "
        "process's random numbers are reseeded from --seed, its rank and the step, so the samples that normalize the "
        f"reward after training differ from those of an uninterrupted {written}-process run"
    )


def query_stream_state(resumed: checkpoint.Resumed, query_stream: QueryStream) -> dict[str, int]:
    """This process's query-stream state in checkpoint `resumed`. On another number of processes (--fsdp only), each
    continues from the global position that the checkpoint's processes had reached together, rank-strided over the
    new number: where a run with that many processes would be, as the normalizations draw the same global batches."""
    saved_world = int(resumed.meta["world_size"])
    if saved_world == query_stream.world_size:
        return resumed.local["query_stream"]
    # the last process of the strided stream took the last query handed out: its position is the global one
    state = checkpoint.load_process_state(resumed, saved_world - 1)["query_stream"]
    return {**state, "rank": query_stream.rank, "world_size": query_stream.world_size}


def progress_bar(console, accelerator: Accelerator) -> Progress:
    """The training steps' progress bar (main process only), with the step's loss."""
    columns = (
        TextColumn("reward"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
    )
    return Progress(*columns, disable=not accelerator.is_main_process, console=console)


def save_checkpoint(
    args: RewardArgs,
    accelerator: Accelerator,
    steps: int,
    reward_model: RewardModel,
    optimizer: torch.optim.Optimizer,
    run_state: dict,
    query_stream: QueryStream,
    generator: torch.Generator,
    tracker: Tracker,
    meta: dict,
    saves: checkpoint.BackgroundSaves,
) -> None:
    """The training state after `steps` steps (every process) in OUTPUT_DIR/training_state/step{steps}, atomic;
    `run_state`: the label order, the normalizations and the first evaluation. The main process writes it in the
    background (`saves`) from a copy in host memory taken now; under --fsdp every process first writes its shards of
    the weights and Adam moments (`sharded.save`), which state.pt then lacks."""
    shared = None
    if accelerator.is_main_process:
        saves.wait()  # the twin below is still read by the previous write until it ends
        shared = {}  # under --fsdp the weights and Adam moments are in the shards
        if not args.run.fsdp:
            shared["model"] = saves.host_copy(reward_model).state_dict()
            shared["optimizer"] = checkpoint.to_host(optimizer.state_dict())
        shared["permutation"] = checkpoint.to_host(run_state["permutation"])
        shared["normalization"] = checkpoint.to_host(run_state["normalization"])
        shared["eval_before"] = run_state["eval_before"]
    local = {"query_stream": query_stream.state_dict(), "rng": devices.rng_states(generator)}
    tracker.flush()
    # under --fsdp every process writes its shards of the weights and Adam moments
    shards = functools.partial(sharded.save, module=reward_model, optimizer=optimizer) if args.run.fsdp else None
    run = args.run
    checkpoint.save_training_state(
        run.output_dir, steps, accelerator, meta, shared, local, run.keep_checkpoints, saves, write_shards=shards
    )


def whole_reward_model(reward_model: RewardModel) -> RewardModel | None:
    """`reward_model` itself, or when FSDP2 shards it, a copy with its whole weights on process 0 (None elsewhere,
    where nothing is saved); every process must call it."""
    if not sharded.is_sharded(reward_model):
        return reward_model
    state = sharded.full_state_dict(reward_model)
    if not state:
        return None
    with torch.device("meta"):  # the weights come from `state`: nothing allocated or initialized twice
        trunk = AutoModel.from_config(reward_model.trunk.config, dtype=torch.float32)
        whole = RewardModel(trunk, reward_model.bos_token_id)
    whole.load_state_dict(state, strict=True, assign=True)
    return whole.eval()


def save_reward_model(
    reward_model: RewardModel,
    tokenizer,
    args: RewardArgs,
    label_type: LabelType,
    evals: tuple[dict | None, dict | None],
    label_warnings: list[str],
) -> None:
    """The reward model with its metadata (tokenizer, task name and settings, label file and the warnings about its
    task, held-out figures), its tokenizer and args.json in OUTPUT_DIR, atomically."""
    eval_before, eval_after = evals
    metadata = {
        "base_model": args.base_model,
        "tokenizer": args.base_model,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "task_name": args.task_id,
        "task": dataclasses.asdict(args.task),
        "label_dataset": args.label_dataset,
        "label_type": label_type.name,
        "label_task_checked": label_file_task(args.label_dataset)[0] is not None,
        "label_warnings": label_warnings,
        "num_train": args.labels.num_train,
        "eval_before": eval_before,
        "eval_after": eval_after,
    }

    def write(output_dir: str) -> None:
        reward_model.save(output_dir, metadata)
        tokenizer.save_pretrained(output_dir)
        save_args(args, output_dir)

    validation.save_atomically(args.run.output_dir, write)


def run_summary(reward_model: RewardModel, label_type: LabelType, heldout: int, evals, norms: dict) -> dict:
    """What a finished reward run shows and summary.json keeps: held-out rows and figures before and after training,
    the normalizations, gain and bias."""
    eval_before, eval_after = evals
    return {
        "label_type": label_type.name,
        "heldout_rows": heldout,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "normalization": norms,
        "gain": reward_model.gain.item(),
        "bias": reward_model.bias.item(),
    }


def print_summary(console, args: RewardArgs, summary: dict, title: str = "reward training done") -> None:
    """The closing table: held-out rows and figure before -> after training, gain and bias, where the outputs went."""
    eval_before, eval_after = summary["eval_before"], summary["eval_after"]
    held_out = "accuracy" if get_label_type(summary["label_type"]).label_field == "best" else "loss"
    cli.print_table(
        console,
        title,
        {
            "held-out rows": summary["heldout_rows"],
            f"held-out {held_out}": f"{cli.number(eval_before[held_out])} -> {cli.number(eval_after[held_out])}"
            if eval_after
            else "-",
            "gain, bias": f"{cli.number(summary['gain'], 4)}, {cli.number(summary['bias'], 4)}",
            "reward model, tokenizer": args.run.output_dir,
            "TensorBoard": f"{args.run.output_dir}/tb",
            "summary": os.path.join(args.run.output_dir, resumable.SUMMARY_FILE),
        },
    )


def report_finished(console, args: RewardArgs, summary: dict, accelerator: Accelerator) -> dict:
    """A finished run, rerun: its closing table from summary.json, every file kept as it is; -> main's figures (no
    model: nothing was loaded)."""
    if accelerator.is_main_process:
        print_summary(console, args, summary, "reward training already finished: kept as it is")
    keys = ("eval_before", "eval_after", "normalization", "gain", "bias")
    return {**{key: summary[key] for key in keys}, "label_indices": None, "model": None}
