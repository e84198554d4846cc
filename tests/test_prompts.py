"""Prompts from the user's data (nplus N1, N2, N5, N7): hf: datasets and .jsonl rows of `prompt`, `messages` or a
template's columns, cut to query_length as N+ cuts them, streamed in OAI's order and sharding; the chat messages of a
query for a reward model with its own tokenizer; right padding giving the log-probs of N+'s left padding."""

import copy
import dataclasses
import json
import logging
import random

import datasets
import pytest
import torch

from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.kernels import logprobs_from_logits
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.prompts import PromptRows
from lm_human_preference_details.tasks import (
    TASKS,
    TaskHParams,
    check_task,
    encode_context_affixes,
    encode_texts,
    task_differences,
)
from lm_human_preference_details.tokenizer import _with_distinct_pad
from tests import archs
from tests.planted import run_script

TLDR_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
"""N+'s TL;DR query format (nplus N2)"""


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def prompt_task(query_dataset: str, query_length: int = 24, **fields) -> TaskHParams:
    """A task reading prompts: no OAI trimming, short responses."""
    return TaskHParams(
        query_length=query_length, query_dataset=query_dataset, response_length=4, start_text=None, **fields
    )


def unpadded(batch: torch.Tensor, pad_id: int) -> list[list[int]]:
    return [[t for t in row if t != pad_id] for row in batch.tolist()]


def one_pass(source, tokenizer, task, **kwargs) -> tuple[QueryStream, list[list[int]]]:
    """A stream over `source` and its queries of one pass over the rows (PAD dropped)."""
    texts = load_texts(task.query_dataset, task.query_split) if source is None else source
    stream = QueryStream(texts, tokenizer, task, 0, 1, **kwargs)
    return stream, unpadded(stream.next_batch(len(texts)), tokenizer.pad_token_id)


def nplus_reference(fmt: str, info: dict, field: str, length: int, encode) -> list[int]:
    """N+'s process_query (tldr_dataset.py#L125-L158), re-implemented plainly: encode the formatted query; while it is
    longer than `length`, cut `field` at its last newline (none: drop one character) and encode again."""
    info = dict(info)
    tokens = encode(fmt.format(**info))
    while len(tokens) > length:
        if not info[field]:
            raise ValueError("Could not truncate enough!")
        i = -1
        if "\n" in info[field]:
            i = info[field].rindex("\n")
        info[field] = info[field][:i]
        tokens = encode(fmt.format(**info))
    return tokens


def chat_tokenizer(family: str):
    """The family's stand-in tokenizer with the project's PAD and the family's chat template."""
    return archs.with_chat_template(_with_distinct_pad(archs.family_tokenizer(family)), family)


POSTS = [
    {"subreddit": "cats", "title": "My cat", "post": "The cat sat.\nThen it slept on the mat all day long.\nThe end."},
    {"subreddit": "dogs", "title": "A dog", "post": "A dog ran to the river and back again before the rain"},
    {"subreddit": "books", "title": "Short", "post": "Fine."},
    {"subreddit": "cats", "title": "Long one", "post": "One.\nTwo two.\nThree three three.\nFour four four four."},
]


# ---------------------------------------------------------------- sources


def test_jsonl_prompts_become_right_padded_queries_of_their_plain_text(tmp_path, tokenizer):
    prompts = [f"Prompt {i}: the cat sat <|endoftext|> [PAD]\nand slept" for i in range(6)]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "id": i} for i, p in enumerate(prompts)])
    rows = load_texts(path)
    assert isinstance(rows, PromptRows) and len(rows) == 6
    task = prompt_task(path, query_length=32)
    stream = QueryStream(rows, tokenizer, task, 0, 1)
    batch = stream.next_batch(6)
    pad = tokenizer.pad_token_id
    real = batch != pad
    assert batch.shape == (6, 32) and real[:, 0].all() and torch.equal(real, real.cummin(1).values)  # right-padded
    # plain characters: the special-token texts of the data never become PAD or EOS
    assert sorted(unpadded(batch, pad)) == sorted(encode_texts(tokenizer, prompts))


def test_jsonl_of_texts_still_reads_as_oai_texts(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "one.", "prompt": "p"}, "two."])
    assert load_texts(path) == ["one.", "two."]


def save_posts(path, splits: dict[str, list[dict]]) -> str:
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return str(path)


def test_hf_directory_with_template_reads_the_split_asked_for(tmp_path, tokenizer):
    directory = save_posts(tmp_path / "posts", {"train": POSTS[:2], "test": POSTS[2:]})
    task = prompt_task(f"hf:{directory}", query_length=200, query_template=TLDR_TEMPLATE, query_split="test")
    _, queries = one_pass(None, tokenizer, task)
    assert sorted(queries) == sorted(encode_texts(tokenizer, [TLDR_TEMPLATE.format(**row) for row in POSTS[2:]]))


def test_hf_directory_of_one_dataset_and_a_missing_split(tmp_path, tokenizer):
    single = tmp_path / "single"
    datasets.Dataset.from_list([{"prompt": "Hello there."}]).save_to_disk(str(single))
    assert load_texts(f"hf:{single}").take([0]) == [{"prompt": "Hello there."}]
    directory = save_posts(tmp_path / "posts", {"train": POSTS})
    with pytest.raises(ValueError, match=r"hf:.*has splits \['train'\] but no 'valid'.*--task.query_split"):
        load_texts(f"hf:{directory}", "valid")


def test_hf_hub_dataset_offline_fails_in_one_line_naming_the_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailableError) as error:
        load_texts("hf:nobody-here/no-such-prompts")
    message = str(error.value)
    assert "\n" not in message and "--task.query_dataset hf:nobody-here/no-such-prompts" in message
    assert "pass --task.query_dataset hf:DIR" in message


# ---------------------------------------------------------------- N2: the cut


@pytest.mark.parametrize("query_length", [27, 30, 34, 40])
def test_cut_at_the_last_newline_matches_a_plain_reimplementation_of_nplus_n2(tmp_path, tokenizer, query_length):
    path = write_jsonl(tmp_path / "posts.jsonl", POSTS)
    fields = dict(query_template=TLDR_TEMPLATE, query_truncate_field="post")
    stream, queries = one_pass(None, tokenizer, prompt_task(path, query_length, **fields))

    def encode(text):
        return encode_texts(tokenizer, [text])[0]

    expected = [nplus_reference(TLDR_TEMPLATE, row, "post", query_length, encode) for row in POSTS]
    assert sorted(queries) == sorted(expected)
    assert stream.prompts.counts["cut"] == sum(len(encode(TLDR_TEMPLATE.format(**r))) > query_length for r in POSTS)


def test_cut_keeps_whole_lines_and_drops_characters_only_without_a_newline(tmp_path, tokenizer):
    lines = ["one two three", "four five six", "seven eight nine"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "\n".join(lines)}, {"prompt": "a b c d e f g h i j k l"}])
    stream, queries = one_pass(None, tokenizer, prompt_task(path, query_length=4))
    texts = sorted(tokenizer.decode(q) for q in queries)
    # two cuts, each at the last newline: the first line stays whole (3 tokens); the text without a newline loses one
    # character at a time until it fits: 4 tokens (with its trailing space it would be 5)
    assert texts == ["a b c d", "one two three"]
    assert stream.prompts.counts == dict(rows=2, cut=2, too_long=0, empty=0)


@pytest.mark.parametrize("query_length", [30, 61, 95])
def test_a_long_cut_without_newlines_drops_characters_as_nplus_n2_does(tmp_path, tokenizer, query_length):
    # hundreds of characters to drop: found by bisection and a step over the last STEP_WINDOW, the same cut as N+'s
    # one character at a time; words of the merges' edge cases (URLs, digits, punctuation) make the counts uneven
    rng = random.Random(query_length)
    words = ["the", "cat", "https://example.org/a_b?c=1", "1234567", "don't", "...", "Mr.", "naïve", "日本", "x"]
    post = " ".join(rng.choice(words) for _ in range(120))
    path = write_jsonl(tmp_path / "p.jsonl", [{"title": "A title", "post": post}])
    task = prompt_task(path, query_length, query_template="TITLE: {title}\n\nPOST: {post}\n\nTL;DR:")
    _, queries = one_pass(None, tokenizer, dataclasses.replace(task, query_truncate_field="post"))
    expected = nplus_reference(
        task.query_template,
        {"title": "A title", "post": post},
        "post",
        query_length,
        lambda t: encode_texts(tokenizer, [t])[0],
    )
    assert queries == [expected] and len(tokenizer.decode(expected)) < len(post) - 64


def test_prompts_that_cannot_be_cut_are_dropped_and_counted(tmp_path, tokenizer, caplog):
    rows = [{"title": "short", "post": "p"}, {"title": "a much longer title than the query can ever hold", "post": "p"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    task = prompt_task(path, 8, query_template="TITLE: {title}\n{post}", query_truncate_field="post")
    with caplog.at_level(logging.INFO, logger="lm_human_preference_details.data"):
        stream = QueryStream(load_texts(path), tokenizer, task, 0, 1, chunk_size=2)
        assert (
            unpadded(stream.next_batch(2), tokenizer.pad_token_id) == encode_texts(tokenizer, ["TITLE: short\np"]) * 2
        )
    log = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "1 of 2 prompts read give a query" in log and "1 still longer than --task.query_length 8" in log


def test_a_source_where_no_prompt_fits_stops_in_one_line_with_the_counts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"title": "far too long a title for eight tokens", "post": "x\ny"}])
    task = prompt_task(path, 8, query_template="TITLE: {title}\n{post}", query_truncate_field="post")
    stream = QueryStream(load_texts(path), tokenizer, task, 0, 1, chunk_size=4)
    with pytest.raises(ValueError) as error:
        stream.next_batch(1)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"--task.query_dataset '{path}' (1 rows) gives no query")
    assert "0 of 1 prompts read give a query" in message and "--task.query_truncate_field 'post'" in message
    assert "Raise --task.query_length or shorten --task.query_template" in message


# ---------------------------------------------------------------- chats


CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat sat\non the mat\nin the sun"}],
    [{"role": "user", "content": "a dog ran <|im_start|> <|eot_id|> <|begin_of_text|> away"}],
    [
        {"role": "user", "content": "name a fruit"},
        {"role": "assistant", "content": "plums"},
        {"role": "user", "content": "and a tree?"},
    ],
]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chats_render_with_the_generation_prompt_and_one_bos(tmp_path, family):
    tokenizer = chat_tokenizer(family)
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat} for chat in CHATS])
    task = prompt_task(path, query_length=120)
    _, queries = one_pass(None, tokenizer, task)
    rendered = tokenizer.apply_chat_template(
        CHATS, add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True
    )
    bos = [tokenizer.convert_tokens_to_ids(archs.BOS_TEXT)] if family == "llama" else None
    if bos is not None:  # the template writes Llama 3's BOS; the project puts it in front of every context itself
        assert all(tokens[:1] == bos for tokens in rendered)
        rendered = [tokens[1:] for tokens in rendered]
    assert sorted(queries) == sorted(rendered)
    prefix, _ = encode_context_affixes(tokenizer, task)
    for query in queries:
        context = prefix + query
        if bos is not None:
            assert context[:1] == bos and context.count(bos[0]) == 1  # exactly one BOS, in front
        else:
            assert prefix == []
        header = "<|start_header_id|>assistant<|end_header_id|>\n\n" if family == "llama" else "<|im_start|>assistant\n"
        assert tokenizer.decode(query).endswith(header)  # the generation prompt
    # the template's control tokens are special tokens; the same text inside a message stays plain characters
    second = next(q for q in queries if "dog" in tokenizer.decode(q))
    plain = [{"role": "user", "content": "a dog ran away"}]
    neutral = tokenizer.apply_chat_template(plain, add_generation_prompt=True, return_dict=False)[len(bos or []) :]
    specials = set(tokenizer.all_special_ids)
    assert [t for t in second if t in specials] == [t for t in neutral if t in specials]
    assert len([t for t in neutral if t in specials]) >= 2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chats_too_long_lose_the_last_lines_of_the_last_user_message(tmp_path, family):
    tokenizer = chat_tokenizer(family)
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}])
    full = len(tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, return_dict=False))
    bos = 1 if family == "llama" else 0
    task = prompt_task(path, query_length=full - bos - 2)
    stream, queries = one_pass(None, tokenizer, task)

    def encode(content):
        chat = [CHATS[0][0], {"role": "user", "content": content}]
        tokens = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        return tokens[bos:]

    expected = nplus_reference("{c}", {"c": CHATS[0][1]["content"]}, "c", task.query_length, encode)
    assert queries == [expected]
    assert stream.conversation_of(queries[0]) == [CHATS[0][0], {"role": "user", "content": "the cat sat\non the mat"}]


def test_a_prompt_column_holding_chats_reads_as_messages(tmp_path):
    tokenizer = chat_tokenizer("qwen2")  # TRL's conversational prompt-only rows: {"prompt": [messages]}
    as_prompt = write_jsonl(tmp_path / "p.jsonl", [{"prompt": chat} for chat in CHATS])
    as_messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat} for chat in CHATS])
    _, first = one_pass(None, tokenizer, prompt_task(as_prompt, 120))
    _, second = one_pass(None, tokenizer, prompt_task(as_messages, 120))
    assert first == second and len(first) == len(CHATS)


def test_chats_need_a_tokenizer_with_a_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}])
    with pytest.raises(ValueError, match=r"holds chats .*tokenizer of --base_model has no chat template"):
        QueryStream(load_texts(path), tokenizer, prompt_task(path), 0, 1)


def test_a_chat_ending_with_the_answer_is_refused(tmp_path):
    tokenizer = chat_tokenizer("qwen2")
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path = write_jsonl(tmp_path / "chats.jsonl", rows)
    stream = QueryStream(load_texts(path), tokenizer, prompt_task(path), 0, 1)
    with pytest.raises(ValueError, match=r"row 0 ends with an 'assistant' message"):
        stream.next_batch(1)


# ---------------------------------------------------------------- conversation_of


def test_conversation_of_gives_the_messages_of_each_query(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "posts.jsonl", POSTS)
    task = prompt_task(path, 30, query_template=TLDR_TEMPLATE, query_truncate_field="post")
    stream = QueryStream(load_texts(path), tokenizer, task, 0, 1)
    copied = copy.deepcopy(stream)  # the reward's normalization samples the first queries from a copy of the stream
    drawn = copied.next_batch(4).tolist()
    assert [stream.conversation_of(row) for row in drawn] == [copied.conversation_of(row) for row in drawn]
    batch = stream.next_batch(4)
    for row in batch.tolist():  # padded or not, the same messages: one user message, the prompt as formatted and cut
        conversation = stream.conversation_of(row)
        assert conversation == stream.conversation_of([t for t in row if t != tokenizer.pad_token_id])
        assert [m["role"] for m in conversation] == ["user"]
        assert encode_texts(tokenizer, [conversation[0]["content"]])[0] == unpadded(torch.tensor([row]), 50257)[0]
    contents = [stream.conversation_of(row)[0]["content"] for row in batch.tolist()]
    assert "SUBREDDIT: r/books\n\nTITLE: Short\n\nPOST: Fine.\n\nTL;DR:" in contents
    assert any(c.endswith("POST: The cat sat.\n\nTL;DR:") for c in contents)  # cut at the post's last newlines
    assert stream.conversation_of([1, 2, 3]) is None  # no query of this stream: the reward model reads the text
    oai = QueryStream(["A text. Another one."], tokenizer, TASKS["sentiment"], 0, 1)
    assert oai.conversation_of(oai.next_batch(1)[0].tolist()) is None


# ---------------------------------------------------------------- order, sharding, resume


def numbered_prompts(tmp_path, n: int = 30) -> str:
    return write_jsonl(tmp_path / "n.jsonl", [{"prompt": f"Prompt number {i}."} for i in range(n)])


def test_prompt_streams_shard_by_rank_and_resume(tmp_path, tokenizer):
    path = numbered_prompts(tmp_path)
    task = prompt_task(path, 8)
    rows = load_texts(path)
    single = QueryStream(rows, tokenizer, task, 0, 1, data_seed=3, chunk_size=7).next_batch(40)
    ranks = [QueryStream(rows, tokenizer, task, r, 2, data_seed=3, chunk_size=7).next_batch(20) for r in range(2)]
    assert torch.equal(torch.stack(ranks, 1).reshape(40, -1), single)  # valid queries r, r + 2, r + 4, ... per rank
    assert not torch.equal(QueryStream(rows, tokenizer, task, 0, 1, data_seed=4).next_batch(40), single)
    stream = QueryStream(rows, tokenizer, task, 1, 2, data_seed=3, chunk_size=7)
    stream.next_batch(5)
    resumed = QueryStream(rows, tokenizer, task, 1, 2, data_seed=3, chunk_size=7)
    resumed.load_state_dict(stream.state_dict())
    assert torch.equal(resumed.next_batch(9), stream.next_batch(9))


def test_start_and_end_text_are_ignored_for_prompts_with_a_warning(tmp_path, tokenizer, caplog):
    path = numbered_prompts(tmp_path, 4)
    with caplog.at_level(logging.WARNING, logger="lm_human_preference_details.data"):
        _, queries = one_pass(None, tokenizer, dataclasses.replace(prompt_task(path, 8), start_text=".", end_text="."))
    assert sorted(queries) == sorted(encode_texts(tokenizer, [f"Prompt number {i}." for i in range(4)]))
    assert any("--task.start_text '.' and --task.end_text '.'" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- flags and errors


def test_saved_tasks_without_the_prompt_fields_compare_equal_at_their_defaults():
    task = TASKS["tldr"]
    saved = {k: v for k, v in dataclasses.asdict(task).items() if not k.startswith(("query_split", "query_t"))}
    assert task_differences(saved, task) == {}
    changed = dataclasses.replace(task, query_split="test")
    assert task_differences(saved, changed) == {"query_split": ("<not recorded>", "test")}


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(query_template="{title}", query_truncate_field="post"), r"'post' is not a field of .*\['title'\]"),
        (dict(query_template="{0} {title}"), r"names \['0'\]; name columns plainly"),
        (dict(query_template="{title"), r"--task.query_template '\{title' is not a format string"),
        (dict(query_truncate_field="post"), r"'post' needs a --task.query_template"),
        (dict(query_split=""), r"--task.query_split must name a split"),
        (dict(query_dataset="books", query_template="{text}"), r"'books' holds plain texts; pass hf:NAME_OR_DIR"),
        (dict(query_dataset="q.txt", query_truncate_field="prompt"), r"--task.query_truncate_field reads the col"),
    ],
)
def test_check_task_names_the_prompt_flag_that_cannot_work(fields, match):
    task = dataclasses.replace(prompt_task("hf:some/prompts"), **fields)
    with pytest.raises(ValueError, match=match):
        check_task(task)


def test_columns_a_prompt_needs_are_listed_when_missing(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "posts.jsonl", POSTS)
    with pytest.raises(ValueError, match=r"names \['body'\], which .* does not have; its columns: \['subreddit', 'ti"):
        QueryStream(load_texts(path), tokenizer, prompt_task(path, query_template="{title} {body}"), 0, 1)
    with pytest.raises(ValueError, match=r"has no `prompt` or `messages` column \(its columns: \['subreddit', 'ti"):
        QueryStream(load_texts(path), tokenizer, prompt_task(path), 0, 1)


def test_sources_without_rows_are_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^--task.query_dataset hf:.*empty could not be read as a dataset \("):
        load_texts(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(FileNotFoundError, match=r"--task.query_dataset hf:\./nowhere/at/all: no such directory"):
        load_texts("hf:./nowhere/at/all")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds no texts"):
        load_texts(str(blank))


# ---------------------------------------------------------------- padding (nplus N5, N7)


def nplus_left_padded_logprobs(model, query_responses: torch.Tensor, context: int, pad_id: int, temperature: float):
    """Response log-probs as N+ computes them: left-padded queries, PAD ids set to 0, the mask as attention mask and
    position ids the exclusive cumsum of the mask (TRL12 trl/trainer/utils.py#L1095, nplus N7)."""
    mask = query_responses != pad_id
    positions = mask.long().cumsum(1) - mask.long()
    logits = model(
        input_ids=query_responses.masked_fill(~mask, 0), attention_mask=mask.long(), position_ids=positions
    ).logits
    return logprobs_from_logits(logits[:, context - 1 : -1] / temperature, query_responses[:, context:])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_right_padded_queries_give_the_response_logprobs_of_left_padded_ones(family):
    tokenizer = archs.family_tokenizer(family)
    model = archs.family_model(family, tokenizer)  # PAD, added next, lies outside its vocabulary as GPT-2's does
    pad = _with_distinct_pad(tokenizer).pad_token_id
    bos = [tokenizer.bos_token_id] if family == "llama" else []
    queries = [bos + encode_texts(tokenizer, [text])[0] for text in ("the cat sat", "a dog ran to the river and")]
    length, temperature = 12, 0.7
    responses = torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(0))
    right = torch.tensor([q + [pad] * (length - len(q)) for q in queries])
    left = torch.tensor([[pad] * (length - len(q)) + q for q in queries])
    policy = PolicyWithValueHead(model)
    with torch.no_grad():
        logits, _ = policy(torch.cat([right, responses], 1), length, pad, temperature)  # the training forward
        ours = logprobs_from_logits(logits, responses)
        theirs = nplus_left_padded_logprobs(model, torch.cat([left, responses], 1), length, pad, temperature)
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
        if family == "gpt2":  # learned absolute positions: without N7's position ids, left padding changes them
            mask = torch.cat([left, responses], 1) != pad
            plain = model(input_ids=torch.cat([left, responses], 1).masked_fill(~mask, 0), attention_mask=mask.long())
            shifted = logprobs_from_logits(plain.logits[:, length - 1 : -1] / temperature, responses)
            assert (shifted - theirs).abs().max() > 1e-3


# ---------------------------------------------------------------- end to end


REWARD = """
import json, os


def record(queries, responses):
    with open(os.environ["PROMPTS_SEEN"], "a", encoding="utf-8") as f:
        f.writelines(json.dumps(q) + "\\n" for q in queries)
    return [float(len(r)) for r in responses]
"""


def test_train_policy_trains_on_a_jsonl_of_posts_formatted_and_cut(tmp_path, tiny_model_dir, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "posts.jsonl", POSTS)
    (tmp_path / "reward.py").write_text(REWARD, encoding="utf-8")
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("PROMPTS_SEEN", str(seen))
    flags = [
        *("--base_model", tiny_model_dir, "--rewards.trained_model", f"python:{tmp_path / 'reward.py'}:record"),
        *("--task.query_dataset", path, "--task.query_template", TLDR_TEMPLATE, "--task.query_truncate_field", "post"),
        *("--task.query_length", "30", "--task.response_length", "4", "--task.start_text", "None"),
        *("--task.end_text", "None", "--task.truncate_token", "None", "--task.query_suffix", ""),
        *("--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--ppo.noptepochs", "1", "--save_interval", "0"),
        *("--output_dir", str(tmp_path / "run")),
    ]
    run_script("train_policy.py", *flags, timeout=300)

    def encode(text):
        return encode_texts(tokenizer, [text])[0]

    expected = {tokenizer.decode(nplus_reference(TLDR_TEMPLATE, row, "post", 30, encode)) for row in POSTS}
    queries = [json.loads(line) for line in seen.read_text(encoding="utf-8").splitlines()]
    assert len(queries) == 16 and set(queries) == expected  # four passes over the 4 posts, each cut as N+ cuts it
    saved = json.loads((tmp_path / "run" / "args.json").read_text(encoding="utf-8"))
    assert saved["task"]["query_template"] == TLDR_TEMPLATE and saved["task"]["query_truncate_field"] == "post"
