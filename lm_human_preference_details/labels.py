"""Label files in OAI's schema: the label types, their normalization targets, reading, validation, writing and the
metadata file.

The counterpart of lm_human_preferences/label_types.py (schemas; the losses are `label_loss` in train_reward.py) and
train_reward.py's label download.
OAI's files are JSON lists of rows padded with OAI's PAD 50259; files written by label_generation.py have a
`<file>.meta.json` beside them (labeler, tokenizer fingerprint, PAD id written, task, counts).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py
"""

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details import presets
from lm_human_preference_details.files import write_atomic, write_json_atomic
from lm_human_preference_details.hub import HubUnavailableError, check_available
from lm_human_preference_details.sources import (
    OAI_URL,
    SourceUnavailableError,
    announce_once,
    download_cached,
    oai_url,
    read_utf8,
)
from lm_human_preference_details.tasks import TASK_GOALS

# OAI's padding token: len(encoder) + 2, outside GPT-2's 50257-token vocabulary; label files use it
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/encodings.py#L56
OAI_PAD_TOKEN = 50259

LABELS_REPO = "vwxyzjn/lm-human-preferences"
"""HF hub dataset mirroring OAI's label files (e.g. sentiment/offline_5k.json)."""
LABELS_META_SUFFIX = ".meta.json"
"""Suffix of the metadata file written beside a generated label file; its `pad_id` overrides OAI_PAD_TOKEN."""
OAI_LABELS_URL = f"{OAI_URL}labels/"
"""Prefix of the label sources in OAI's launch.py; stripped to get the file name (the same inside LABELS_REPO)."""
OAI_LABEL_FOLDERS = ("sentiment", "descriptiveness", "tldr", "cnndm")
"""Folders of OAI's label files (sentiment/offline_5k.json, tldr/online_45k.json, ...): a relative name outside them
is a local file, never downloaded."""
PREFERENCE_PAIR_FIELDS = ("prompt", "chosen", "rejected")
"""Fields of the text preference pairs of other libraries (e.g. TRL's JSON Lines): best_of_2 labels (text_prefs.py)."""
TEXT_PAIRS_SCHEMA = "text preference pairs (one JSON object per line with string fields prompt, chosen, rejected)"
"""The text schema in one line, for error messages."""


# ---------------------------------------------------------------- label types
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L119


@dataclass(frozen=True)
class LabelType:
    """One of OAI's label types: best_of_N (pick the best of N), scalar_rating (score one), scalar_compare (two)."""

    name: str
    """OAI's name: best_of_4, scalar_rating or scalar_compare (train_reward.py's --labels.type)"""
    sample_fields: tuple[str, ...]
    """the fields holding the responses of a row: sample0..sample{N-1}, sample, or sample0 and sample1"""
    label_field: str
    """the field holding the judgement: best (an index), score or difference (a number)"""

    @property
    def num_samples(self) -> int:
        """Responses per label row."""
        return len(self.sample_fields)

    @property
    def fields(self) -> list[str]:
        """Every field of a row, in OAI's schema."""
        return ["query", *self.sample_fields, self.label_field]


def get_label_type(name: str, flag: str = "--labels.type") -> LabelType:
    """The label type called `name` (OAI's label_types.get); ValueError naming the valid names otherwise."""
    if name == "scalar_rating":
        return LabelType(name, ("sample",), "score")
    if name == "scalar_compare":
        return LabelType(name, ("sample0", "sample1"), "difference")
    n = name.removeprefix("best_of_")
    if name.startswith("best_of_") and n.isdigit() and int(n) >= 2:
        return LabelType(name, tuple(f"sample{i}" for i in range(int(n))), "best")
    raise ValueError(
        f"unknown {flag} '{name}'; choose best_of_N (N >= 2, e.g. best_of_4), scalar_rating or scalar_compare."
    )


def label_type_of_row(row: Any) -> LabelType | None:
    """The label type whose fields a row (dict) has: by its `best`, `score` or `difference` field; None if none."""
    if not isinstance(row, dict):
        return None
    if "score" in row:
        return get_label_type("scalar_rating")
    if "difference" in row:
        return get_label_type("scalar_compare")
    num_samples = sum(1 for key in row if re.fullmatch(r"sample[0-9]+", key))
    return get_label_type(f"best_of_{num_samples}") if "best" in row and num_samples >= 2 else None


def pearson_r(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of two 1-D tensors from population moments (OAI's utils/core.py pearson_r)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py
    x_var, x_mean = torch.var_mean(x, correction=0)
    y_var, y_mean = torch.var_mean(y, correction=0)
    return ((x - x_mean) * (y - y_mean)).mean() / torch.sqrt(x_var * y_var)


def target_scales(label_type: LabelType, labels: "Labels") -> torch.Tensor | None:
    """Values whose scale the reward should have before training: scores, differences / 2, or None (best_of_N)."""
    # "Divide by two to get something with the same variance as the trained reward model output"
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L67-L68
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L91-L93
    if label_type.label_field == "score":
        return labels.label
    if label_type.label_field == "difference":
        return labels.label / 2
    return None


# ---------------------------------------------------------------- reading


@dataclass
class Labels:
    """Label rows of one label type: queries, the sampled responses and the judgement of each row."""

    query: torch.Tensor
    """(N, query_length) long, right-padded with the tokenizer's PAD"""
    samples: torch.Tensor
    """(N, num_samples, response_length) long, PAD after a truncation point"""
    label: torch.Tensor
    """(N,): the index of the best sample (long, best_of_N), the score or the difference (float32, scalar types)"""

    def __len__(self) -> int:
        return self.query.shape[0]

    def __getitem__(self, rows: slice | torch.Tensor) -> "Labels":
        """The label rows selected by a slice or an index tensor."""
        return Labels(self.query[rows], self.samples[rows], self.label[rows])


def _hub_label_file(filename: str, flag: str) -> str:
    """`filename` of the HF mirror of OAI's labels, downloaded (HF cache); HubUnavailableError when offline."""
    check_available(LABELS_REPO, flag, kind="dataset", filename=filename)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(repo_id=LABELS_REPO, filename=filename, repo_type="dataset")
    except EntryNotFoundError as e:
        raise FileNotFoundError(
            f"hub dataset '{LABELS_REPO}' has no file '{filename}'; pass e.g. sentiment/offline_5k.json, "
            f"descriptiveness/offline_5k.json or a local JSON path as {flag}."
        ) from e


def _resolve_label_source(source: str, flag: str = "--label_dataset") -> str:
    """A local path for `source`: the file itself, else OAI's label file (downloaded once), else the HF mirror's."""
    if os.path.isfile(source):
        return source
    if source.startswith(("/", ".", "~")) or os.path.isdir(source):
        raise FileNotFoundError(f"label file '{source}' does not exist; fix {flag}.")
    is_url = source.startswith(("http://", "https://"))
    if not is_url and source.split("/")[0] not in OAI_LABEL_FOLDERS:
        raise FileNotFoundError(
            f"label file '{source}' does not exist in {os.getcwd()}, and it is not one of OAI's label files "
            f"({', '.join(f'{folder}/...' for folder in OAI_LABEL_FOLDERS)}); fix the path of {flag}."
        )
    if source.startswith(("http://", "https://")) and not source.startswith(OAI_LABELS_URL):
        return download_cached(source)
    # OAI's labels.source is a URL of its public storage; a bare name such as sentiment/offline_5k.json means that file
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L69
    filename = source.removeprefix(OAI_LABELS_URL)
    try:
        return download_cached(oai_url(f"labels/{filename}"))
    except SourceUnavailableError as oai_error:
        try:
            path = _hub_label_file(filename, flag)
        except HubUnavailableError as hub_error:
            raise SourceUnavailableError(
                f"label file '{filename}': {str(oai_error).rstrip('.')}; and its hub mirror '{LABELS_REPO}' is "
                f"unreachable (offline) and not in the HF cache. Or run `hf download {LABELS_REPO} {filename} "
                f"--repo-type dataset --local-dir DIR` where there is network and pass {flag} DIR/{filename}."
            ) from hub_error
        reason = str(oai_error).rstrip(".")
        announce_once(f"labels:{filename}", f"label file '{filename}': {reason}. Using hub dataset {LABELS_REPO}.")
        return path


def labels_meta_path(path: str) -> str:
    """The metadata file written beside a generated label file: `<path>.meta.json`."""
    return f"{path}{LABELS_META_SUFFIX}"


def label_file_pad_id(path: str) -> int:
    """The PAD id used inside a label file: `pad_id` of its `<path>.meta.json` when present, else OAI's 50259."""
    meta_path = labels_meta_path(path)
    if not os.path.isfile(meta_path):
        return OAI_PAD_TOKEN
    with open(meta_path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"label metadata '{meta_path}': invalid JSON ({e}); fix or delete it.") from e
    pad_id = meta.get("pad_id", OAI_PAD_TOKEN) if isinstance(meta, dict) else None
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"label metadata '{meta_path}': 'pad_id' must be a token id >= 0, got {pad_id!r}; fix it.")
    return pad_id


def _check_label_value(value: Any, label_type: LabelType, row: int, where: str) -> None:
    """ValueError unless `value` is a valid judgement: an index below N (best), a finite number (score, difference)."""
    field = label_type.label_field
    if field == "best":
        n = label_type.num_samples
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise ValueError(f"{where}: row {row} field 'best' = {value!r}, expected an int in [0, {n}).")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: row {row} field '{field}' = {value!r}, expected a finite number.")


def _first_row_lengths(first: dict, label_type: LabelType) -> dict[str, int]:
    """Token-list lengths of the query and sample fields of a file's first row, which every row must share."""
    return {key: len(first[key]) if isinstance(first.get(key), list) else -1 for key in label_type.fields[:-1]}


def _check_label_rows(rows: Any, lengths: dict[str, int], label_type: LabelType, where: str) -> None:
    """ValueError naming the row index and field of the first malformed row (structure and lengths only)."""
    if not isinstance(rows, list):
        raise ValueError(f"{where}: expected a JSON list of label rows, got {type(rows).__name__}.")
    fields = label_type.fields
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is a {type(row).__name__}, expected an object with fields {fields}.")
        for field in fields:
            if field not in row:
                raise ValueError(f"{where}: row {i} is missing field '{field}' (fields: {fields}).")
            value = row[field]
            if field == label_type.label_field:
                _check_label_value(value, label_type, i, where)
            elif not isinstance(value, list) or len(value) != lengths[field]:
                got = f"length {len(value)}" if isinstance(value, list) else type(value).__name__
                expected = f"a list of {lengths[field]} token ids"
                raise ValueError(f"{where}: row {i} field '{field}' has {got}, expected {expected}.")


def _token_array(rows: list[dict], field: str, where: str) -> np.ndarray:
    """All rows' `field` as one (N, length) int64 array; ValueError naming the first row with a bad token."""
    values = [row[field] for row in rows]
    try:
        array = np.array(values)
    except (ValueError, OverflowError):
        array = np.array(values, dtype=object)
    if array.dtype.kind in "iu" and array.ndim == 2 and (array.size == 0 or array.min() >= 0):
        return array.astype(np.int64, copy=False)
    int64_max = np.iinfo(np.int64).max
    for i, tokens in enumerate(values):
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= int64_max]
        if bad:
            raise ValueError(f"{where}: row {i} field '{field}' has token {bad[0]!r}; tokens must be ints >= 0.")
    raise ValueError(f"{where}: field '{field}' could not be read as integer tokens.")


SCHEMA = (
    'a JSON list of rows of token ids, e.g. best_of_4: {"query": [ids], "sample0": [ids], ..., "sample3": '
    '[ids], "best": 0-3}'
)
"""OAI's label schema in one line, for error messages."""


def _read_json_rows(path: str, where: str, flag: str) -> Any:
    """The parsed JSON content of a label file; ValueError naming the file and the expected schema when it is not."""
    text = read_utf8(path, "label file", flag)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        first = _first_json_line(text)
        if first is not None and set(PREFERENCE_PAIR_FIELDS) <= set(first):
            raise ValueError(
                f"{where} is JSON Lines of text preference pairs ({', '.join(PREFERENCE_PAIR_FIELDS)}, as TRL writes "
                "them), which need a tokenizer: pass it to train_reward.py --label_dataset with --labels.type "
                f"best_of_2, or convert it to OAI's label schema, {SCHEMA}, with label_generation.py convert."
            ) from e
        if first is not None:
            raise ValueError(
                f"{where} is JSON Lines in neither schema: its first row has fields {sorted(first)[:8]}; expected "
                f"{TEXT_PAIRS_SCHEMA} (a .jsonl file), or OAI's label schema, {SCHEMA}."
            ) from e
        raise ValueError(f"{where}: invalid JSON ({e}); expected {SCHEMA}.") from e


def _first_json_line(text: str) -> dict | None:
    """The first line of `text` parsed as a JSON object, or None when it is not one."""
    try:
        first = json.loads(text.lstrip().split("\n", 1)[0])
    except json.JSONDecodeError:
        return None
    return first if isinstance(first, dict) else None


def read_label_rows(source: str, flag: str = "--label_dataset") -> tuple[list[dict], LabelType, int]:
    """Rows of a label file of any type and lengths, validated against its first row; -> rows, type, the file's PAD."""
    path = _resolve_label_source(source, flag)
    where = f"label file '{source}'"
    rows = _read_json_rows(path, where, flag)
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    label_type = label_type_of_row(first)
    if label_type is None or not isinstance(first.get("query"), list):
        raise ValueError(
            f"{where} is not in one of OAI's label schemas: expected a non-empty JSON list of objects with fields "
            "query, sample0..sampleN-1 and best (best_of_N), query, sample and score (scalar_rating), or query, "
            f"sample0, sample1 and difference (scalar_compare), or {TEXT_PAIRS_SCHEMA} in a .jsonl file; got "
            f"{type(rows).__name__} with keys {sorted(first or (rows if isinstance(rows, dict) else {}))[:8]}."
        )
    lengths = _first_row_lengths(first, label_type)
    _check_label_rows(rows, lengths, label_type, where)
    for field in lengths:
        _token_array(rows, field, where)
    return rows, label_type, label_file_pad_id(path)


def _meta_lengths(path: str) -> tuple[int, int] | None:
    """(query_length, response_length) that a label file's `.meta.json` records, or None."""
    try:
        with open(labels_meta_path(path), encoding="utf-8") as f:
            task = json.load(f).get("task", {})
        return task["query_length"], task["response_length"]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _check_file_lengths(rows: Any, lengths: dict[str, int], kind: LabelType, path: str, where: str) -> None:
    """ValueError naming the --task.* lengths of the file (its first row, as its .meta.json records them) when they
    are not this run's."""
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else None
    if first is None:
        return
    found = _first_row_lengths(first, kind)
    if found == lengths or any(length < 0 for length in found.values()):
        return
    query, response = found["query"], found[kind.sample_fields[0]]
    recorded = (
        f" (as its {os.path.basename(labels_meta_path(path))} records)"
        if _meta_lengths(path) == (query, response)
        else ""
    )
    raise ValueError(
        f"{where} has queries of {query} tokens and responses of {response}{recorded}, this run expects "
        f"{lengths['query']} and {lengths[kind.sample_fields[0]]}; pass --task.query_length {query} "
        f"--task.response_length {response}, or convert the file with label_generation.py convert "
        f"--task.query_length {lengths['query']} --task.response_length {lengths[kind.sample_fields[0]]}."
    )


def load_labels(
    source: str,
    query_length: int,
    response_length: int,
    pad_id: int,
    num_train: int,
    label_type: str = "best_of_4",
    flag: str = "--label_dataset",
) -> Labels:
    """A label file of `label_type` (local JSON or a file of the HF mirror), validated, the file's PAD mapped to pad_id.

    The file's PAD is OAI's 50259, or the `pad_id` of a `<file>.meta.json` beside it (label_generation.py writes one).
    Text preference pairs are read by text_prefs.load_labels_or_pairs.
    """
    # OAI: a JSON list of rows of the label type's schema; at least num_train rows, the first num_train are trained on
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L64-L96
    kind = get_label_type(label_type)
    path = _resolve_label_source(source, flag)
    where = f"label file '{source}'"
    rows = _read_json_rows(path, where, flag)
    found = label_type_of_row(rows[0]) if isinstance(rows, list) and rows else None
    if found is not None and found.name != kind.name:
        raise ValueError(
            f"{where} holds {found.name} labels (fields {found.fields}), not {kind.name}; pass --labels.type "
            f"{found.name}."
        )
    lengths = {"query": query_length, **{field: response_length for field in kind.sample_fields}}
    _check_file_lengths(rows, lengths, kind, path, where)
    _check_label_rows(rows, lengths, kind, where)
    if len(rows) < num_train:
        raise ValueError(f"{where} has {len(rows)} rows but num_train is {num_train}; lower --labels.num_train.")
    query = _token_array(rows, "query", where)  # (N, Lq)
    samples = np.stack([_token_array(rows, field, where) for field in kind.sample_fields], axis=1)  # (N, S, L)
    values = [row[kind.label_field] for row in rows]
    label = np.array(values, dtype=np.int64 if kind.label_field == "best" else np.float32)  # (N,)
    # label files pad with OAI's 50259; map it to our PAD (REF-R#L605-L607). Generated files whose vocabulary has a
    # real token 50259 record their PAD in <file>.meta.json instead
    file_pad_id = label_file_pad_id(path)
    query[query == file_pad_id] = pad_id
    samples[samples == file_pad_id] = pad_id
    # the transformer requires a real first token (model.py#L333-L340)
    starts_with_pad = np.flatnonzero(query[:, 0] == pad_id) if len(rows) else np.array([], dtype=np.int64)
    if starts_with_pad.size:
        row = starts_with_pad[0]
        raise ValueError(f"{where}: row {row} field 'query' starts with PAD; a query must start with a real token.")
    return Labels(query=torch.from_numpy(query), samples=torch.from_numpy(samples), label=torch.from_numpy(label))


def label_file_task(source: str) -> tuple[str | None, str]:
    """The --task a label file was made for and where that is recorded: the `task_id` of a local file's
    `<file>.meta.json` (label_generation.py generate and the label server write it), the folder of one of OAI's label
    files (descriptiveness/offline_5k.json), or the label file of a --task preset (presets.REWARD); (None, why nothing
    tells) otherwise."""
    if os.path.isfile(source):
        meta_path = labels_meta_path(source)
        name = os.path.basename(meta_path)
        try:
            with open(meta_path, encoding="utf-8") as f:
                task = json.load(f).get("task_id")
        except FileNotFoundError:
            return None, f"it has no {name} beside it, which label_generation.py writes"
        except (OSError, ValueError, AttributeError):
            return None, f"its {name} cannot be read"  # label_file_pad_id names a broken one
        if not isinstance(task, str):
            return None, f"its {name} records no task_id"
        return task, f"its {name} records task_id {task!r}"
    folder = source.removeprefix(OAI_LABELS_URL).split("/")[0]
    if folder in OAI_LABEL_FOLDERS:
        return folder, f"one of OAI's {folder} label files"
    for task, settings in presets.REWARD.items():
        if settings.get("label_dataset") == source:
            return task, f"the label file of the --task {task} preset"
    return None, "it is neither a local file with a .meta.json nor one of OAI's label files"


def check_label_task(label_dataset: str, task_id: str, allow: bool) -> str | None:
    """ValueError when the label file was made for another --task than `task_id` (sentiment and descriptiveness share
    every task setting: the reward model would be recorded as trained for the wrong one and pass the policy's task
    check), unless `allow`; -> a warning when nothing tells the file's task (a user's file without its .meta.json:
    the reward model is recorded as a `task_id` model unchecked) or when `allow` let a mismatch through; None when they
    agree."""
    task, where = label_file_task(label_dataset)
    if task is None:
        fix = f"make sure they are --task {task_id} labels"
        if os.path.isfile(label_dataset):
            meta_path = labels_meta_path(label_dataset)
            entry = json.dumps({"task_id": task_id})
            write = f"add {entry[1:-1]} to" if os.path.isfile(meta_path) else f"write {entry} to"
            fix = f"if they are --task {task_id} labels, {write} {meta_path} to have it checked"
        return (
            f"--label_dataset '{label_dataset}': nothing tells which task its labels judge ({where}), so their task "
            f"was not checked and the reward model is recorded as a --task {task_id} model on trust; {fix}."
        )
    if task == task_id:
        return None
    mismatch = f"--label_dataset '{label_dataset}' holds labels for --task {task} ({where})"
    mismatch += f", but this run is --task {task_id}"
    if not allow:
        raise ValueError(
            f"{mismatch}, so the reward model would be recorded as a {task_id} model; pass --task {task}, or "
            "--labels.allow_task_mismatch to train on them anyway."
        )
    return f"--labels.allow_task_mismatch: {mismatch}; the reward model records --task {task_id}"


def label_task_warnings(label_dataset: str, task_id: str, allow: bool) -> list[str]:
    """The warnings about the task of a label file's rows, each one line: a task mismatch let through by `allow`
    (check_label_task, which stops the run without it), a labeler of another thing than the task
    (label_file_labeler_warning)."""
    warnings = (check_label_task(label_dataset, task_id, allow), label_file_labeler_warning(label_dataset, task_id))
    return [warning for warning in warnings if warning]


def label_file_labeler_warning(source: str, task_id: str) -> str | None:
    """One warning line when a local label file's `<file>.meta.json` records a labeler that measures another thing than
    --task `task_id` is about (vader labelling descriptiveness rows: the reward model would learn sentiment); None
    otherwise."""
    try:
        with open(labels_meta_path(source), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None  # no metadata, or unreadable: label_file_pad_id names a broken one
    measures = meta.get("labeler_measures") if isinstance(meta, dict) else None
    if not isinstance(measures, str) or TASK_GOALS.get(task_id) in (None, measures):
        return None
    return (
        f"--label_dataset '{source}' was labelled by {meta.get('labeler')}, which measures {measures} (its "
        f"{os.path.basename(labels_meta_path(source))}), but this run is --task {task_id}, which is about "
        f"{TASK_GOALS[task_id]}: the reward model would learn {measures}; label the rows with a labeler of "
        f"{TASK_GOALS[task_id]}."
    )


def check_label_tokenizer(source: str, fingerprint: str, tokenizer_name: str, flag: str = "--label_dataset") -> None:
    """ValueError when the `<file>.meta.json` of a local label file records another tokenizer than `fingerprint`."""
    meta_path = labels_meta_path(source)
    if not (os.path.isfile(source) and os.path.isfile(meta_path)):
        return
    with open(meta_path, encoding="utf-8") as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"label metadata '{meta_path}': invalid JSON ({e}); fix or delete it.") from e
    saved = meta.get("tokenizer_fingerprint") if isinstance(meta, dict) else None
    if saved is not None and saved != fingerprint:
        raise ValueError(
            f"{flag} '{source}' was tokenized for '{meta.get('base_model')}' (tokenizer fingerprint {saved}), not for "
            f"--base_model '{tokenizer_name}' (fingerprint {fingerprint}); pass the --base_model the labels were made "
            f"with, or re-tokenize them: label_generation.py convert --input {source} --base_model {tokenizer_name}."
        )


def check_label_tokens(
    labels: Labels, vocab_size: int, pad_id: int, source: str, flag: str = "--label_dataset"
) -> None:
    """ValueError naming the first row and field with a token id the model cannot embed (>= vocab_size, not PAD)."""
    fields = {"query": labels.query[:, None, :], "sample": labels.samples}
    for name, tokens in fields.items():
        bad = (tokens >= vocab_size) & (tokens != pad_id)  # (N, S, L)
        if bool(bad.any()):
            row, sample, col = (int(i) for i in torch.nonzero(bad)[0])
            field = name if name == "query" else f"sample{sample}" if labels.samples.shape[1] > 1 else "sample"
            raise ValueError(
                f"{flag} '{source}': row {row} field '{field}' has token {int(tokens[row, sample, col])}, outside the "
                f"{vocab_size}-token vocabulary of --base_model; the labels were made with another tokenizer: "
                "re-tokenize them with label_generation.py convert."
            )


def save_labels(path: str, labels_rows: list[dict], pad_id: int | None = None) -> None:
    """Write label rows (lists or tensors) in OAI's JSON schema of their type; tokens equal to pad_id are written as
    OAI's PAD."""
    if not labels_rows:
        raise ValueError(f"no label rows to write to '{path}'.")
    rows = [
        {k: v.tolist() if isinstance(v, (torch.Tensor, np.ndarray, np.generic)) else v for k, v in row.items()}
        if isinstance(row, dict)
        else row
        for row in labels_rows
    ]
    where = f"labels for '{path}'"
    label_type = label_type_of_row(rows[0])
    if label_type is None:
        raise ValueError(
            f"{where}: row 0 is in none of OAI's label schemas (best_of_N, scalar_rating, scalar_compare)."
        )
    lengths = _first_row_lengths(rows[0], label_type)
    _check_label_rows(rows, lengths, label_type, where)
    if pad_id is not None:
        # LG: write PAD as OAI's 50259 so the file reads like OAI's label files
        for field in lengths:
            tokens = _token_array(rows, field, where)
            tokens[tokens == pad_id] = OAI_PAD_TOKEN
            for row, values in zip(rows, tokens.tolist()):
                row[field] = values
    write_atomic(path, lambda f: json.dump(rows, f), "label file")


def oai_pad_compatible(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when OAI's PAD 50259 is not a real token of this tokenizer, so files can be padded with it."""
    return OAI_PAD_TOKEN >= len(tokenizer) or tokenizer.pad_token_id == OAI_PAD_TOKEN


def save_label_file(path: str, rows: list[dict], pad_id: int, file_pad_id: int, meta: dict) -> None:
    """Rows (tokenizer PAD) in OAI's schema with PAD written as file_pad_id, then the metadata beside them."""
    save_labels(path, rows, pad_id=pad_id if file_pad_id == OAI_PAD_TOKEN else None)
    write_json_atomic(labels_meta_path(path), meta)
