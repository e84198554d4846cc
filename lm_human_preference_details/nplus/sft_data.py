"""train_sft.py's data: prompt/completion pairs read from a JSONL file or a `datasets` dataset, chat messages rendered
through the tokenizer's chat template, tokenized as prompt ⊕ completion ⊕ EOS (nplus N3, N5) and right-padded with
the PAD, rows longer than --max_length dropped. The tokens the loss counts are train_sft.py's (`with_loss_mask`).

`nplus NX` is docs/nplus-details.md#nx.
"""

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.settings import SftArgs
from lm_human_preference_details.sources import read_utf8_lines

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
