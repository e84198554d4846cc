"""Label files in OAI's schema: the label types and their losses, reading, validation, writing and the metadata file.

The counterpart of lm_human_preferences/label_types.py (schemas and losses) and train_reward.py's label download.
OAI's files are JSON lists of rows padded with OAI's PAD 50259; files written by label_generation.py have a
`<file>.meta.json` beside them (labeler, tokenizer fingerprint, PAD id written, task, counts).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py
"""

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.core import write_json_atomic
from lm_human_preference_details.hub import HubUnavailableError, check_available
from lm_human_preference_details.sources import OAI_URL, SourceUnavailableError, announce_once, download_cached, oai_url

# OAI's padding token: len(encoder) + 2, outside GPT-2's 50257-token vocabulary; label files use it
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/encodings.py#L56
OAI_PAD_TOKEN = 50259

LABELS_REPO = "vwxyzjn/lm-human-preferences"
"""HF hub dataset mirroring OAI's label files (e.g. sentiment/offline_5k.json)."""
LABELS_META_SUFFIX = ".meta.json"
"""Suffix of the metadata file written beside a generated label file; its `pad_id` overrides OAI_PAD_TOKEN."""
OAI_LABELS_URL = f"{OAI_URL}labels/"
"""Prefix of the label sources in OAI's launch.py; stripped to get the file name (the same inside LABELS_REPO)."""


# ---------------------------------------------------------------- label types


def best_of_n_loss(rewards: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Softmax cross-entropy over the N responses of each label row (B, N), target = the labeled best one (B,)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L44-L49
    return F.cross_entropy(rewards, best)


# ---------------------------------------------------------------- reading


@dataclass
class Labels:
    """best-of-N label rows: queries, the N sampled responses and the index of the best one."""

    query: torch.Tensor
    """(N, query_length) long, right-padded with the tokenizer's PAD"""
    samples: torch.Tensor
    """(N, num_samples, response_length) long, PAD after a truncation point"""
    best: torch.Tensor
    """(N,) long, index of the preferred sample"""

    def __len__(self) -> int:
        return self.query.shape[0]

    def __getitem__(self, rows: slice | torch.Tensor) -> "Labels":
        """The label rows selected by a slice or an index tensor."""
        return Labels(self.query[rows], self.samples[rows], self.best[rows])


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


def _label_fields(num_samples: int) -> list[str]:
    """OAI's best_of_N schema field names: query, sample0..sample{N-1}, best."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L55
    return ["query", *[f"sample{i}" for i in range(num_samples)], "best"]


def _check_label_rows(rows: Any, lengths: dict[str, int], num_samples: int, where: str) -> None:
    """ValueError naming the row index and field of the first malformed row (structure and lengths only)."""
    if not isinstance(rows, list):
        raise ValueError(f"{where}: expected a JSON list of label rows, got {type(rows).__name__}.")
    fields = _label_fields(num_samples)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} is a {type(row).__name__}, expected an object with fields {fields}.")
        for field in fields:
            if field not in row:
                raise ValueError(f"{where}: row {i} is missing field '{field}' (fields: {fields}).")
            value = row[field]
            if field == "best":
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < num_samples:
                    expected = f"an int in [0, {num_samples})"
                    raise ValueError(f"{where}: row {i} field 'best' = {value!r}, expected {expected}.")
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


def _read_json_rows(path: str, where: str) -> Any:
    """The parsed JSON content of a label file; ValueError naming the file when it is not JSON."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e}).") from e


def read_label_rows(source: str, flag: str = "--label_dataset") -> tuple[list[dict], int, int]:
    """Rows of a best-of-N label file of any lengths, validated against its first row; -> rows, N, the file's PAD."""
    path = _resolve_label_source(source, flag)
    where = f"label file '{source}'"
    rows = _read_json_rows(path, where)
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    num_samples = sum(1 for key in first if re.fullmatch(r"sample[0-9]+", key))
    if not num_samples or not isinstance(first.get("query"), list):
        raise ValueError(
            f"{where} is not in OAI's best-of-N schema: expected a non-empty JSON list of objects with fields query, "
            f"sample0..sampleN-1 and best, got {type(rows).__name__} with first row keys {sorted(first)[:8]}."
        )
    lengths = {key: len(value) for key, value in first.items() if key in _label_fields(num_samples) and key != "best"}
    _check_label_rows(rows, lengths, num_samples, where)
    for field in lengths:
        _token_array(rows, field, where)
    return rows, num_samples, label_file_pad_id(path)


def load_labels(
    source: str, query_length: int, response_length: int, pad_id: int, num_train: int, num_samples: int = 4
) -> Labels:
    """OAI best-of-N label file (local JSON or a file of the HF mirror), validated, the file's PAD mapped to pad_id.

    The file's PAD is OAI's 50259, or the `pad_id` of a `<file>.meta.json` beside it (label_generation.py writes one).
    """
    # OAI: a JSON list of {query, sample0..3, best} rows; at least num_train rows, the first num_train are trained on
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L64-L96
    path = _resolve_label_source(source)
    where = f"label file '{source}'"
    rows = _read_json_rows(path, where)
    lengths = {"query": query_length, **{f"sample{i}": response_length for i in range(num_samples)}}
    _check_label_rows(rows, lengths, num_samples, where)
    if len(rows) < num_train:
        raise ValueError(f"{where} has {len(rows)} rows but num_train is {num_train}; lower --labels.num_train.")
    query = _token_array(rows, "query", where)  # (N, Lq)
    samples = np.stack([_token_array(rows, f"sample{i}", where) for i in range(num_samples)], axis=1)  # (N, S, L)
    best = np.array([row["best"] for row in rows], dtype=np.int64)  # (N,)
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
    return Labels(query=torch.from_numpy(query), samples=torch.from_numpy(samples), best=torch.from_numpy(best))


def save_labels(path: str, labels_rows: list[dict], pad_id: int | None = None) -> None:
    """Write label rows (lists or tensors) in OAI's JSON schema; tokens equal to pad_id are written as OAI's PAD."""
    if not labels_rows:
        raise ValueError(f"no label rows to write to '{path}'.")
    rows = [
        {k: v.tolist() if isinstance(v, (torch.Tensor, np.ndarray, np.generic)) else v for k, v in row.items()}
        if isinstance(row, dict)
        else row
        for row in labels_rows
    ]
    first = rows[0] if isinstance(rows[0], dict) else {}
    num_samples = sum(1 for key in first if re.fullmatch(r"sample[0-9]+", key))
    lengths = {key: len(value) for key, value in first.items() if isinstance(value, list)}
    where = f"labels for '{path}'"
    _check_label_rows(rows, lengths, num_samples, where)
    if pad_id is not None:
        # LG: write PAD as OAI's 50259 so the file reads like OAI's label files
        for field in lengths:
            tokens = _token_array(rows, field, where)
            tokens[tokens == pad_id] = OAI_PAD_TOKEN
            for row, values in zip(rows, tokens.tolist()):
                row[field] = values
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rows, f)
    os.replace(tmp, path)


def oai_pad_compatible(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when OAI's PAD 50259 is not a real token of this tokenizer, so files can be padded with it."""
    return OAI_PAD_TOKEN >= len(tokenizer) or tokenizer.pad_token_id == OAI_PAD_TOKEN


def save_label_file(path: str, rows: list[dict], pad_id: int, file_pad_id: int, meta: dict) -> None:
    """Rows (tokenizer PAD) in OAI's schema with PAD written as file_pad_id, then the metadata beside them."""
    save_labels(path, rows, pad_id=pad_id if file_pad_id == OAI_PAD_TOKEN else None)
    write_json_atomic(labels_meta_path(path), meta)
