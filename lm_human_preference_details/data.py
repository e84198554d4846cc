"""OAI's query datasets, query construction and sharded query stream, and the best-of-4 label files.

Mirrors lm_human_preferences/lm_tasks.py (task hparams, query formatting), language/datasets.py (query construction,
data order, sharding), datasets/{books,tldr,cnndm}.py (text sources) and train_reward.py (label files).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py
"""

import json
import logging
import os
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.hub import HubUnavailableError, check_available

logger = logging.getLogger(__name__)

# OAI's padding token: len(encoder) + 2, outside GPT-2's 50257-token vocabulary; label files use it
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/encodings.py#L56
OAI_PAD_TOKEN = 50259

LABELS_REPO = "vwxyzjn/lm-human-preferences"
"""HF hub dataset mirroring OAI's label files (e.g. sentiment/offline_5k.json)."""
LABELS_META_SUFFIX = ".meta.json"
"""Suffix of the metadata file written beside a generated label file; its `pad_id` overrides OAI_PAD_TOKEN."""
OAI_LABELS_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/"
"""Prefix of the label sources in OAI's launch.py; stripped to get the file name inside LABELS_REPO."""

HUB_TEXT_SOURCES = {
    "books": ("bookcorpus/bookcorpus", None, "text"),
    "tldr": ("CarperAI/openai_summarize_tldr", None, "prompt"),
    "cnndm": ("abisee/cnn_dailymail", "3.0.0", "article"),
}
"""query_dataset name -> (HF hub dataset id, config name, text column)."""

_LOCAL_SUFFIXES = (".txt", ".jsonl")
_MAX_SCAN_WITHOUT_QUERY = 10_000


@dataclass
class TaskHParams:
    """Query/response settings of one task; defaults are OAI's books task (sentiment, descriptiveness)."""

    query_length: int = 64
    """query tokens, right-padded with PAD (OAI launch.py#L9)"""
    query_dataset: str = "books"
    """books | tldr | cnndm (HF hub) or a local .txt (one passage per line) / .jsonl ("text" field) (launch.py#L10)"""
    query_prefix: str = ""
    """text put before the query for the policy only, never the reward model (launch.py#L22; lm_tasks.py#L68-L80)"""
    query_suffix: str = ""
    """text put after the query for the policy only, e.g. '\\n\\nTL;DR:' (launch.py#L23, #L37)"""
    start_text: str | None = "."
    """a query starts right after the first occurrence of this single-token text; None: no trimming (launch.py#L12)"""
    end_text: str | None = "."
    """a query ends at the last occurrence of this single-token text; None: no trimming (launch.py#L13)"""
    response_length: int = 24
    """sampled response tokens per query, fixed length, no EOS stop (launch.py#L11)"""
    truncate_token: int | None = 13
    """response tokens after its first occurrence at index >= truncate_after become PAD; 13 = '.' (launch.py#L14)"""
    truncate_after: int = 16
    """responses must contain truncate_token at index >= this to pass the filter (launch.py#L15)"""
    penalty_reward_value: float = -1.0
    """score given to responses that fail the filter, replacing the reward model's (lm_tasks.py#L32)"""
    temperature: float = 0.7
    """sampling temperature of the policy and reference policy, also applied to log-probs (launch.py#L17)"""


# launch.py's task presets; copy with dataclasses.replace before changing a field
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L8-L47
_BOOKS = dict(query_length=64, query_dataset="books", response_length=24, start_text=".", end_text=".")
_BOOKS.update(truncate_token=13, truncate_after=16, temperature=0.7)
_SUMMARIZE = dict(query_length=500, response_length=75, start_text=None, truncate_token=198, truncate_after=55)
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
    # DEVIATION: an empty text is skipped; OAI would yield an all-PAD query that fails its first-token-not-PAD
    # assertion in the transformer (model.py#L333-L340)
    if not tokens:
        return None
    return tokens + [pad_id] * (query_length - len(tokens))


def encode_context_affixes(tokenizer: PreTrainedTokenizerBase, task: TaskHParams) -> tuple[list[int], list[int]]:
    """Token ids of the task's query_prefix and query_suffix (empty lists when unset)."""
    prefix, suffix = encode_texts(tokenizer, [task.query_prefix, task.query_suffix])
    return list(prefix), list(suffix)


def format_contexts(queries: torch.Tensor, prefix: list[int], suffix: list[int]) -> torch.Tensor:
    """prefix ⊕ query ⊕ suffix for every row: the policy's context; the reward model sees raw queries."""
    # context = encode(prefix) ++ padded query ++ encode(suffix); PADs between query and suffix are invisible (G2)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L68-L80
    if queries.dim() != 2:
        raise ValueError(f"queries must be a (batch, query_length) tensor, got shape {tuple(queries.shape)}.")
    batch = queries.shape[0]
    pre = torch.tensor(prefix, dtype=queries.dtype, device=queries.device).expand(batch, -1)  # (B, P)
    suf = torch.tensor(suffix, dtype=queries.dtype, device=queries.device).expand(batch, -1)  # (B, S)
    return torch.cat([pre, queries, suf], dim=1)  # (B, P + Lq + S)


# ---------------------------------------------------------------- text sources


def clean_tldr_post(text: str) -> str:
    """A reddit post from the HF TL;DR prompts: drop its trailing 'TL;DR:', collapse 3+ newlines, strip."""
    # OAI: ftfy, newlines {3,} -> 2, strip; its posts carry no "TL;DR:" (the task suffix adds it)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/tldr.py#L24-L29
    text = re.sub(r"\s*TL;DR:\s*$", "", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def clean_cnndm_article(text: str) -> str:
    """OAI's clean_up_start for an HF CNN/DM article: drop byline, '(CNN) --' dateline, 'UPDATED:' header, quotes."""
    # OAI drops a leading "By ..." byline, everything before "(CNN) --" / an early "(CNN)", everything up to an
    # "UPDATED: hh:mm ... <year>" header, straightens quotes, then collapses newlines and cuts at @highlight.
    # HF's articles are one line with " . " where the story files had line breaks, so the byline and header
    # patterns match up to " . " instead of a line end.
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/cnndm.py#L70-L103
    text = re.sub(r"^By\s+(?:\.\s+)?.{0,80}?\s\.\s+", "", text)
    text = re.split(r"\(CNN\) +--", text)[-1]
    text = re.split(r"\(CNN\)", text[:100])[-1] + text[100:]
    text = re.sub(r"^.{0,200}?UPDATED:\s+(?:\.\s+)?[0-9]{2}:[0-9]{2}.{0,40}?\b(?:19|20)[0-9]{2}\b\s*\.?\s*", "", text)
    # DEVIATION: OAI also runs ftfy.fix_text (not a dependency here); straightening double quotes too mirrors
    # ftfy's default uncurl_quotes
    text = text.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    text = re.sub(r"\n{3,}", "\n\n", text.strip())
    return text.split("@highlight")[0].strip()


class HubTexts(Sequence):
    """Lazy text column of an HF dataset: rows are read (and cleaned) only when indexed, never all at once."""

    def __init__(self, dataset: Any, column: str, clean: Callable[[str], str] | None = None):
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.clean = clean

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.take(range(*index.indices(len(self))))
        return self.take([index])[0]

    def take(self, indices: Sequence[int]) -> list[str]:
        """The (cleaned) texts at `indices`, read in one batched lookup."""
        texts = self.dataset[[int(i) for i in indices]][self.column]
        return [self.clean(t) for t in texts] if self.clean is not None else texts


def _read_local_texts(path: str) -> list[str]:
    """Non-blank lines of a .txt file, or the `text` field (or bare string) of every row of a .jsonl file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if path.lower().endswith(".txt"):
        return [line for line in lines if line.strip()]
    texts = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {lineno}: invalid JSON ({e}); write one {{'text': ...}} object per line.")
        # OAI's book_passages/*.jsonl rows are bare JSON strings (books.py#L8-L11); other rows need a "text" field
        text = row.get("text") if isinstance(row, dict) else row
        if not isinstance(text, str):
            raise ValueError(
                f"{path} line {lineno}: expected a JSON string or an object with a 'text' string, got {line[:80]!r}."
            )
        texts.append(text)
    return texts


def load_texts(query_dataset: str, split: str = "train") -> Sequence[str]:
    """The raw texts of a query dataset: books/tldr/cnndm from the HF hub, or a local .txt/.jsonl file."""
    if query_dataset.lower().endswith(_LOCAL_SUFFIXES) or os.path.isfile(query_dataset):
        if not os.path.isfile(query_dataset):
            raise FileNotFoundError(f"query dataset file '{query_dataset}' does not exist; fix --task.query_dataset.")
        if not query_dataset.lower().endswith(_LOCAL_SUFFIXES):
            raise ValueError(f"query dataset file '{query_dataset}' must end in .txt or .jsonl.")
        texts = _read_local_texts(query_dataset)
        if not texts:
            raise ValueError(f"query dataset file '{query_dataset}' holds no texts.")
        return texts
    if query_dataset not in HUB_TEXT_SOURCES:
        raise ValueError(
            f"unknown --task.query_dataset '{query_dataset}'; choose one of {sorted(HUB_TEXT_SOURCES)} "
            "or a path to a .txt (one passage per line) or .jsonl ('text' field) file."
        )
    repo_id, config, column = HUB_TEXT_SOURCES[query_dataset]
    check_available(repo_id, "--task.query_dataset", kind="dataset", filename="README.md")
    import datasets

    clean = None
    if query_dataset == "books":
        # DEVIATION: OAI's book_passages/*.jsonl (multi-sentence passages) is no longer public; HF bookcorpus has one
        # lower-cased sentence per row ending in " ." (token 764, not '.' = 13), so the books preset's
        # start_text/end_text '.' reject most rows
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/books.py#L7-L17
        logger.warning(
            "query_dataset 'books' reads HF bookcorpus: single sentences ending in ' .', on which start_text/end_text "
            "'.' skip most rows. Pass --task.start_text None --task.end_text None (as the HF blog does), or a local "
            ".jsonl of multi-sentence passages."
        )
    elif query_dataset == "tldr":
        # DEVIATION: OAI's tldr/{train,valid}-subset.json is not public; CarperAI's prompts are reddit posts
        # (subreddit, title, post) ending in "TL;DR:", which is stripped because the task suffix adds it
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/tldr.py#L10-L29
        clean = clean_tldr_post
    else:
        split = "validation" if split == "valid" else split
        clean = clean_cnndm_article
        logger.warning(
            "query_dataset 'cnndm' reads HF abisee/cnn_dailymail, whose articles join paragraphs with spaces: "
            "end_text '\\n' (the cnndm preset) finds no paragraph end; consider --task.end_text . or None."
        )
    dataset = datasets.load_dataset(repo_id, config, split=split)
    return HubTexts(dataset, column, clean)


# ---------------------------------------------------------------- query stream


class QueryStream:
    """OAI's query order: one fixed-seed permutation of the texts, repeated forever, valid queries rank-strided."""

    def __init__(
        self,
        texts: Sequence[str],
        tokenizer: PreTrainedTokenizerBase,
        task: TaskHParams,
        rank: int,
        world_size: int,
        data_seed: int = 0,
        chunk_size: int = 1024,
    ):
        if len(texts) == 0:
            raise ValueError(f"query dataset '{task.query_dataset}' holds no texts.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size}).")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; build it with tokenizer.load_tokenizer.")
        self.texts = texts
        self.tokenizer = tokenizer
        self.query_length = task.query_length
        self.rank, self.world_size, self.data_seed = rank, world_size, data_seed
        self.chunk_size = chunk_size
        self.pad_id = tokenizer.pad_token_id
        self.start_token = text_to_token(tokenizer, task.start_text, "--task.start_text")
        self.end_token = text_to_token(tokenizer, task.end_text, "--task.end_text")
        # texts shuffled once with a fixed seed (not run.seed), identically on every rank, same order every pass;
        # a private RandomState leaves NumPy's global RNG (reward-label order, TV13) untouched
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py#L33-L46
        order = np.random.RandomState(data_seed).permutation(len(texts))
        self.order = order.astype(np.int32) if len(texts) < 2**31 else order
        self._cursor = 0  # next position in the repeated permuted stream to tokenize
        self._num_valid = 0  # valid queries (all ranks) before _cursor
        self._consumed = (0, 0)  # (_cursor, _num_valid) just after the last query handed out
        self._buffer: deque[tuple[list[int], int, int]] = deque()
        self._logged = False

    def _fill(self) -> None:
        """Tokenize the next chunk of texts and buffer this rank's share of the valid queries."""
        n = len(self.texts)
        positions = self._cursor + np.arange(self.chunk_size)
        indices = self.order[positions % n]
        if isinstance(self.texts, HubTexts):
            texts = self.texts.take(indices)
        else:
            texts = [self.texts[i] for i in indices.tolist()]
        found = []
        for offset, tokens in enumerate(encode_texts(self.tokenizer, texts)):
            query = build_query(tokens, self.query_length, self.start_token, self.end_token, self.pad_id)
            if query is None:
                continue
            # tf.data shard(num_ranks, rank) after repeat(): rank r gets valid queries r, r + R, r + 2R, ...
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py#L78-L85
            if self._num_valid % self.world_size == self.rank:
                self._buffer.append((query, self._cursor + offset + 1, self._num_valid + 1))
            self._num_valid += 1
            found.append(query)
        self._cursor += self.chunk_size
        if self._num_valid == 0 and self._cursor >= min(n, _MAX_SCAN_WITHOUT_QUERY):
            raise ValueError(
                f"none of the first {min(self._cursor, n)} texts gives a query with start_text/end_text tokens "
                f"{self.start_token}/{self.end_token}; pass --task.start_text None / --task.end_text None "
                "or use another dataset."
            )
        if not self._logged and found:
            self._log_stats(len(found), len(texts), found)

    def _log_stats(self, num_found: int, num_texts: int, found: list[list[int]]) -> None:
        """Log once how many texts give a query and how long queries are (spec G3: watch the padding)."""
        self._logged = True
        lengths = (np.asarray(found) != self.pad_id).sum(1)
        log = logger.warning if num_found < 0.1 * num_texts else logger.info
        log(
            "query stream: %d of %d texts give a query; query length mean %.1f, min %d, max %d of %d tokens",
            num_found, num_texts, lengths.mean(), lengths.min(), lengths.max(), self.query_length,
        )

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """This rank's next `batch_size` queries, (batch_size, query_length), right-padded with PAD."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        while len(self._buffer) < batch_size:
            self._fill()
        rows = [self._buffer.popleft() for _ in range(batch_size)]
        self._consumed = rows[-1][1:]
        return torch.tensor([row[0] for row in rows], dtype=torch.long)  # (B, Lq)

    def state_dict(self) -> dict[str, int]:
        """Position in the stream just after the last query handed out (resume with load_state_dict)."""
        cursor, num_valid = self._consumed
        return dict(
            cursor=cursor,
            num_valid=num_valid,
            num_texts=len(self.texts),
            data_seed=self.data_seed,
            rank=self.rank,
            world_size=self.world_size,
        )

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream where `state` was taken; the dataset, seed and ranks must match."""
        expected = dict(num_texts=len(self.texts), data_seed=self.data_seed, rank=self.rank, world_size=self.world_size)
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if mismatched:
            raise ValueError(f"query stream state does not match this stream (saved, current): {mismatched}.")
        self._cursor, self._num_valid = state["cursor"], state["num_valid"]
        self._consumed = (self._cursor, self._num_valid)
        self._buffer.clear()


# ---------------------------------------------------------------- labels


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


def _resolve_label_source(source: str, flag: str = "--label_dataset") -> str:
    """A local path for `source`: the file itself, or a file of the HF mirror of OAI's labels downloaded."""
    if os.path.isfile(source):
        return source
    if source.startswith(("/", ".", "~")) or os.path.isdir(source):
        raise FileNotFoundError(f"label file '{source}' does not exist; fix {flag}.")
    filename = source.removeprefix(OAI_LABELS_URL)
    try:
        check_available(LABELS_REPO, flag, kind="dataset", filename=filename)
    except HubUnavailableError as e:
        raise HubUnavailableError(
            f"could not fetch label file '{filename}' of hub dataset '{LABELS_REPO}' (offline, not cached). On a "
            f"machine with internet run `hf download {LABELS_REPO} {filename} --repo-type dataset --local-dir DIR`, "
            f"copy DIR here and pass {flag} DIR/{filename}."
        ) from e
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(repo_id=LABELS_REPO, filename=filename, repo_type="dataset")
    except EntryNotFoundError as e:
        raise FileNotFoundError(
            f"hub dataset '{LABELS_REPO}' has no file '{filename}'; pass e.g. sentiment/offline_5k.json, "
            f"descriptiveness/offline_5k.json or a local JSON path as {flag}."
        ) from e


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
