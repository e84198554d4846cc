"""OAI's tasks: query/response settings, the launch.py presets, query construction, context formatting, truncation.

The counterpart of lm_human_preferences/lm_tasks.py (task hparams, postprocess and filter functions, query formatter)
plus the per-text query construction of language/datasets.py.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py
"""

import dataclasses
import math
import string
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.devices import to_device
from lm_human_preference_details.tokenizer import added_bos_id


@dataclass(kw_only=True)
class TaskHParams:
    """Query/response settings of one task; class defaults are OAI's TaskHParams, the experiments' values are TASKS."""

    # OAI's defaults: query/response lengths and dataset are required (None), start '.', no end, no truncation
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L11-L34
    query_length: int
    """query tokens, right-padded with PAD (OAI launch.py#L9)"""
    query_dataset: str
    """books | tldr | cnndm (OAI's files, else HF stand-ins) or a local .txt (line per text) / .jsonl (launch.py#L10);
    or prompts (nplus N1, N2): hf:NAME_OR_DIR (a hub dataset or a `datasets` directory) or a .jsonl of objects with
    `prompt` (text) or `messages` (a chat) or the columns of --task.query_template"""
    query_split: str = "train"
    """split of --task.query_dataset that queries come from (books, tldr, cnndm or an hf: dataset)"""
    query_template: str | None = None
    """prompt sources: a format string over each row's columns (nplus N2), e.g. N+'s TL;DR query
    'SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:'; None: the `prompt` column, or the
    `messages` chat"""
    query_truncate_field: str | None = None
    """prompt sources: the column cut at its last newline (no newline: its last character), re-encoding each time,
    while the prompt is longer than query_length (nplus N2); None: the prompt text itself, or a chat's last user
    message"""
    query_prefix: str = ""
    """text put before the query for the policy only, never the reward model (launch.py#L22; lm_tasks.py#L68-L80)"""
    query_suffix: str = ""
    """text put after the query for the policy only, e.g. '\\n\\nTL;DR:' (launch.py#L23, #L37)"""
    start_text: str | None = "."
    """a query starts right after the first occurrence of this single-token text; None: no trimming (launch.py#L12)"""
    end_text: str | None = None
    """a query ends at the last occurrence of this single-token text; None: no trimming (launch.py#L13)"""
    response_length: int
    """sampled response tokens per query, fixed length, no EOS stop (launch.py#L11)"""
    truncate_token: int | None = None
    """response tokens after its first occurrence at index >= truncate_after become PAD: a token id of the base
    model's tokenizer (OAI's 13 = GPT-2's '.', launch.py#L14); set from --task.truncate_text when that is set"""
    truncate_text: str | None = None
    """--task.truncate_token as text, resolved once to the base model's own id; must be one token (the presets: '.'
    and '\\n', OAI's ids 13 and 198 in GPT-2). Passing only one of the two flags unsets the other's preset value"""
    truncate_after: int = 0
    """responses must contain truncate_token at index >= this to pass the filter (launch.py#L15)"""
    penalty_reward_value: float = -1.0
    """score given to responses that fail the filter, replacing the reward model's (lm_tasks.py#L32); added to it
    with --task.penalty_mode subtract"""
    penalty_mode: Literal["replace", "subtract"] = "replace"
    """what a response failing the filter scores: replace = penalty_reward_value (OAI and the successor recipe, nplus
    N19); subtract = the reward model's score + penalty_reward_value (TRL's missing_eos_penalty=1 is
    --task.penalty_reward_value -1 --task.penalty_mode subtract)"""
    end_at_eos: bool = False
    """responses end at their first EOS (the successor recipe, nplus N19-N21): truncation at the tokenizer's EOS with
    truncate_after 0 (so a response passes the filter iff it holds an EOS), PPO's log-probs, values, advantages and
    losses masked after it and the score added one step after it; off: OAI's fixed-length responses, no masks"""
    temperature: float = 1.0
    """sampling temperature of the policy and reference policy, also applied to log-probs (OAI task.policy.temperature,
    lm_tasks.py#L13; launch.py#L17)"""


# launch.py's task presets; copy with dataclasses.replace before changing a field
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L8-L47
_BOOKS = dict(query_length=64, query_dataset="books", response_length=24, start_text=".", end_text=".")
# DEVIATION (truncate-by-text): the truncation token is named by its text ("." and "\n", OAI's ids 13 and 198 in GPT-2's
# vocabulary), resolved per tokenizer (resolve_truncation), so that it means the same token with other base models'
# tokenizers
_BOOKS.update(truncate_text=".", truncate_after=16, temperature=0.7)
_SUMMARIZE = dict(query_length=500, response_length=75, start_text=None, truncate_text="\n", truncate_after=55)
TASKS: dict[str, TaskHParams] = {
    "sentiment": TaskHParams(**_BOOKS),
    "descriptiveness": TaskHParams(**_BOOKS),
    # tldr binds no end_text, so TaskHParams' default None applies (lm_tasks.py#L24)
    "tldr": TaskHParams(**_SUMMARIZE, query_dataset="tldr", query_suffix="\n\nTL;DR:", end_text=None, temperature=0.7),
    "cnndm": TaskHParams(
        **_SUMMARIZE,
        query_dataset="cnndm",
        query_prefix="Article:\n\n",
        query_suffix="\n\nTL;DR:",
        end_text="\n",
        temperature=0.5,
    ),
}

# the successor recipe's TL;DR task (docs/nplus-details.md): the filtered Reddit posts in N+'s query format, cut at the
# post's last newline to 512 tokens (nplus N1, N2), 53 sampled tokens at T 0.7, responses that end at their first EOS
# and score -1 without one (nplus N4, N17, N19)
# https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L68-L81
NPLUS_TASKS: dict[str, TaskHParams] = {
    "nplus_tldr": TaskHParams(
        query_length=512,
        query_dataset="hf:vwxyzjn/summarize_from_feedback_tldr_3_filtered",
        query_template="SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:",
        query_truncate_field="post",
        start_text=None,
        response_length=53,
        end_at_eos=True,
        penalty_reward_value=-1.0,
        temperature=0.7,
    ),
}

TASK_GOALS: dict[str, str] = {
    "sentiment": "positive sentiment",
    "descriptiveness": "physical descriptiveness",
    "tldr": "summary quality",
    "cnndm": "summary quality",
    "nplus_tldr": "summary quality",
}
"""what the judges of each --task measure: continuations of positive sentiment or of physically descriptive language,
summaries of Reddit posts or news articles (Ziegler et al. 2019, arXiv:1909.08593, sections 3.1 and 3.2); a judge that
measures another thing (VADER: sentiment) says nothing about how well a run does its task"""


FLOAT32_EXP_UNDERFLOW = -math.log(torch.finfo(torch.float32).tiny)
"""87.34: exp(-x) of a larger x is below float32's smallest normal number, so a softmax term that far below the top
logit is (nearly) 0"""
MIN_TEMPERATURE = 1 / FLOAT32_EXP_UNDERFLOW
"""0.01145: the lowest --task.temperature accepted. Below it a logit gap of 1 nat (between likely tokens, common)
exceeds FLOAT32_EXP_UNDERFLOW once divided by the temperature: the softmax is one-hot in float32, sampling is greedy
and the log-probs of every other token (and the KL, which grows as 1/temperature) are meaningless"""


def check_task(task: TaskHParams, response_filter: bool = True) -> None:
    """ValueError naming the --task.* flag whose value makes every query or response invalid or the run meaningless;
    `response_filter`: the run scores responses through the truncation filter (reward training does not)."""
    check_prompt_fields(task)
    for name in ("query_length", "response_length"):
        value = getattr(task, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--task.{name} must be an integer >= 1, got {value!r}; OAI's books tasks use 64 and 24.")
    if not (isinstance(task.temperature, (int, float)) and 0 < task.temperature < float("inf")):
        raise ValueError(f"--task.temperature must be a finite number > 0, got {task.temperature!r}; OAI uses 0.7.")
    if task.temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"--task.temperature {task.temperature:g} makes the softmax one-hot: the logits are divided by it, so a "
            f"logit gap of 1 nat becomes {1 / task.temperature:.3g} nats, past the {FLOAT32_EXP_UNDERFLOW:.1f} at "
            "which exp() underflows float32; every sample would be the most likely token (best-of-N samples identical) "
            "and log-probs and KL grow as 1/temperature. Pass --task.temperature "
            f"{math.ceil(MIN_TEMPERATURE * 1e4) / 1e4:g} or more (OAI uses 0.7)."
        )
    if response_filter and (task.truncate_token is not None or task.truncate_text):
        if task.truncate_token is not None and task.truncate_token < 0:
            raise ValueError(f"--task.truncate_token must be a token id >= 0 or None, got {task.truncate_token}.")
        if not 0 <= task.truncate_after < task.response_length:
            raise ValueError(
                f"no response can pass the filter: --task.truncate_after {task.truncate_after} is not in [0, "
                f"--task.response_length {task.response_length}), so every score would be the penalty; lower "
                "truncate_after or pass --task.truncate_token None."
            )


HF_PREFIX = "hf:"
"""--task.query_dataset hf:NAME_OR_DIR: prompts from a hub dataset or a `datasets` directory"""
_PROMPT_FIELDS = ("query_template", "query_truncate_field")
"""fields that only prompt sources (hf:, .jsonl of objects) read"""


def template_fields(template: str) -> list[str]:
    """The column names a --task.query_template formats, in order; ValueError naming the flag when it is not a format
    string of plain names ('{post}', not '{0}', '{}' or '{row.post}')."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"--task.query_template {template!r} is not a format string ({e}); write {{column}}.") from e
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise ValueError(
            f"--task.query_template {template!r} names {bad!r}; name columns plainly, e.g. {{post}} (write {{{{ and "
            "}} for literal braces)."
        )
    return list(dict.fromkeys(names))


def check_prompt_fields(task: TaskHParams) -> None:
    """ValueError naming the flag when --task.query_split, --task.query_template or --task.query_truncate_field cannot
    work: an empty split, a template with unnamed fields, a field to cut that the prompt does not hold, or either flag
    with a source of plain texts (books, tldr, cnndm, a .txt file), which has no columns."""
    if not isinstance(task.query_split, str) or not task.query_split:
        raise ValueError(f"--task.query_split must name a split, got {task.query_split!r}; e.g. train.")
    source = task.query_dataset
    has_columns = source.startswith(HF_PREFIX) or source.lower().endswith(".jsonl")
    for name in _PROMPT_FIELDS:
        if getattr(task, name) is not None and not has_columns:
            raise ValueError(
                f"--task.{name} reads the columns of prompt rows, but --task.query_dataset '{source}' holds plain "
                f"texts; pass hf:NAME_OR_DIR or a .jsonl of objects, or drop --task.{name}."
            )
    field = task.query_truncate_field
    if task.query_template is not None:
        fields = template_fields(task.query_template)
        if field is not None and field not in fields:
            raise ValueError(
                f"--task.query_truncate_field '{field}' is not a field of --task.query_template (it has {fields}); "
                "cutting it would never shorten the prompt. Name one of them, or None to cut the whole prompt."
            )
    elif field is not None and field != "prompt":
        raise ValueError(
            f"--task.query_truncate_field '{field}' needs a --task.query_template that formats it; without a template "
            "the prompt is the `prompt` column (or a chat's last user message): pass None or prompt."
        )


_FIELDS_ADDED_LATER = {
    name: TaskHParams.__dataclass_fields__[name].default for name in ("query_split", *_PROMPT_FIELDS)
}
"""fields that tasks saved before them lack: such a task compares equal while the field keeps this default"""


def task_differences(saved: dict | None, task: TaskHParams) -> dict[str, tuple]:
    """Fields where a saved task (dataclasses.asdict of a TaskHParams, e.g. a reward model's) differs from `task`:
    name -> (saved value, value of `task`); a field the saved task lacks counts as different, unless it is one added
    later (`_FIELDS_ADDED_LATER`) and `task` holds its default.

    The truncation token is compared by its id when both sides are resolved (`resolve_truncation`; tasks saved before
    truncate_text record the id alone), else by its text where the saved task records one. A task saved before
    penalty_mode and end_at_eos existed ran with their defaults: it lacks them and matches a task that has the defaults.
    """
    saved = saved if isinstance(saved, dict) else {}
    saved = {**{name: value for name, value in LATER_FIELD_DEFAULTS.items() if name not in saved}, **saved}
    missing = object()
    current = dataclasses.asdict(task)
    skipped = {"truncate_text"}
    if not (_truncation_resolved(saved) and _truncation_resolved(current)):
        skipped = {"truncate_token"} | ({"truncate_text"} if "truncate_text" not in saved else set())
    skipped |= {name for name, default in _FIELDS_ADDED_LATER.items() if name not in saved and current[name] == default}
    return {
        name: (saved.get(name, "<not recorded>"), value)
        for name, value in current.items()
        if name not in skipped and saved.get(name, missing) != value
    }


LATER_FIELD_DEFAULTS = {"penalty_mode": "replace", "end_at_eos": False}
"""TaskHParams fields added after tasks were first saved (reward_model.json, args.json, checkpoints), with the value a
task saved without them ran with"""


def _truncation_resolved(task: dict) -> bool:
    """Whether a task (as a dict) names its truncation token by id: set, or no text to resolve it from."""
    return task.get("truncate_token") is not None or not task.get("truncate_text")


def resolve_truncation(task: TaskHParams, tokenizer: PreTrainedTokenizerBase) -> TaskHParams:
    """The task with truncate_token set to this tokenizer's id of truncate_text (unchanged without a text), or with
    end_at_eos to its EOS id and truncate_after 0; done once, where the tokenizer is loaded. ValueError when the text
    is not one token or names another token than an explicit truncate_token, or is given with end_at_eos."""
    if task.end_at_eos:
        return eos_truncation(task, tokenizer)
    token = text_to_token(tokenizer, task.truncate_text, "--task.truncate_text")
    if token is None:
        return task
    if task.truncate_token is not None and task.truncate_token != token:
        raise ValueError(
            f"--task.truncate_token {task.truncate_token} and --task.truncate_text {task.truncate_text!r} (token "
            f"{token} in this tokenizer) name different tokens; pass one of them, or both naming the same token."
        )
    return dataclasses.replace(task, truncate_token=token)


def eos_truncation(task: TaskHParams, tokenizer: PreTrainedTokenizerBase) -> TaskHParams:
    """The task truncating at the tokenizer's EOS from index 0 (nplus N19); a resolved task again is unchanged."""
    # truncate after the first EOS, EOS kept; no EOS -> the penalty (nplus N19)
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L350-L355
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "--task.end_at_eos ends responses at the tokenizer's EOS, but this tokenizer has none; pick a base model "
            "whose tokenizer has an EOS token or drop --task.end_at_eos."
        )
    if task.truncate_text or task.truncate_token not in (None, eos):
        given = f"--task.truncate_text {task.truncate_text!r}" if task.truncate_text else ""
        given = given or f"--task.truncate_token {task.truncate_token}"
        raise ValueError(
            f"--task.end_at_eos truncates at the tokenizer's EOS (id {eos}), but {given} names another truncation "
            "token (a preset's, e.g. tldr's '\\n'); pass --task.truncate_text None with --task.end_at_eos."
        )
    return dataclasses.replace(task, truncate_token=eos, truncate_after=0)


def check_truncation_resolved(task: TaskHParams) -> None:
    """ValueError when the task names its truncation token by text but no id was resolved: its filter would silently
    do nothing (a preset used from Python without `resolve_truncation`)."""
    if task.end_at_eos and task.truncate_token is None:
        raise ValueError(
            "the task ends responses at EOS (end_at_eos) but its EOS id is not resolved: call "
            "tasks.resolve_truncation(task, tokenizer) first."
        )
    if task.truncate_text and task.truncate_token is None:
        raise ValueError(
            f"the task's truncation text {task.truncate_text!r} has no token id: call "
            "tasks.resolve_truncation(task, tokenizer) first, or set truncate_text=None for no truncation."
        )


# ---------------------------------------------------------------- tokens


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """BPE ids of each text in one batched tokenizer call, with special-token strings encoded as plain text."""
    # OAI's encoder is plain BPE with no special tokens: a literal "[PAD]" or "<|endoftext|>" is ordinary text
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/encodings.py#L103-L108
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def text_to_token(tokenizer: PreTrainedTokenizerBase, text: str | None, flag: str = "--task.start_text") -> int | None:
    """The single token id of `text` (None for None or ""); ValueError if it encodes to more or fewer tokens."""
    # OAI unpacks `start_token, = encoder.encode(start_text)` and treats an empty text as unset
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L84-L92
    if not text:
        return None
    tokens = encode_texts(tokenizer, [text])[0]
    if len(tokens) != 1:
        raise ValueError(
            f"{flag} {text!r} must be exactly one token, but encodes to {tokens}; pass a single-token text or None."
        )
    return tokens[0]


def build_query(
    tokens: list[int], query_length: int, start_token: int | None, end_token: int | None, pad_id: int
) -> list[int] | None:
    """OAI's query from a text's tokens: trim after start_token, truncate, trim to the last end_token, right-pad."""
    # 1. (tokens given) 2. start after the first start_token unless it is the last token; skip if absent
    # 3. truncate to query_length 4. keep up to the last end_token, skip if absent 5. right-pad with PAD
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py#L45-L71
    if query_length <= 0:
        raise ValueError(f"query_length must be positive, got {query_length}; set --task.query_length.")
    if start_token is not None:
        if start_token not in tokens:
            return None
        first = tokens.index(start_token) + 1
        if first < len(tokens):
            tokens = tokens[first:]
    tokens = tokens[:query_length]
    if end_token is not None:
        if end_token not in tokens:
            return None
        tokens = tokens[: len(tokens) - tokens[::-1].index(end_token)]
    # DEVIATION (empty-text): an empty text is skipped; OAI would yield an all-PAD query that fails its
    # first-token-not-PAD assertion in the transformer (model.py#L333-L340)
    if not tokens:
        return None
    return tokens + [pad_id] * (query_length - len(tokens))


def encode_context_affixes(tokenizer: PreTrainedTokenizerBase, task: TaskHParams) -> tuple[list[int], list[int]]:
    """Token ids put before and after every query in the policy's context: the tokenizer's BOS (when it adds one by
    default) and the task's query_prefix, and the query_suffix (empty lists when unset)."""
    prefix, suffix = encode_texts(tokenizer, [task.query_prefix, task.query_suffix])
    # DEVIATION (bos): OAI's GPT-2 encoder adds no BOS, nor does this for GPT-2; a model whose tokenizer adds one
    # (Llama) was pretrained with it in front of every text, so every context gets exactly one, here
    bos = added_bos_id(tokenizer)
    return ([bos] if bos is not None else []) + list(prefix), list(suffix)


def format_contexts(queries: torch.Tensor, prefix: list[int], suffix: list[int]) -> torch.Tensor:
    """prefix ⊕ query ⊕ suffix for every row: the policy's context; the reward model sees raw queries."""
    # context = encode(prefix) ++ padded query ++ encode(suffix); PADs between query and suffix are invisible (G2)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L68-L80
    if queries.dim() != 2:
        raise ValueError(f"queries must be a (batch, query_length) tensor, got shape {tuple(queries.shape)}.")
    batch = queries.shape[0]
    # through pinned memory: `torch.tensor(..., device=cuda)` copies from pageable memory, which waits for the GPU
    pre = to_device(torch.tensor(prefix, dtype=queries.dtype), queries.device).expand(batch, -1)  # (B, P)
    suf = to_device(torch.tensor(suffix, dtype=queries.dtype), queries.device).expand(batch, -1)  # (B, S)
    return torch.cat([pre, queries, suf], dim=1)  # (B, P + Lq + S)


# ---------------------------------------------------------------- responses


def truncate_response(
    responses: torch.Tensor, truncate_token: int | None, truncate_after: int, pad_id: int
) -> torch.Tensor:
    """PAD every token after the first `truncate_token` at index >= truncate_after; that token itself is kept."""
    # only the reward model sees the truncated response; PPO trains on the raw one (spec P2)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L39-L52
    if truncate_token is None:
        return responses
    positions = torch.arange(responses.shape[1], device=responses.device)
    matches = (responses == truncate_token) & (positions >= truncate_after)  # (B, L)
    after_first_match = (matches.cumsum(1) - matches.long()) > 0
    return responses.masked_fill(after_first_match, pad_id)


def response_ends(truncated: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B,) index s of each response's first EOS, L - 1 without one: where a response ends under --task.end_at_eos
    (nplus N20; the successor recipe's first PAD of the truncated response - 1)."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L636
    length = truncated.shape[1]
    positions = torch.arange(length, device=truncated.device)
    return torch.where(truncated == eos_id, positions, length - 1).amin(1)


def passes_filter(responses: torch.Tensor, truncate_token: int | None, truncate_after: int) -> torch.Tensor:
    """(B,) bool: the response holds `truncate_token` at some index >= truncate_after (always True when unset)."""
    # "ensure there is a period between the 16th and 24th token"; failing responses get a fixed score (spec P3)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L58-L65
    if truncate_token is None:
        return torch.ones(responses.shape[0], dtype=torch.bool, device=responses.device)
    return (responses[:, truncate_after:] == truncate_token).any(1)


def filter_flags(task: TaskHParams) -> str:
    """The task's filter in words, naming its flags: what a response needs to pass (for pass-rate messages)."""
    if task.end_at_eos:
        return (
            f"a response passes only with an EOS (token {task.truncate_token}, --task.end_at_eos) among its "
            f"--task.response_length {task.response_length} tokens"
        )
    token = f"--task.truncate_token {task.truncate_token}"
    if task.truncate_text:
        token += f" (--task.truncate_text {task.truncate_text!r})"
    return (
        f"a response passes only with {token} at an index >= "
        f"--task.truncate_after {task.truncate_after} of its --task.response_length {task.response_length} tokens"
    )


class PassRateAlarm:
    """Console warning when the filter pass rate stays under `threshold`: checked at every `interval`-th update, it
    fires when every update since the previous check was below (at the first check: the first update alone). A rate
    that was above the threshold earlier in the run and fell blames the training, not the filter's flags."""

    def __init__(self, threshold: float, interval: int):
        self.threshold, self.interval = threshold, interval
        self.first: int | None = None
        self.highest = 0.0
        self.best: tuple[float, int] | None = None  # the run's highest rate at or above the threshold, and its update

    def update(self, rate: float, update: int, task: TaskHParams) -> str | None:
        """The warning after update `update` (0-based) whose pass rate was `rate`, or None."""
        self.first = update if self.first is None else self.first
        self.highest = max(self.highest, rate)
        if rate >= self.threshold and (self.best is None or rate > self.best[0]):
            self.best = (rate, update)
        if self.threshold <= 0 or update % self.interval:
            return None
        first, highest, self.first, self.highest = self.first, self.highest, None, 0.0
        if highest >= self.threshold:
            return None
        updates = f"update {update}" if first == update else f"updates {first}-{update}"
        if self.best is not None:
            return (
                f"warning: the filter pass rate fell below {self.threshold} ({updates}, highest {highest:.3f}) after "
                f"{self.best[0]:.3f} at update {self.best[1]}, with the same filter: the policy moved away from the "
                "responses that pass and trains on the penalty --task.penalty_reward_value "
                f"{task.penalty_reward_value}. A sign of divergence: check --ppo.lr and --rewards.kl_coef."
            )
        return (
            f"warning: the filter pass rate stayed below {self.threshold} ({updates}, highest {highest:.3f}), so the "
            f"policy trains on the penalty --task.penalty_reward_value {task.penalty_reward_value}: "
            f"{filter_flags(task)}. Check these flags (--task.truncate_token None: no filter) and the base model."
        )
