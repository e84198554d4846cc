"""Text preference pairs (`prompt`, `chosen`, `rejected`), the format other libraries exchange (TRL publishes OAI's
sentiment and descriptiveness labels that way): read from JSON Lines, a `datasets` directory or a hub dataset, and
tokenized into best_of_2 label rows of OAI's schema, and back.

Convention: `sample0` is the chosen response and `sample1` the rejected one, so `best` is always 0. The prompt is
already a query (as in OAI's label files, whose queries were built from the corpus text): it is encoded as plain BPE,
truncated to its first query_length tokens and right-padded; responses are truncated to response_length and
right-padded, as OAI's label files hold them (spec R7, G1, G3).

TRL's other preference formats are read too (conversations.py): values that are lists of messages (the prompt rendered
with the chat template's generation prompt, each response the rest of its conversation's rendering), and rows without
`prompt` whose `chosen` and `rejected` both start with it.
"""

import json
import os
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details import conversations
from lm_human_preference_details.files import write_atomic
from lm_human_preference_details.hub import check_available
from lm_human_preference_details.labels import (
    OAI_LABEL_FOLDERS,
    PREFERENCE_PAIR_FIELDS,
    SCHEMA,
    TEXT_PAIRS_SCHEMA,
    Labels,
    get_label_type,
    load_labels,
)
from lm_human_preference_details.sources import read_utf8_lines
from lm_human_preference_details.tasks import build_query, encode_texts

CHOSEN_INDEX = 0
"""Index of the chosen response in a best_of_2 row (sample0); the rejected one is sample1."""
RESPONSE_FIELDS = PREFERENCE_PAIR_FIELDS[1:]
"""chosen, rejected: the fields every preference row holds (`prompt` is implicit in them when it is missing)"""


def _is_hub_dataset_name(source: str) -> bool:
    """True for a hub dataset id such as `trl-lib/tldr-preference` (not a local path, not one of OAI's files)."""
    parts = source.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not source.startswith((".", "/", "~", "http://", "https://"))
        and not source.endswith((".json", ".jsonl"))
        and parts[0] not in OAI_LABEL_FOLDERS
        and not os.path.exists(source)
    )


def _starts_with_text_pair(path: str) -> bool:
    """True when the file's first line is a JSON object with prompt, chosen and rejected (JSON Lines of pairs)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        line = f.readline()
    try:
        first = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(first, dict) and set(RESPONSE_FIELDS) <= set(first)


def is_text_preference_source(source: str) -> bool:
    """True for a JSON Lines file of pairs, a directory (save_to_disk or data files) or a hub dataset id."""
    if os.path.isdir(source):
        return True
    if os.path.isfile(source):
        return source.endswith(".jsonl") or _starts_with_text_pair(source)
    return _is_hub_dataset_name(source)


def _read_jsonl(path: str, flag: str) -> list[Any]:
    """The JSON value of every non-blank line of `path`; ValueError naming the line that is not JSON."""
    rows = []
    for number, line in enumerate(read_utf8_lines(path, "label file", flag), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{flag} '{path}': line {number} is not JSON ({e}); expected {TEXT_PAIRS_SCHEMA}."
                ) from e
    return rows


def _read_dataset(source: str, flag: str) -> list[Any]:
    """The rows of the `train` split of a save_to_disk directory, a directory of data files or a hub dataset (one
    clear line when offline)."""
    import datasets

    if any(os.path.isfile(os.path.join(source, name)) for name in ("dataset_info.json", "dataset_dict.json")):
        dataset = datasets.load_from_disk(source)
    elif os.path.isdir(source):
        try:  # data files, e.g. a hub dataset downloaded with `hf download`
            dataset = datasets.load_dataset(source)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(
                f"{flag} '{source}' is a directory without a dataset ({str(e).splitlines()[0] if str(e) else e!r}); "
                f"expected a save_to_disk directory or data files of {TEXT_PAIRS_SCHEMA}."
            ) from e
    else:
        check_available(source, flag, kind="dataset", filename="README.md")
        dataset = datasets.load_dataset(source)
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise ValueError(f"{flag} '{source}' has splits {list(dataset)} but no 'train' split; save one.")
        dataset = dataset["train"]
    return dataset.to_list()


def read_text_pairs(source: str, flag: str = "--label_dataset") -> list[dict[str, Any]]:
    """The (prompt, chosen, rejected) rows of a JSONL file, `datasets` directory or hub dataset, validated: each all
    texts, or all conversations (message lists, checked); an implicit prompt taken out of chosen and rejected."""
    rows = _read_jsonl(source, flag) if os.path.isfile(source) else _read_dataset(source, flag)
    if not rows:
        raise ValueError(f"{flag} '{source}' holds no rows; expected {TEXT_PAIRS_SCHEMA}.")
    pairs = []
    for i, row in enumerate(rows):
        found = sorted(row)[:8] if isinstance(row, dict) else type(row).__name__
        if not isinstance(row, dict) or not set(RESPONSE_FIELDS) <= set(row):
            raise ValueError(
                f"{flag} '{source}' is in neither schema: row {i} has fields {found}; expected {TEXT_PAIRS_SCHEMA}, or "
                f"OAI's label schema, {SCHEMA}."
            )
        where = f"{flag} '{source}': row {i}"
        pair = {name: row[name] for name in PREFERENCE_PAIR_FIELDS if row.get(name) is not None}
        if "prompt" not in pair:
            pair = dict(
                zip(PREFERENCE_PAIR_FIELDS, conversations.implicit_prompt(row["chosen"], row["rejected"], where))
            )
        chat = conversations.is_conversation(pair["prompt"])
        for name in PREFERENCE_PAIR_FIELDS:
            if chat:
                pair[name] = conversations.check_messages(pair[name], f"{where} '{name}'")
            elif not isinstance(pair[name], str):
                raise ValueError(
                    f"{where} field '{name}' is {type(pair[name]).__name__}, not a string (a text prompt takes text "
                    "responses; message lists go with a message-list prompt)."
                )
        pairs.append(pair)
    return pairs


def encode_pairs(
    pairs: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, where: str
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Token ids of each pair's prompt, chosen and rejected: texts as plain BPE, conversations through the chat
    template (`conversations.render_tokens`)."""
    texts = [i for i, pair in enumerate(pairs) if isinstance(pair["prompt"], str)]
    encoded = [encode_texts(tokenizer, [pairs[i][name] for i in texts]) for name in PREFERENCE_PAIR_FIELDS]
    tokens: list[list[list[int]]] = [[[] for _ in pairs] for _ in PREFERENCE_PAIR_FIELDS]
    for field, column in zip(tokens, encoded):
        for i, ids in zip(texts, column):
            field[i] = ids
    chats = [i for i, pair in enumerate(pairs) if not isinstance(pair["prompt"], str)]
    if chats:
        conversations.check_chat_template(tokenizer, where)
        conversations.check_plain_message_text(tokenizer, where)
    for i in chats:
        for side, name in ((1, "chosen"), (2, "rejected")):
            prompt, response = conversations.render_tokens(
                pairs[i]["prompt"], pairs[i][name], tokenizer, f"{where} row {i}"
            )
            tokens[0][i], tokens[side][i] = prompt, response
    return tokens[0], tokens[1], tokens[2]


def _without_eos(tokens: list[int], eos_id: int) -> list[int]:
    """`tokens` without a final `eos_id`, which a conversation's response ends with when the template's turn end is
    the EOS (it gets one EOS, not two); a text's tokens never end with it (their special-token texts are plain)."""
    return tokens[:-1] if tokens[-1:] == [eos_id] else tokens


def _pad_tokens(rows: list[list[int]], length: int, pad_id: int) -> list[list[int]]:
    """Each row truncated to its first `length` tokens and right-padded with `pad_id`."""
    return [row[:length] + [pad_id] * (length - len(row[:length])) for row in rows]


def tokenize_pairs(
    pairs: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    query_length: int,
    response_length: int,
    pad_id: int,
    where: str = "--label_dataset",
    eos_id: int | None = None,
) -> tuple[list[dict], dict[str, int]]:
    """best_of_2 rows of OAI's schema (tokenizer PAD): query = prompt, sample0 = chosen, sample1 = rejected, best 0;
    -> the rows and how many queries and samples were truncated. With `eos_id` (responses that end at EOS,
    --task.end_at_eos) every response ends with that token, kept when a long response is cut to response_length."""
    prompts, chosen, rejected = encode_pairs(pairs, tokenizer, where)
    if eos_id is not None:
        chosen, rejected = ([_without_eos(t, eos_id) for t in side] for side in (chosen, rejected))
    with_eos = int(eos_id is not None)
    truncated = {
        "truncated_queries": sum(len(prompt) > query_length for prompt in prompts),
        "truncated_samples": sum(len(tokens) + with_eos > response_length for tokens in [*chosen, *rejected]),
    }
    if eos_id is not None:
        # the successor recipe appends EOS to every preference response, as a token (nplus N3)
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/tldr_dataset.py#L261-L266
        chosen, rejected = ([t[: response_length - 1] + [eos_id] for t in side] for side in (chosen, rejected))
    rows = []
    for i, prompt in enumerate(prompts):
        if pad_id in prompt or pad_id in chosen[i] or pad_id in rejected[i]:
            raise ValueError(f"{where}: row {i} contains the text of the PAD token, which would read as padding.")
        query = build_query(list(prompt), query_length, None, None, pad_id)
        if query is None:
            raise ValueError(f"{where}: row {i} has an empty prompt; a query needs a real first token.")
        rows.append({"query": query})
    responses = _pad_tokens(chosen, response_length, pad_id), _pad_tokens(rejected, response_length, pad_id)
    for row, first, second in zip(rows, *responses):
        row.update(sample0=first, sample1=second, best=CHOSEN_INDEX)
    return rows, truncated


def load_text_labels(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    query_length: int,
    response_length: int,
    pad_id: int,
    num_train: int,
    label_type: str,
    flag: str = "--label_dataset",
    eos_id: int | None = None,
) -> Labels:
    """Text preference pairs as best_of_2 Labels tokenized for this run (`eos_id`: each response ends with it, see
    `tokenize_pairs`); ValueError for another --labels.type."""
    if get_label_type(label_type).name != "best_of_2":
        raise ValueError(
            f"{flag} '{source}' holds text preference pairs, which are best_of_2 labels (chosen vs rejected), not "
            f"{label_type}; pass --labels.type best_of_2."
        )
    pairs = read_text_pairs(source, flag)
    rows, _ = tokenize_pairs(pairs, tokenizer, query_length, response_length, pad_id, f"{flag} '{source}'", eos_id)
    if len(rows) < num_train:
        raise ValueError(
            f"{flag} '{source}' has {len(rows)} rows but num_train is {num_train}; lower --labels.num_train."
        )
    query = torch.tensor([row["query"] for row in rows], dtype=torch.long)  # (N, Lq)
    samples = torch.tensor([[row["sample0"], row["sample1"]] for row in rows], dtype=torch.long)  # (N, 2, L)
    label = torch.full((len(rows),), CHOSEN_INDEX, dtype=torch.long)  # (N,)
    return Labels(query=query, samples=samples, label=label)


def load_labels_or_pairs(
    source: str,
    query_length: int,
    response_length: int,
    pad_id: int,
    num_train: int,
    label_type: str,
    tokenizer: PreTrainedTokenizerBase,
    flag: str = "--label_dataset",
    eos_id: int | None = None,
) -> Labels:
    """--label_dataset as Labels: text pairs tokenized with `tokenizer` (`eos_id`: each response ends with it), else a
    label file of OAI's schema."""
    if is_text_preference_source(source):
        return load_text_labels(
            source, tokenizer, query_length, response_length, pad_id, num_train, label_type, flag, eos_id
        )
    return load_labels(source, query_length, response_length, pad_id, num_train, label_type, flag)


def label_rows_to_pairs(rows: list[dict], tokenizer: PreTrainedTokenizerBase, pad_id: int) -> list[dict[str, str]]:
    """best_of_2 rows of token ids (file PAD `pad_id`) as prompt/chosen/rejected texts (chosen: sample[best])."""
    fields = {"prompt": [row["query"] for row in rows]}
    fields["chosen"] = [row[f"sample{row['best']}"] for row in rows]
    fields["rejected"] = [row[f"sample{1 - row['best']}"] for row in rows]
    texts = {
        name: tokenizer.batch_decode(
            [[t for t in tokens if t != pad_id] for tokens in values], skip_special_tokens=False
        )
        for name, values in fields.items()
    }
    return [{name: texts[name][i] for name in fields} for i in range(len(rows))]


def save_text_pairs(path: str, pairs: list[dict[str, str]]) -> None:
    """Write prompt/chosen/rejected rows as JSON Lines, atomically."""
    write_atomic(
        path, lambda f: f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs), "--output"
    )
