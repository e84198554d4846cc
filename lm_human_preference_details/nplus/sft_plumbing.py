"""What surrounds train_sft.py's algorithm: the checks of its flags, inputs and tokens, the start-up table, the
progress bar, tracking, training-state checkpoints and their restore, the model's save and the closing table. Nothing
here changes what a training step computes.
"""

import os

import torch
from accelerate import Accelerator
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lm_human_preference_details import checkpoint, cli, devices, resumable, validation
from lm_human_preference_details.modeling import check_model_dir
from lm_human_preference_details.nplus.sft_data import SftData, is_hf_dataset
from lm_human_preference_details.settings import SftArgs
from lm_human_preference_details.sizes import SftSizes
from lm_human_preference_details.tokenizer import generation_tokenizer
from lm_human_preference_details.tracking import Tracker, save_args

# ---------------------------------------------------------------- checks, start-up table, progress


def check_args(args: SftArgs) -> None:
    """Every flag whose value makes the run fail late or mean nothing, the inputs' existence, and the output dir."""
    check_model_dir(args.base_model, "--base_model", tokenizer=True)
    if not is_hf_dataset(args.dataset):
        if args.dataset_split != "train":
            raise ValueError(
                f"--dataset_split '{args.dataset_split}' picks a split of an hf: --dataset; a .jsonl file has none: "
                "drop the flag (a .jsonl --eval_split gives held-out rows)."
            )
        for path, flag in ((args.dataset, "--dataset"), (args.eval_split, "--eval_split")):
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(
                    f"{flag} '{path}' does not exist; pass a .jsonl file"
                    + (" or hf:NAME_OR_DIR." if flag == "--dataset" else " (the eval rows of a JSONL --dataset).")
                )
    validation.check_at_least(args.batch_size, 1, "--batch_size", "N+ uses 128")
    validation.check_at_least(args.gradient_accumulation_steps, 1, "--gradient_accumulation_steps")
    validation.check_at_least(args.max_length, 2, "--max_length", "N+'s longest SFT pair has 562 tokens")
    validation.check_positive(args.lr, "--lr", "N+ uses 3e-6")
    validation.check_positive(args.eps, "--eps", "N+ uses 1e-5")
    validation.check_non_negative(args.weight_decay, "--weight_decay", "N+ uses 0.01 (torch AdamW's default)")
    validation.check_at_least(args.eval_interval, 0, "--eval_interval", "0 evaluates only before and after training")
    validation.check_at_least(args.run.save_interval, 0, "--save_interval", "0 saves only at the end")
    if args.eval_interval and args.eval_split is None:
        raise ValueError("--eval_interval needs --eval_split (the rows to evaluate on); pass both or neither.")
    dataset = None if is_hf_dataset(args.dataset) else args.dataset
    validation.check_output_dir(args.run.output_dir, {"--base_model": args.base_model, "--dataset": dataset})


def check_usable(data: SftData, source: str, max_length: int) -> None:
    """ValueError when no pair is left to train on, naming why the pairs were dropped."""
    if len(data.tokens) == 0:
        raise ValueError(
            f"{source} holds no usable pair: {data.too_long} longer than --max_length {max_length} tokens, "
            f"{data.empty} with no token to learn; raise --max_length or check the data."
        )


def check_token_ids(data: SftData, vocab_size: int, pad_id: int, base_model: str) -> None:
    """ValueError when a token id (PAD aside, which is never embedded) lies outside the model's embedding: a
    tokenizer that is not the model's."""
    largest = int(data.tokens.masked_fill(data.tokens == pad_id, 0).max()) if data.tokens.numel() else 0
    if largest >= vocab_size:
        raise ValueError(
            f"the pairs hold token id {largest}, but the model of --base_model '{base_model}' embeds {vocab_size} "
            "tokens: its tokenizer is not the model's; pass a --base_model directory with both."
        )


def print_setup(console, args: SftArgs, sizes: SftSizes, data: SftData, tf32: str) -> None:
    """The start-up table of resolved settings, data and per-process sizes (main process only)."""
    cli.print_table(
        console,
        "supervised fine-tuning (train_sft.py)" + (" - dry run" if args.run.dry_run else ""),
        {
            "base model": args.base_model,
            "dataset": f"{args.dataset} ({args.dataset_split})",
            "pairs": f"{len(data.tokens)} used, {data.too_long} longer than --max_length {args.max_length} and "
            f"{data.empty} with nothing to learn dropped, {sizes.left_over} left over after the last whole batch",
            "tokens": f"longest {int(data.lengths.max())}, {int(data.counted.sum())} counted by the loss "
            f"(--loss_on {args.loss_on})",
            "lr": f"{args.lr:g}, cosine to 0, no warm-up; AdamW eps {args.eps:g}, weight decay {args.weight_decay:g}",
            "seed": f"{args.seed} (process r: seed + 100003 r; data order: seed)",
            "processes": sizes.world,
            "pairs per step": f"{args.batch_size} ({sizes.batch} per process)",
            "micro-batch": f"{sizes.micro} x {args.gradient_accumulation_steps}",
            "steps": f"{sizes.steps} (one epoch)",
            "eval": args.eval_split or "-",
            "TF32": tf32,
            "deterministic": devices.describe_deterministic(),
            "output dir": args.run.output_dir,
        },
    )


def progress_bar(console, accelerator: Accelerator) -> Progress:
    """The training steps' progress bar (main process only), with the step's loss."""
    columns = (
        TextColumn("sft"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
    )
    return Progress(*columns, disable=not accelerator.is_main_process, console=console)


# ---------------------------------------------------------------- tracking, checkpoints, the model's save


def start_tracker(args: SftArgs, accelerator: Accelerator, loop: resumable.CheckpointedLoop) -> tuple[Tracker, dict]:
    """TensorBoard (and wandb) for this run, continuing a resumed run's (`loop.resumed`); -> the tracker and the
    metadata every checkpoint records."""
    tracker, name = resumable.start_tracker(args.run, args.seed, accelerator, loop.resumed, "sft", loop.settings)
    return tracker, {"settings": loop.settings, "run_name": name, "wandb_id": tracker.wandb_id}


def save_checkpoint(
    args: SftArgs,
    accelerator: Accelerator,
    steps: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    run_state: dict,
    generator: torch.Generator,
    tracker: Tracker,
    meta: dict,
    saves: checkpoint.BackgroundSaves,
) -> None:
    """The training state after `steps` steps in OUTPUT_DIR/training_state/step{steps}, atomic, written by the main
    process in the background from a copy in host memory taken now; `run_state`: the first evaluation."""
    shared = None
    if accelerator.is_main_process:
        saves.wait()  # the twin below is still read by the previous write until it ends
        shared = {
            "model": saves.host_copy(model).state_dict(),
            "optimizer": checkpoint.to_host(optimizer.state_dict()),
            **run_state,
        }
    tracker.flush()
    local = {"rng": devices.rng_states(generator)}
    checkpoint.save_training_state(
        args.run.output_dir, steps, accelerator, meta, shared, local, args.run.keep_checkpoints, saves
    )


def restore(resumed: checkpoint.Resumed, model: PreTrainedModel, optimizer, generator: torch.Generator) -> None:
    """Weights, AdamW moments and step, and RNGs as the checkpoint holds them."""
    model.load_state_dict(resumed.shared["model"])
    optimizer.load_state_dict(resumed.shared["optimizer"])
    devices.restore_rng_states(resumed.local["rng"], generator)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: SftArgs) -> None:
    """The fine-tuned causal LM, its tokenizer and args.json in OUTPUT_DIR, atomically: a directory that --base_model
    of train_reward.py and train_policy.py takes. The tokenizer is written as the policy's is (`generation_tokenizer`:
    plain transformers generates with it; `load_tokenizer` gives back the project's PAD)."""
    saved_tokenizer = generation_tokenizer(tokenizer, model.get_input_embeddings().num_embeddings)
    model.generation_config.pad_token_id = saved_tokenizer.pad_token_id

    def write(output_dir: str) -> None:
        model.save_pretrained(output_dir)
        saved_tokenizer.save_pretrained(output_dir)
        save_args(args, output_dir)

    validation.save_atomically(args.run.output_dir, write)


def print_summary(
    console, args: SftArgs, losses: dict[str, float | None], title: str = "supervised fine-tuning done"
) -> None:
    """The closing table: training loss first -> last step, eval loss before -> after, where the outputs went."""

    def change(first: float | None, last: float | None) -> str:
        return "-" if first is None or last is None else f"{cli.number(first)} -> {cli.number(last)}"

    cli.print_table(
        console,
        title,
        {
            "train loss (first -> last step)": change(losses["train_first"], losses["train_last"]),
            "eval loss (before -> after)": change(losses["eval_before"], losses["eval_after"]),
            "model, tokenizer": args.run.output_dir,
            "TensorBoard": f"{args.run.output_dir}/tb",
            "summary": os.path.join(args.run.output_dir, resumable.SUMMARY_FILE),
        },
    )


def report_finished(console, args: SftArgs, summary: dict, accelerator: Accelerator) -> dict:
    """A finished run, rerun: its closing table from summary.json, every file kept as it is; -> main's figures (no
    model: nothing was loaded)."""
    if accelerator.is_main_process:
        print_summary(console, args, summary, "supervised fine-tuning already finished: kept as it is")
    keys = ("train_first", "train_last", "eval_before", "eval_after", "steps")
    return {**{key: summary[key] for key in keys}, "model": None}
