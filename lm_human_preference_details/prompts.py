"""Prompts from the user's data, as the successor recipe builds its queries (nplus N1, N2, N5): the rows of a hub
dataset, a `datasets` directory (`hf:NAME_OR_DIR`) or a JSON Lines file, each made into one query.

A row becomes a prompt in one of three ways: --task.query_template formats its columns; else its `prompt` column is the
prompt (a text, or a chat when it holds a list of messages); else its `messages` column is a chat. A chat is rendered
with the base model's chat template and its generation prompt (add_generation_prompt=True); the template's own control
tokens are encoded as special tokens, while text inside a message stays plain characters, as every data text of the
project is (`tasks.encode_texts`). A prompt longer than query_length is cut as N+ cuts it (nplus N2): its
--task.query_truncate_field (by default the prompt text itself, or a chat's last user message) loses everything from
its last newline on (no newline left: its last character), and the prompt is rendered and encoded again, until it fits.
https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L125-L158
"""

import hashlib
import inspect
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.hub import HubUnavailableError, check_available
from lm_human_preference_details.sources import read_utf8_lines
from lm_human_preference_details.tasks import HF_PREFIX, TaskHParams, encode_texts, template_fields
from lm_human_preference_details.tokenizer import added_bos_id

logger = logging.getLogger(__name__)

FLAG = "--task.query_dataset"
PROMPT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"
STEP_WINDOW = 64
"""characters above the bisected cut that N2's character-dropping phase steps over one at a time"""
_SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")
"""a directory holding one of these was written by `datasets`' save_to_disk"""


# ---------------------------------------------------------------- rows


class PromptRows(Sequence):
    """The rows (dicts of columns) of a prompt source, in file order; `take` reads many in one lookup."""

    def __init__(self, rows: Any, source: str, columns: Sequence[str]):
        self.rows = rows  # a list of dicts (JSON Lines) or a `datasets.Dataset`
        self.source = source
        self.columns = list(columns)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        return self.take([index])[0]

    def take(self, indices: Sequence[int]) -> list[dict]:
        """The rows at `indices`, each a dict of its columns."""
        if isinstance(self.rows, list):
            return [self.rows[int(i)] for i in indices]
        batch = self.rows[[int(i) for i in indices]]  # a dict of columns
        return [dict(zip(batch, values)) for values in zip(*batch.values())]

    def narrowed(self, columns: Sequence[str]) -> "PromptRows":
        """The same rows with only `columns` read (a `datasets.Dataset` then reads nothing else)."""
        if isinstance(self.rows, list):
            return self
        return PromptRows(self.rows.select_columns(list(columns)), self.source, self.columns)


def is_hf_source(query_dataset: str) -> bool:
    """True for --task.query_dataset hf:NAME_OR_DIR."""
    return query_dataset.startswith(HF_PREFIX)


def query_dataset_path(query_dataset: str) -> str:
    """The local path or hub id that --task.query_dataset reads (hf:DIR -> DIR)."""
    return query_dataset.removeprefix(HF_PREFIX)


def read_prompt_jsonl(path: str) -> PromptRows | None:
    """The rows of a .jsonl file whose first row is an object without a `text` field (prompt rows); None for a file
    of OAI's texts (bare strings or `text` objects, `sources.read_jsonl_texts`) or whose first line is not JSON."""
    lines = ((n, line) for n, line in enumerate(read_utf8_lines(path, "query dataset file", FLAG), 1) if line.strip())
    rows = []
    for number, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if not rows:
                return None  # read_jsonl_texts names the bad line
            raise ValueError(f"{FLAG} '{path}' line {number}: invalid JSON ({e}); write one object per line.") from e
        if not rows and (not isinstance(row, dict) or "text" in row):
            return None
        if not isinstance(row, dict):
            raise ValueError(f"{FLAG} '{path}' line {number}: expected a JSON object like row 1, got {line[:60]!r}.")
        rows.append(row)
    return PromptRows(rows, path, list(rows[0])) if rows else None


def load_hf_rows(query_dataset: str, split: str) -> PromptRows:
    """The rows of split `split` of hf:NAME_OR_DIR: a directory written by save_to_disk, a directory of data files
    (as `hf download` leaves a hub dataset) or a hub dataset id (offline and not cached: one line naming the flag)."""
    import datasets

    name = query_dataset_path(query_dataset)
    shown = f"{FLAG} {query_dataset}"
    path = os.path.expanduser(name)
    try:
        if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in _SAVED_DATASET_FILES):
            dataset = datasets.load_from_disk(path)
        elif os.path.isdir(path):
            dataset = datasets.load_dataset(path)
        elif name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise FileNotFoundError(f"{shown}: no such directory; pass hf:DIR of a dataset or hf:OWNER/NAME.")
        else:
            _check_hub_dataset(name, query_dataset)
            dataset = datasets.load_dataset(name)
    except HubUnavailableError:
        raise
    except Exception as e:  # datasets raises many kinds (an empty data file: StopIteration, an empty table: IndexError)
        if str(e).startswith(shown):
            raise
        first = str(e).splitlines()[0] if str(e) else "no rows?"
        raise ValueError(f"{shown} could not be read as a dataset ({type(e).__name__}: {first}).") from e
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(
                f"{shown} has splits {sorted(dataset)} but no '{split}'; pass --task.query_split one of them."
            )
        dataset = dataset[split]
    if len(dataset) == 0:
        raise ValueError(f"{shown} (split '{split}') holds no rows.")
    return PromptRows(dataset, query_dataset, dataset.column_names)


def _check_hub_dataset(name: str, query_dataset: str) -> None:
    """HubUnavailableError in one line naming the flag when the hub dataset `name` cannot be fetched now."""
    try:
        check_available(name, FLAG, kind="dataset", filename="README.md")
    except HubUnavailableError:
        raise HubUnavailableError(
            f"could not fetch dataset '{name}' ({FLAG} {query_dataset}) from the Hugging Face hub: the hub is "
            f"unreachable (offline) and it is not in the local cache. Download it on a machine with internet, e.g. "
            f"`hf download {name} --repo-type dataset --local-dir DIR`, copy DIR here and pass {FLAG} hf:DIR."
        ) from None


# ---------------------------------------------------------------- one prompt


@dataclass(frozen=True)
class _Prompt:
    """One row's prompt: a text (`template` formatted with `values`) or a chat (`messages`), and which part N2 cuts:
    the value `cut` of a text, or the content of message `cut` of a chat."""

    template: str | None
    values: dict[str, str]
    messages: tuple[tuple[str, str], ...] | None
    cut: str | int

    def cut_value(self) -> str:
        """The text that a cut shortens."""
        return self.values[self.cut] if self.messages is None else self.messages[self.cut][1]

    def with_cut_value(self, value: str) -> "_Prompt":
        """The prompt with the text that a cut shortens replaced by `value`."""
        if self.messages is None:
            return replace(self, values={**self.values, self.cut: value})
        messages = list(self.messages)
        messages[self.cut] = (messages[self.cut][0], value)
        return replace(self, messages=tuple(messages))

    def text(self) -> str:
        """The prompt text (a text prompt only)."""
        return self.template.format_map(self.values)

    def conversation(self) -> list[dict[str, str]]:
        """The prompt as chat messages: a text prompt is one user message."""
        if self.messages is None:
            return [{"role": "user", "content": self.text()}]
        return [{"role": role, "content": content} for role, content in self.messages]


def cut_at_last_newline(text: str) -> str:
    """One step of N+'s cut (nplus N2): `text` without its last newline and all after it; no newline: without its last
    character."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L140-L151
    i = text.rfind("\n")
    return text[:i] if i >= 0 else text[:-1]


# ---------------------------------------------------------------- queries of many rows


class PromptQueries:
    """Query tokens of prompt rows (nplus N2, N5), each cut to query_length and right-padded with PAD, and the chat
    messages each came from (`conversation_of`).

    Rows that give no query are dropped and counted (`counts`): a prompt still too long once the part N2 cuts is
    empty ("too_long"), a prompt that encodes to no token ("empty").
    """

    def __init__(self, rows: PromptRows, tokenizer: PreTrainedTokenizerBase, task: TaskHParams, keep: int = 4096):
        self.source = rows.source
        self.tokenizer = tokenizer
        self.query_length = task.query_length
        self.pad_id = tokenizer.pad_token_id
        self.bos = added_bos_id(tokenizer)
        self.template = task.query_template
        self.truncate_field = task.query_truncate_field
        self._chat_checked = False
        self.kind, needed = self._kind(rows.columns)
        self.rows = rows.narrowed(needed)
        if self.kind == MESSAGES_COLUMN:
            self._check_chat_template()
        self.counts = dict(rows=0, cut=0, too_long=0, empty=0)
        self.keep = keep
        self._conversations = _SharedConversations()
        self._warned_unknown = False

    def _kind(self, columns: list[str]) -> tuple[str, list[str]]:
        """How rows become prompts ('template', 'prompt' or 'messages') and the columns read; ValueError naming the flag
        when the rows lack them."""
        if self.template is not None:
            fields = template_fields(self.template)
            missing = [name for name in fields if name not in columns]
            if missing:
                raise ValueError(
                    f"--task.query_template names {missing}, which {FLAG} '{self.source}' does not have; its columns: "
                    f"{columns}."
                )
            return "template", fields
        for column in (PROMPT_COLUMN, MESSAGES_COLUMN):
            if column in columns:
                if column == MESSAGES_COLUMN and self.truncate_field not in (None, column):
                    raise ValueError(
                        f"--task.query_truncate_field '{self.truncate_field}': {FLAG} '{self.source}' holds chats "
                        "(`messages`), whose last user message is cut; pass --task.query_truncate_field None."
                    )
                return column, [column]
        raise ValueError(
            f"{FLAG} '{self.source}' has no `prompt` or `messages` column (its columns: {columns}); name the columns "
            "that make a prompt with --task.query_template, e.g. 'TITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:'."
        )

    def _check_chat_template(self) -> None:
        """ValueError naming the flags when the rows hold chats but the tokenizer has no chat template, or the
        installed transformers cannot keep the messages' text plain (`sanitize_control_tokens`)."""
        self._chat_checked = True
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"{FLAG} '{self.source}' holds chats (lists of role/content messages), but the tokenizer of "
                "--base_model has no chat template to render them; use a chat model's tokenizer, or rows with a "
                "`prompt` text (or a --task.query_template)."
            )
        if "sanitize_control_tokens" not in inspect.signature(self.tokenizer.apply_chat_template).parameters:
            raise ValueError(
                f"{FLAG} '{self.source}' holds chats, but this transformers ({transformers.__version__}) cannot "
                "encode a message's text as plain characters (apply_chat_template's sanitize_control_tokens); "
                "upgrade transformers to 5.21 or later (5.19 and earlier cannot)."
            )

    # ------------------------------------------------------------ rows to prompts

    def _prompt(self, row: dict, index: int) -> _Prompt:
        """The prompt of one row (file row `index`, for errors)."""
        if self.kind == "template":
            values = {name: self._text(row, name, index) for name in template_fields(self.template)}
            if self.truncate_field is not None:
                return _Prompt(self.template, values, None, self.truncate_field)
            return _Prompt("{prompt}", {"prompt": self.template.format_map(values)}, None, "prompt")
        value = row.get(self.kind)
        if isinstance(value, list):
            return self._chat(value, index)
        return _Prompt("{prompt}", {"prompt": self._text(row, self.kind, index)}, None, "prompt")

    def _text(self, row: dict, column: str, index: int) -> str:
        """A text column of one row; ValueError naming the row when it is missing or holds no text (numbers are
        written as text)."""
        if column not in row or row[column] is None:
            raise ValueError(f"{FLAG} '{self.source}': row {index} has no '{column}' (its columns: {sorted(row)}).")
        value = row[column]
        if isinstance(value, (dict, list)):
            raise ValueError(
                f"{FLAG} '{self.source}': row {index} column '{column}' holds {type(value).__name__}, not text."
            )
        return value if isinstance(value, str) else str(value)

    def _chat(self, messages: list, index: int) -> _Prompt:
        """The prompt of one chat row: its messages, the last user message's content to cut."""
        if not self._chat_checked:
            self._check_chat_template()
        where = f"{FLAG} '{self.source}': row {index}"
        if not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(f"{where} is not a chat: expected a non-empty list of {{role, content}} string messages.")
        if messages[-1]["role"] == "assistant":
            raise ValueError(
                f"{where} ends with an 'assistant' message; a prompt ends with the turn the policy answers, so drop "
                "the answer from the rows."
            )
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(f"{where} has no 'user' message to cut when it is too long.")
        if self.truncate_field not in (None, self.kind):
            raise ValueError(
                f"--task.query_truncate_field '{self.truncate_field}': {where} is a chat, whose last user message is "
                "cut; pass --task.query_truncate_field None."
            )
        return _Prompt(None, {}, tuple((m["role"], m["content"]) for m in messages), users[-1])

    # ------------------------------------------------------------ encoding

    def _encode(self, prompts: list[_Prompt]) -> list[list[int]]:
        """Token ids of each prompt: a text as plain characters, a chat through the chat template, the template's
        control tokens as special tokens and the messages' text as plain characters."""
        texts = [p for p in prompts if p.messages is None]
        chats = [p for p in prompts if p.messages is not None]
        encoded_texts = iter(encode_texts(self.tokenizer, [p.text() for p in texts]))
        encoded_chats = iter(self._encode_chats(chats))
        return [next(encoded_texts) if p.messages is None else next(encoded_chats) for p in prompts]

    def _encode_chats(self, chats: list[_Prompt]) -> list[list[int]]:
        """Token ids of chats rendered with the generation prompt, without the BOS the project puts in front of every
        context (`tasks.encode_context_affixes`) when the template writes one too (Llama 3's)."""
        if not chats:
            return []
        encoded = self.tokenizer.apply_chat_template(
            [p.conversation() for p in chats],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
        )
        if self.bos is None:
            return encoded
        return [tokens[1:] if tokens[:1] == [self.bos] else tokens for tokens in encoded]

    def _fit(self, prompt: _Prompt, tokens: list[int]) -> tuple[_Prompt, list[int]] | None:
        """The prompt cut until it encodes to at most query_length tokens (nplus N2), and its tokens; None when the
        part that is cut is empty and the prompt is still too long."""
        # N+ cuts the field at its last "\n" and re-encodes, while the query is longer than its 512 tokens
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L140-L151
        while len(tokens) > self.query_length:
            value = prompt.cut_value()
            if not value:
                return None
            if "\n" not in value:
                return self._fit_by_characters(prompt, value)
            prompt = prompt.with_cut_value(cut_at_last_newline(value))
            tokens = self._encode([prompt])[0]
        return prompt, tokens

    def _fit_by_characters(self, prompt: _Prompt, value: str) -> tuple[_Prompt, list[int]] | None:
        """N2's last phase for a too-long prompt whose part to cut, `value`, holds no newline: N+ drops one character
        at a time, so the result is the longest value[:k] (k < len(value)) whose prompt fits; None when none does.

        Found with O(log n + STEP_WINDOW) encodings instead of up to n (a post without a newline, hundreds of
        characters too long, took seconds): bisection for the longest fitting prefix, then one character at a time
        over the STEP_WINDOW characters above it, as N+'s loop would reach them. The same cut as N+'s loop whenever no
        prefix more than STEP_WINDOW characters longer fits again (token counts grow with the prefix but for a few
        tokens within a word).
        """

        def fitted(k: int) -> tuple[_Prompt, list[int]] | None:
            shorter = prompt.with_cut_value(value[:k])
            tokens = self._encode([shorter])[0]
            return (shorter, tokens) if len(tokens) <= self.query_length else None

        best = fitted(0)
        if best is None:
            return None
        low, high = 0, len(value)  # value[:low] fits, value[:high] does not
        while high - low > 1:
            middle = (low + high) // 2
            found = fitted(middle)
            low, high, best = (middle, high, found) if found is not None else (low, middle, best)
        above = [prompt.with_cut_value(value[:k]) for k in range(min(len(value) - 1, low + STEP_WINDOW), low, -1)]
        for shorter, tokens in zip(above, self._encode(above)):  # longest first, encoded in one batch
            if len(tokens) <= self.query_length:
                return shorter, tokens
        return best

    def queries(
        self, rows: list[dict], indices: Sequence[int], counted: Sequence[bool] | None = None
    ) -> list[list[int] | None]:
        """Each row's query (file rows `indices`): its prompt's tokens, cut to fit, right-padded with PAD to
        query_length; None for a row dropped. `counted`: which rows `counts` counts (default all)."""
        prompts = [self._prompt(row, int(index)) for row, index in zip(rows, indices)]
        counted = [True] * len(prompts) if counted is None else counted
        queries = []
        for prompt, tokens, count in zip(prompts, self._encode(prompts), counted):
            self.counts["rows"] += int(count)
            if len(tokens) > self.query_length:
                fitted = self._fit(prompt, tokens)
                if fitted is None:
                    self.counts["too_long"] += int(count)
                    queries.append(None)
                    continue
                self.counts["cut"] += int(count)
                prompt, tokens = fitted
            if not tokens:
                self.counts["empty"] += int(count)
                queries.append(None)
                continue
            self._remember(tokens, prompt.conversation())
            # DEVIATION (query-padding): N+ left-pads its queries (nplus N2, N5); the project right-pads with its
            # invisible PAD (spec G2: PAD embedded as token 0, masked as a key, positions the exclusive cumsum of the
            # mask), which gives every real token the same inputs and positions as left padding with the
            # exclusive-cumsum position ids that nplus N7 requires, so responses get the same log-probs
            queries.append(tokens + [self.pad_id] * (self.query_length - len(tokens)))
        return queries

    def describe(self) -> str:
        """How many rows gave a query, were cut, or were dropped, in words."""
        c = self.counts
        dropped = c["too_long"] + c["empty"]
        text = f"{c['rows'] - dropped} of {c['rows']} prompts read give a query, {c['cut']} of them cut (nplus N2)"
        if dropped:
            text += (
                f"; {dropped} dropped: {c['too_long']} still longer than --task.query_length {self.query_length} with "
                f"the part that is cut ({self._cut_part()}) empty, {c['empty']} with no token"
            )
        return text

    def fix(self) -> str:
        """What to change when no row gives a query."""
        if not self.counts["too_long"]:
            return "Give the rows prompts with text."
        shorter = " or shorten --task.query_template" if self.template is not None else ""
        return f"Raise --task.query_length{shorter}: the rest of each prompt does not fit even with that part empty."

    def _cut_part(self) -> str:
        """The part of a prompt that N2 cuts, in words naming its flag."""
        if self.truncate_field is not None:
            return f"--task.query_truncate_field '{self.truncate_field}'"
        return "the last user message" if self.kind == MESSAGES_COLUMN else "the whole prompt"

    # ------------------------------------------------------------ conversations

    @staticmethod
    def _key(tokens: Sequence[int]) -> bytes:
        """A short key of a query's tokens (no PAD)."""
        return hashlib.blake2b(json.dumps(list(tokens)).encode(), digest_size=16).digest()

    def _remember(self, tokens: list[int], conversation: list[dict[str, str]]) -> None:
        """Keep the messages of the `keep` queries built last."""
        key = self._key(tokens)
        self._conversations[key] = conversation
        self._conversations.move_to_end(key)
        while len(self._conversations) > self.keep:
            self._conversations.popitem(last=False)

    def conversation_of(self, query_tokens: Sequence[int]) -> list[dict[str, str]] | None:
        """The chat messages of the prompt whose query tokens (PAD dropped) are `query_tokens`; None (with a warning,
        once) when no query of the last `keep` built, by this stream or a copy of it, had them."""
        tokens = [int(t) for t in query_tokens if int(t) != self.pad_id]
        conversation = self._conversations.get(self._key(tokens))
        if conversation is None and not self._warned_unknown:
            self._warned_unknown = True
            logger.warning(
                "no query of the last %d that the query stream of %s '%s' built has these %d tokens: its reward "
                "model reads the query's text instead of its chat messages",
                self.keep,
                FLAG,
                self.source,
                len(tokens),
            )
        return None if conversation is None else [dict(m) for m in conversation]


class _SharedConversations(OrderedDict):
    """Query key -> chat messages, one memory for a query stream and its deep copies (the reward's normalization
    samples the first queries from a copy, and its reward model asks the stream for their messages)."""

    def __deepcopy__(self, memo: dict) -> "_SharedConversations":
        return self
