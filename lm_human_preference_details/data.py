"""OAI's query texts and the sharded query stream.

Mirrors language/datasets.py (data order, sharding); the text sources (datasets/{books,tldr,cnndm}.py) live in
sources.py, the per-text query construction and the task settings in tasks.py. Prompts from the user's data (the
successor recipe's queries: hf:NAME_OR_DIR, a .jsonl of objects) are built in prompts.py and streamed in the same order.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py
"""

import array
import logging
import os
import random
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.prompts import PromptQueries, PromptRows, is_hf_source, load_hf_rows, read_prompt_jsonl
from lm_human_preference_details.sources import (
    OAI_TEXT_SOURCES,
    HubTexts,
    load_task_texts,
    read_jsonl_texts,
    read_utf8,
)
from lm_human_preference_details.tasks import TaskHParams, build_query, encode_texts, text_to_token

logger = logging.getLogger(__name__)

_LOCAL_SUFFIXES = (".txt", ".jsonl")
_MAX_SCAN_WITHOUT_QUERY = 10_000


# ---------------------------------------------------------------- text sources


def _read_local_texts(path: str) -> list[str] | PromptRows:
    """Non-blank lines of a .txt file, or the `text` field (or bare string) of every row of a .jsonl file; the rows of
    a .jsonl of other objects (prompts: `prompt`, `messages` or a template's columns)."""
    if path.lower().endswith(".jsonl"):
        return read_prompt_jsonl(path) or read_jsonl_texts(path)
    text = read_utf8(path, "query dataset file", "--task.query_dataset")
    return [line for line in text.splitlines() if line.strip()]


def load_texts(query_dataset: str, split: str = "train") -> Sequence[str] | PromptRows:
    """The raw texts of a query dataset: books/tldr/cnndm (OAI's files, else HF stand-ins) or a local .txt/.jsonl;
    the prompt rows of hf:NAME_OR_DIR or of a .jsonl of objects without `text` (QueryStream makes them queries)."""
    if is_hf_source(query_dataset):
        return load_hf_rows(query_dataset, split)
    if query_dataset.lower().endswith(_LOCAL_SUFFIXES) or os.path.isfile(query_dataset):
        if not os.path.isfile(query_dataset):
            raise FileNotFoundError(f"query dataset file '{query_dataset}' does not exist; fix --task.query_dataset.")
        if not query_dataset.lower().endswith(_LOCAL_SUFFIXES):
            raise ValueError(f"query dataset file '{query_dataset}' must end in .txt or .jsonl.")
        texts = _read_local_texts(query_dataset)
        if not texts:
            raise ValueError(f"query dataset file '{query_dataset}' holds no texts.")
        return texts
    if query_dataset not in OAI_TEXT_SOURCES:
        raise ValueError(
            f"unknown --task.query_dataset '{query_dataset}'; choose one of {sorted(OAI_TEXT_SOURCES)} "
            "or a path to a .txt (one passage per line) or .jsonl ('text' field, or prompts) file, or hf:NAME_OR_DIR."
        )
    return load_task_texts(query_dataset, split)


# ---------------------------------------------------------------- query stream


def oai_shuffle_order(num_texts: int, seed: int) -> np.ndarray:
    """Indices of the texts in the order of OAI's `random.seed(seed); random.shuffle(texts)`, as an int array."""
    # OAI shuffles the text list with Python's random module (a NumPy permutation gives another order)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/datasets/books.py#L12-L14
    # shuffle moves items by position only, so shuffling 0..n-1 gives the order in which it moves the texts. A
    # private Random leaves Python's and NumPy's global RNGs (reward-label order, TV13) untouched; a 4-byte array
    # instead of a list keeps 74M bookcorpus rows at 0.3 GB, but the shuffle is a Python loop (about a minute there)
    if num_texts > 10_000_000:
        logger.info("shuffling %d texts with Python's random as OAI did; this takes about a minute", num_texts)
    order = array.array("i" if num_texts < 2**31 else "q", range(num_texts))
    random.Random(seed).shuffle(order)
    return np.frombuffer(order, dtype=np.int32 if order.typecode == "i" else np.int64)


class QueryStream:
    """OAI's query order: one fixed-seed permutation of the texts, repeated forever, valid queries rank-strided.

    `texts` are OAI's texts (queries built by `tasks.build_query`) or the prompt rows of `load_texts` (queries built by
    `prompts.PromptQueries`: nplus N2, whose start_text/end_text trimming does not apply), streamed in the same order.
    """

    def __init__(
        self,
        texts: Sequence[str] | PromptRows,
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
        self.prompts = PromptQueries(texts, tokenizer, task, 4 * chunk_size) if isinstance(texts, PromptRows) else None
        oai = self.prompts is None  # OAI's start_text/end_text trimming: OAI's texts only
        self.start_token = text_to_token(tokenizer, task.start_text, "--task.start_text") if oai else None
        self.end_token = text_to_token(tokenizer, task.end_text, "--task.end_text") if oai else None
        if self.prompts is not None and (task.start_text or task.end_text):
            # nplus N2 has no such trimming: a prompt is used whole, cut to fit only by its own rule
            logger.warning(
                "--task.start_text %r and --task.end_text %r trim OAI's texts; prompts from %s are used whole (cut "
                "to fit as nplus N2 cuts them), so both are ignored; pass None to silence this.",
                task.start_text,
                task.end_text,
                task.query_dataset,
            )
        # texts shuffled once with a fixed seed (not run.seed), identically on every rank, same order every pass
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py#L33-L46
        self.order = oai_shuffle_order(len(texts), data_seed)
        self._cursor = 0  # next position in the repeated permuted stream to tokenize
        self._num_valid = 0  # valid queries (all ranks) before _cursor
        self._consumed = (0, 0)  # (_cursor, _num_valid) just after the last query handed out
        self._last_texts: list[int] = []  # indices into `texts` of the last batch's queries
        self._buffer: deque[tuple[list[int], int, int]] = deque()
        self._logged = False

    def _fill(self) -> None:
        """Tokenize the next chunk of texts and buffer this rank's share of the valid queries."""
        n = len(self.texts)
        positions = self._cursor + np.arange(self.chunk_size)
        indices = self.order[positions % n]
        if self.prompts is not None:
            queries = self._prompt_queries(indices, first_pass=indices[positions < n])
        elif isinstance(self.texts, HubTexts):
            queries = self._queries(self.texts.take(indices))
        else:
            queries = self._queries([self.texts[i] for i in indices.tolist()])
        found = []
        for offset, query in enumerate(queries):
            if query is None:
                continue
            # tf.data shard(num_ranks, rank) after repeat(): rank r gets valid queries r, r + R, r + 2R, ...
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/datasets.py#L78-L85
            if self._num_valid % self.world_size == self.rank:
                self._buffer.append((query, self._cursor + offset + 1, self._num_valid + 1))
            self._num_valid += 1
            found.append(query)
        self._cursor += self.chunk_size
        if self._num_valid == 0 and self._cursor >= min(n, _MAX_SCAN_WITHOUT_QUERY) and self.prompts is not None:
            raise ValueError(
                f"--task.query_dataset '{self.prompts.source}' ({n} rows) gives no query: {self.prompts.describe()}. "
                f"{self.prompts.fix()}"
            )
        if self._num_valid == 0 and self._cursor >= min(n, _MAX_SCAN_WITHOUT_QUERY):
            raise ValueError(
                f"none of the first {min(self._cursor, n)} texts gives a query with start_text/end_text tokens "
                f"{self.start_token}/{self.end_token}; pass --task.start_text None / --task.end_text None "
                "or use another dataset."
            )
        if not self._logged and found:
            self._log_stats(len(found), len(queries), found)

    def _queries(self, texts: list[str]) -> list[list[int] | None]:
        """The query of each text (None: the text gives none)."""
        return [
            build_query(tokens, self.query_length, self.start_token, self.end_token, self.pad_id)
            for tokens in encode_texts(self.tokenizer, texts)
        ]

    def _prompt_queries(self, indices: np.ndarray, first_pass: np.ndarray) -> list[list[int] | None]:
        """The query (None: none) of each prompt row at file rows `indices`, each distinct row built once; the rows
        in `first_pass` (read for the first time) are counted in the prompts' statistics."""
        rows, inverse = np.unique(indices, return_inverse=True)
        built = self.prompts.queries(self.texts.take(rows), rows, counted=np.isin(rows, first_pass))
        return [built[i] for i in inverse.tolist()]

    def _log_stats(self, num_found: int, num_texts: int, found: list[list[int]]) -> None:
        """Log once how many texts give a query and how long queries are (spec G3: watch the padding)."""
        self._logged = True
        lengths = (np.asarray(found) != self.pad_id).sum(1)
        if self.prompts is not None:
            log = logger.warning if self.prompts.counts["too_long"] + self.prompts.counts["empty"] else logger.info
            log(
                "query stream: %s; query length mean %.1f, min %d, max %d of %d tokens",
                self.prompts.describe(),
                lengths.mean(),
                lengths.min(),
                lengths.max(),
                self.query_length,
            )
            return
        log = logger.warning if num_found < 0.1 * num_texts else logger.info
        log(
            "query stream: %d of %d texts give a query; query length mean %.1f, min %d, max %d of %d tokens",
            num_found,
            num_texts,
            lengths.mean(),
            lengths.min(),
            lengths.max(),
            self.query_length,
        )

    def next_batch(self, batch_size: int, virtual_ranks: int = 1) -> torch.Tensor:
        """This rank's next `batch_size` queries, (batch_size, query_length), right-padded with PAD.

        With `virtual_ranks` V (spec D4), the same queries come grouped: rows [g * G, (g + 1) * G), G = batch_size / V,
        are those that rank `rank + world_size * g` of world_size * V ranks would get, in its order.
        """
        if batch_size <= 0 or virtual_ranks <= 0 or batch_size % virtual_ranks:
            raise ValueError(f"batch_size {batch_size} must be a positive multiple of virtual_ranks {virtual_ranks}.")
        if self.prompts is not None:  # the messages of the batch handed out and of the buffer stay known
            self.prompts.keep = max(self.prompts.keep, 2 * batch_size + 2 * self.chunk_size)
        while len(self._buffer) < batch_size:
            self._fill()
        rows = [self._buffer.popleft() for _ in range(batch_size)]
        self._consumed = rows[-1][1:]
        self._last_texts = [int(self.order[(row[1] - 1) % len(self.texts)]) for row in rows]
        queries = torch.tensor([row[0] for row in rows], dtype=torch.long)  # (B, Lq)
        # this rank's i-th query is the stream's valid query rank + world_size * i; of world_size * V ranks, rank
        # rank + world_size * g gets those with i = g (mod V), so column g of the (G, V) grid of rows
        return queries.view(-1, virtual_ranks, self.query_length).transpose(0, 1).reshape(batch_size, -1)

    def last_batch_texts(self) -> list[int]:
        """The indices into `texts` of the texts the last `next_batch`'s queries were built from, in stream order
        (before any virtual-rank grouping): a stream that wrapped around within the batch repeats an index."""
        return list(self._last_texts)

    def conversation_of(self, query_tokens: Sequence[int]) -> list[dict[str, str]] | None:
        """The chat messages of the prompt whose encoded tokens (no PAD) are `query_tokens`, for a reward model with a
        tokenizer and chat template of its own: a chat row's messages (its last user message as cut to fit), or for a
        `prompt` text or --task.query_template row [{"role": "user", "content": the prompt text as formatted and cut}];
        None for OAI's text sources (books, tldr, cnndm, .txt, .jsonl of texts), whose queries are no chat. Known for
        the queries this stream or a deep copy of it handed out lately (at least the last two batches); None (and a
        warning, once) for other tokens.
        """
        if self.prompts is None:
            return None
        return self.prompts.conversation_of(query_tokens)

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
