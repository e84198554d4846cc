"""train_sft.py's data and plumbing: prompt/completion pairs read from a JSONL file or a `datasets` dataset, chat
messages rendered through the tokenizer's chat template, tokenized with EOS appended and right-padded with the PAD
(nplus N3, N5), the start-up table, tracking, checkpoints and the model's save. What the loss counts, the data order
and the lr schedule are train_sft.py's.

`nplus NX` is docs/nplus-details.md#nx.
"""

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lm_human_preference_details import checkpoint, cli, validation
from lm_human_preference_details.devices import describe_deterministic
from lm_human_preference_details.modeling import check_model_dir
from lm_human_preference_details.settings import SftArgs
from lm_human_preference_details.sizes import SftSizes
from lm_human_preference_details.sources import read_utf8_lines
from lm_human_preference_details.tokenizer import generation_tokenizer
from lm_human_preference_details.tracking import Tracker, save_args

HF_PREFIX = "hf:"
"""--dataset hf:NAME_OR_DIR: a hub dataset id or a directory written by `datasets`' save_to_disk"""
MESSAGES = "messages"
"""the column (JSONL field) of chat rows: a list of {"role", "content"}, the last one the assistant's completion"""


# ---------------------------------------------------------------- reading pairs


@dataclass
class Pairs:
    """Prompt/completion texts, row by row; `chat[i]`: row i was rendered by the chat template (its prompt then ends
    with the template's generation prompt and is not stripped, and the template's own special tokens are in it)."""

    prompts: list[str]
    completions: list[str]
    chat: list[bool]
    source: str
    """the dataset and split, for messages"""


def is_hf_dataset(dataset: str) -> bool:
    """Whether --dataset names a `datasets` dataset (hf:NAME_OR_DIR) rather than a JSONL file."""
    return dataset.startswith(HF_PREFIX)


def render_chat(messages: Any, tokenizer: PreTrainedTokenizerBase, where: str) -> tuple[str, str]:
    """The prompt (every message but the last, with the template's generation prompt) and the completion (the rest of
    the whole conversation's rendering) of a chat row; ValueError naming `where` for a row that is no conversation
    ending in the assistant's message, or one the template renders with another prompt."""
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise ValueError(f"{where}: '{MESSAGES}' must be a list of {{'role', 'content'}} objects.")
    if messages[-1].get("role") != "assistant":
        raise ValueError(
            f"{where}: the last message has role {messages[-1].get('role')!r}; it must be the assistant's completion."
        )
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    if not whole.startswith(prompt):
        raise ValueError(
            f"{where}: the chat template renders the conversation without its prompt part (with the generation "
            "prompt) in front, so the completion cannot be told apart; use prompt/completion rows instead."
        )
    return prompt, whole[len(prompt) :]


def _check_chat_template(tokenizer: PreTrainedTokenizerBase, base_model: str, source: str) -> None:
    """ValueError when chat rows meet a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--dataset {source} holds '{MESSAGES}' rows, but the tokenizer of --base_model '{base_model}' has no "
            "chat template; pass a --base_model whose tokenizer has one, or prompt/completion rows."
        )


def _jsonl_rows(path: str, flag: str) -> list[tuple[int, dict]]:
    """(line number, object) of every non-blank line of a JSONL file; one-line errors naming `flag`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} '{path}' does not exist; pass a .jsonl file.")
    rows = []
    for lineno, line in enumerate(read_utf8_lines(path, "SFT dataset file", flag), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} {path} line {lineno}: invalid JSON ({e}); write one object per line.") from e
        if not isinstance(row, dict):
            raise ValueError(f"{flag} {path} line {lineno}: expected a JSON object, got {line.strip()[:80]!r}.")
        rows.append((lineno, row))
    return rows


def _pairs_from_rows(
    rows: list[tuple[Any, dict]], columns: tuple[str, str], tokenizer, base_model: str, source: str
) -> Pairs:
    """Pairs of rows that hold both columns (texts) or `messages`; ValueError naming the first row that holds
    neither."""
    prompt_column, completion_column = columns
    pairs = Pairs([], [], [], source)
    for where, row in rows:
        if prompt_column in row and completion_column in row:
            prompt, completion = row[prompt_column], row[completion_column]
            if not (isinstance(prompt, str) and isinstance(completion, str)):
                raise ValueError(f"{source} {where}: '{prompt_column}' and '{completion_column}' must be texts.")
            chat = False
        elif MESSAGES in row:
            _check_chat_template(tokenizer, base_model, source)
            prompt, completion = render_chat(row[MESSAGES], tokenizer, f"{source} {where}")
            chat = True
        else:
            raise ValueError(
                f"{source} {where} has neither '{prompt_column}' + '{completion_column}' (--prompt_column, "
                f"--completion_column) nor '{MESSAGES}'; its fields: {', '.join(sorted(row)) or 'none'}."
            )
        pairs.prompts.append(prompt)
        pairs.completions.append(completion)
        pairs.chat.append(chat)
    return pairs


def _hf_rows(dataset: str, split_name: str, split_flag: str) -> tuple[list[str], Any]:
    """The column names and rows of split `split_name` of hf:NAME_OR_DIR (a save_to_disk directory or a hub id)."""
    import datasets  # only runs that read a `datasets` dataset pay for its import

    name = dataset[len(HF_PREFIX) :]
    if os.path.isdir(name):
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.DatasetDict):
            if split_name not in loaded:
                raise ValueError(
                    f"{split_flag} '{split_name}' is not a split of --dataset {dataset}; its splits: "
                    f"{', '.join(loaded)}."
                )
            loaded = loaded[split_name]
    else:
        try:
            loaded = datasets.load_dataset(name, split=split_name)
        except (OSError, ValueError, KeyError) as e:  # offline, unknown id, unknown split
            raise ValueError(
                f"--dataset {dataset} ({split_flag} '{split_name}') could not be loaded: {str(e).splitlines()[0]}"
            ) from e
    return loaded.column_names, loaded


def read_pairs(args: SftArgs, tokenizer: PreTrainedTokenizerBase, evaluation: bool = False) -> Pairs:
    """The prompt/completion pairs of --dataset (split --dataset_split of hf:NAME_OR_DIR, or the JSONL file), or with
    `evaluation` of --eval_split (a split of hf:NAME_OR_DIR, or a second JSONL file); every problem one line naming
    the flag."""
    columns = (args.prompt_column, args.completion_column)
    if not is_hf_dataset(args.dataset):
        flag, path = ("--eval_split", args.eval_split) if evaluation else ("--dataset", args.dataset)
        rows = [(f"line {lineno}", row) for lineno, row in _jsonl_rows(path, flag)]
        return _pairs_from_rows(rows, columns, tokenizer, args.base_model, f"{flag} {path}")
    split_flag, split_name = (
        ("--eval_split", args.eval_split) if evaluation else ("--dataset_split", args.dataset_split)
    )
    names, rows = _hf_rows(args.dataset, split_name, split_flag)
    source = f"--dataset {args.dataset} split '{split_name}'"
    if not set(columns) <= set(names) and MESSAGES not in names:
        flag, missing = next(
            (flag, c) for c, flag in zip(columns, ("--prompt_column", "--completion_column")) if c not in names
        )
        raise ValueError(f"{flag} '{missing}' is not a column of {source}; its columns: {', '.join(names)}.")
    keep = list(columns) if set(columns) <= set(names) else [MESSAGES]
    table = rows.select_columns(keep).to_dict()
    rows = [(f"row {i}", {c: table[c][i] for c in keep}) for i in range(len(rows))]
    return _pairs_from_rows(rows, columns, tokenizer, args.base_model, source)


# ---------------------------------------------------------------- tokens


@dataclass
class TokenizedPairs:
    """Pairs as tokens, right-padded with PAD (nplus N5)."""

    tokens: torch.Tensor
    """(N, T) int64: prompt ⊕ completion ⊕ EOS, then PAD"""
    lengths: np.ndarray
    """(N,) real tokens of each row"""
    prompt_tokens: list[int]
    """tokens of each row's prompt part"""
    too_long: int
    """pairs dropped for being longer than --max_length tokens"""

    def select(self, rows: list[int]) -> "TokenizedPairs":
        """These rows, in this order, padded to the longest of them."""
        width = int(self.lengths[rows].max()) if rows else 1
        tokens = self.tokens[rows, :width]
        return TokenizedPairs(tokens, self.lengths[rows], [self.prompt_tokens[i] for i in rows], self.too_long)


@dataclass
class SftData:
    """Tokenized pairs and the tokens the loss counts (train_sft.py's `with_loss_mask`)."""

    tokens: torch.Tensor
    """(N, T) int64: prompt ⊕ completion ⊕ EOS, then PAD"""
    loss_mask: torch.Tensor
    """(N, T) bool: the tokens the loss predicts (never position 0, never a PAD; no prompt token under
    --loss_on completion)"""
    lengths: np.ndarray
    """(N,) real tokens of each row"""
    counted: np.ndarray
    """(N,) tokens of each row that the loss counts"""
    too_long: int
    """pairs dropped for being longer than --max_length tokens"""
    empty: int
    """pairs dropped because the loss counts none of their tokens"""


def pair_texts(pairs: Pairs) -> tuple[list[str], list[int]]:
    """The text of each row and the characters of its prompt part: `query.strip() + completion` (nplus N5), a chat
    row's rendering as it is."""
    # SFD: query.strip() + reference, re-encoded as one text
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L202-L212
    prompts = [p if chat else p.strip() for p, chat in zip(pairs.prompts, pairs.chat)]
    return [p + c for p, c in zip(prompts, pairs.completions)], [len(p) for p in prompts]


def encode_rows(pairs: Pairs, tokenizer: PreTrainedTokenizerBase) -> tuple[list[list[int]], list[int]]:
    """Token ids of each row with EOS appended (nplus N3) and the number of its prompt tokens. Prompt/completion rows
    get the special tokens the tokenizer adds (Llama's BOS, as the policy's queries); a chat template writes its own."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer of --base_model has no EOS token; SFT appends EOS to every completion.")
    texts, prompt_chars = pair_texts(pairs)
    ids: list[list[int]] = [[] for _ in texts]
    prompt_tokens = [0] * len(texts)
    for chat in (False, True):
        rows = [i for i, c in enumerate(pairs.chat) if c == chat]
        if not rows:
            continue
        encoded = tokenizer(
            [texts[i] for i in rows], add_special_tokens=not chat, return_offsets_mapping=True, verbose=False
        )
        for i, row_ids, offsets in zip(rows, encoded["input_ids"], encoded["offset_mapping"]):
            # a prompt token lies wholly within the prompt's characters; one that reaches into the completion counts
            # as the completion's
            prompt_tokens[i] = sum(end <= prompt_chars[i] for _, end in offsets)
            # EOS appended to every completion, unless the text already ends in it (nplus N3)
            # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L186-L199
            ids[i] = row_ids + [tokenizer.eos_token_id] if row_ids[-1:] != [tokenizer.eos_token_id] else row_ids
    return ids, prompt_tokens


def tokenize_pairs(pairs: Pairs, tokenizer: PreTrainedTokenizerBase, max_length: int) -> TokenizedPairs:
    """Rows right-padded with PAD (nplus N5) to the longest row kept. A row longer than `max_length` tokens is dropped,
    not cut (counted in `too_long`): cutting would drop its EOS or its prompt's start, and N+'s data never holds one
    (its lengths are asserted when the set is built, nplus N4)."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L411-L418
    ids, prompt_tokens = encode_rows(pairs, tokenizer)
    kept = [i for i, row in enumerate(ids) if len(row) <= max_length]
    lengths = np.array([len(ids[i]) for i in kept], dtype=np.int64)
    width = int(lengths.max()) if kept else 1
    tokens = torch.full((len(kept), width), tokenizer.pad_token_id, dtype=torch.long)
    for row, i in enumerate(kept):
        tokens[row, : len(ids[i])] = torch.tensor(ids[i])
    return TokenizedPairs(tokens, lengths, [prompt_tokens[i] for i in kept], too_long=len(ids) - len(kept))


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
            "deterministic": describe_deterministic(),
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


def start_tracker(args: SftArgs, accelerator: Accelerator, loop: checkpoint.CheckpointedLoop) -> tuple[Tracker, dict]:
    """TensorBoard (and wandb) for this run, continuing a resumed run's (`loop.resumed`); -> the tracker and the
    metadata every checkpoint records."""
    tracker, name = checkpoint.start_tracker(args.run, args.seed, accelerator, loop.resumed, "sft", loop.settings)
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
    local = {"rng": checkpoint.rng_states(generator)}
    checkpoint.save_training_state(
        args.run.output_dir, steps, accelerator, meta, shared, local, args.run.keep_checkpoints, saves
    )


def restore(resumed: checkpoint.Resumed, model: PreTrainedModel, optimizer, generator: torch.Generator) -> None:
    """Weights, AdamW moments and step, and RNGs as the checkpoint holds them."""
    model.load_state_dict(resumed.shared["model"])
    optimizer.load_state_dict(resumed.shared["optimizer"])
    checkpoint.restore_rng_states(resumed.local["rng"], generator)


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


def print_summary(console, args: SftArgs, losses: dict[str, float | None]) -> None:
    """The closing table: training loss first -> last step, eval loss before -> after, where the outputs went."""

    def change(first: float | None, last: float | None) -> str:
        return "-" if first is None or last is None else f"{cli.number(first)} -> {cli.number(last)}"

    cli.print_table(
        console,
        "supervised fine-tuning done",
        {
            "train loss (first -> last step)": change(losses["train_first"], losses["train_last"]),
            "eval loss (before -> after)": change(losses["eval_before"], losses["eval_after"]),
            "model, tokenizer": args.run.output_dir,
            "TensorBoard": f"{args.run.output_dir}/tb",
        },
    )
