"""Query construction (spec G3), query stream order and sharding (D3), context formatting (G4); label files are in
test_labels.py."""

import dataclasses
import json
import random

import datasets
import numpy as np
import pytest
import torch
import tyro

from lm_human_preference_details.data import QueryStream, load_texts, oai_shuffle_order
from lm_human_preference_details.sources import HubTexts
from lm_human_preference_details.tasks import (
    TASKS,
    TaskHParams,
    build_query,
    encode_context_affixes,
    encode_texts,
    format_contexts,
    resolve_truncation,
    text_to_token,
)

PAD = 50257
P = 99  # pad id in the hand-written build_query cases


# ---------------------------------------------------------------- build_query


@pytest.mark.parametrize(
    "tokens, length, start, end, expected",
    [
        ([5, 13, 7, 8], 5, 13, None, [7, 8, P, P, P]),  # start found: keep what follows it
        ([13, 1, 13, 2], 5, 13, None, [1, 13, 2, P, P]),  # only the first start token counts
        ([1, 2, 13], 4, 13, None, [1, 2, 13, P]),  # start is the last token: text kept whole
        ([1, 2, 3], 4, 13, None, None),  # start not found: skipped
        ([1, 2, 3, 4, 5, 6], 4, None, None, [1, 2, 3, 4]),  # truncation, no padding needed
        ([1, 2], 4, None, None, [1, 2, P, P]),  # right padding
        ([1, 13, 2, 13, 3], 5, None, 13, [1, 13, 2, 13, P]),  # end: up to the last occurrence
        ([1, 2, 3, 13], 3, None, 13, None),  # end only searched after truncation: skipped
        ([1, 2, 3], 3, None, 13, None),  # end not found: skipped
        ([9, 13, 1, 2, 13, 3, 4], 6, 13, 13, [1, 2, 13, P, P, P]),  # start then end
        ([9, 13, 1, 2, 3, 13, 4], 3, 13, 13, None),  # end lies beyond query_length after the start trim
        ([], 3, None, None, None),  # empty text: skipped
    ],
)
def test_build_query_oai_steps(tokens, length, start, end, expected):
    assert build_query(tokens, length, start, end, P) == expected


def test_build_query_tv1(tokenizer):
    tokens = encode_texts(tokenizer, ["usually, he would", "she thought about it"])
    queries = [build_query(t, 5, None, None, tokenizer.pad_token_id) for t in tokens]
    assert queries == [[23073, 11, 339, 561, 50257], [7091, 1807, 546, 340, 50257]]


def test_build_query_rejects_nonpositive_length():
    with pytest.raises(ValueError, match="query_length"):
        build_query([1, 2], 0, None, None, P)


def test_text_to_token_single_tokens(tokenizer):
    assert text_to_token(tokenizer, ".") == 13
    assert text_to_token(tokenizer, "\n") == 198
    assert text_to_token(tokenizer, None) is None
    assert text_to_token(tokenizer, "") is None
    with pytest.raises(ValueError, match="--task.end_text.*TL;DR"):
        text_to_token(tokenizer, "TL;DR:", "--task.end_text")


def test_encode_texts_treats_special_strings_as_text(tokenizer):
    (tokens,) = encode_texts(tokenizer, ["a [PAD] b<|endoftext|>"])
    assert PAD not in tokens and tokenizer.eos_token_id not in tokens


# ---------------------------------------------------------------- presets and contexts


def test_tasks_match_launch_presets(tokenizer):
    # launch.py's truncate_token 13 and 198 are GPT-2's "." and "\n": the presets name the text, which GPT-2's
    # tokenizer resolves to OAI's ids
    tasks = {name: resolve_truncation(task, tokenizer) for name, task in TASKS.items()}
    assert {name: (task.truncate_text, task.truncate_token) for name, task in tasks.items()} == {
        "sentiment": (".", 13),
        "descriptiveness": (".", 13),
        "tldr": ("\n", 198),
        "cnndm": ("\n", 198),
    }
    for name in ("sentiment", "descriptiveness"):
        task = tasks[name]
        assert (task.query_dataset, task.query_length, task.response_length) == ("books", 64, 24)
        assert (task.start_text, task.end_text, task.truncate_token, task.truncate_after) == (".", ".", 13, 16)
        assert (task.query_prefix, task.query_suffix, task.temperature) == ("", "", 0.7)
    tldr, cnndm = tasks["tldr"], tasks["cnndm"]
    assert (tldr.query_length, tldr.response_length) == (500, 75)
    assert (tldr.query_prefix, tldr.query_suffix) == ("", "\n\nTL;DR:")
    assert (tldr.start_text, tldr.end_text, tldr.truncate_token, tldr.truncate_after, tldr.temperature) == (
        None,
        None,
        198,
        55,
        0.7,
    )
    assert (cnndm.query_prefix, cnndm.query_suffix, cnndm.start_text, cnndm.end_text) == (
        "Article:\n\n",
        "\n\nTL;DR:",
        None,
        "\n",
    )
    assert (cnndm.query_length, cnndm.response_length, cnndm.truncate_token, cnndm.truncate_after) == (500, 75, 198, 55)
    assert cnndm.temperature == 0.5
    assert all(task.penalty_reward_value == -1.0 for task in TASKS.values())


def test_task_hparams_parse_with_tyro():
    args = ["--query-length", "500", "--start-text", "None", "--truncate-token", "13", "--end-text", "."]
    task = tyro.cli(TaskHParams, default=TASKS["tldr"], args=args)
    assert (task.query_length, task.start_text, task.truncate_token, task.end_text) == (500, None, 13, ".")
    assert task.query_dataset == "tldr" and task.response_length == 75


def test_task_hparams_class_defaults_are_oai_lm_tasks_defaults():
    # OAI lm_tasks.py#L11-L34: lengths and dataset required; start '.', no end text, no truncation, penalty -1, T 1.0
    with pytest.raises(TypeError):
        TaskHParams(query_length=64, response_length=24)  # query_dataset is required
    task = TaskHParams(query_length=64, query_dataset="books", response_length=24)
    assert (task.query_prefix, task.query_suffix, task.start_text, task.end_text) == ("", "", ".", None)
    assert (task.truncate_token, task.truncate_after, task.penalty_reward_value, task.temperature) == (None, 0, -1, 1.0)


def test_format_contexts_tldr_suffix(tokenizer):
    prefix, suffix = encode_context_affixes(tokenizer, TASKS["tldr"])
    assert prefix == [] and suffix == tokenizer("\n\nTL;DR:")["input_ids"]
    queries = torch.tensor([[23073, 11, 339, 561, PAD], [7091, 1807, 546, 340, PAD]])
    contexts = format_contexts(queries, prefix, suffix)
    assert contexts.shape == (2, 5 + len(suffix)) and contexts.dtype == torch.long
    assert torch.equal(contexts[:, :5], queries)
    assert contexts[:, 5:].tolist() == [suffix, suffix]


def test_format_contexts_cnndm_prefix_and_suffix(tokenizer):
    prefix, suffix = encode_context_affixes(tokenizer, TASKS["cnndm"])
    assert prefix == tokenizer("Article:\n\n")["input_ids"]
    queries = torch.tensor([[1, 2, PAD]])
    contexts = format_contexts(queries, prefix, suffix)
    assert contexts.tolist() == [prefix + [1, 2, PAD] + suffix]


def test_format_contexts_rejects_1d():
    with pytest.raises(ValueError, match="shape"):
        format_contexts(torch.tensor([1, 2]), [], [])


# ---------------------------------------------------------------- text sources


def test_load_texts_txt_skips_blank_lines(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("first passage.\n\n   \nsecond passage.\n", encoding="utf-8")
    assert load_texts(str(path)) == ["first passage.", "second passage."]


def test_load_texts_jsonl_text_field_and_bare_strings(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"text": "one."}\n\n"two."\n{"text": "three.", "id": 3}\n', encoding="utf-8")
    assert load_texts(str(path)) == ["one.", "two.", "three."]


@pytest.mark.parametrize("bad_line", ['{"content": "x"}', "{not json", '{"text": 5}'])
def test_load_texts_jsonl_bad_row_names_line(tmp_path, bad_line):
    path = tmp_path / "q.jsonl"
    path.write_text('{"text": "one."}\n{"text": "two."}\n' + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 3"):
        load_texts(str(path))


def test_load_texts_missing_local_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_texts(missing)


def test_load_texts_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="books.*cnndm.*tldr"):
        load_texts("wikipedia")


# ---------------------------------------------------------------- query stream


def _numbered_texts(n: int, skip_every: int = 0) -> list[str]:
    """Distinct texts; every `skip_every`-th has no '.' so the books preset skips it."""
    return [
        f"Intro {i} without a period" if skip_every and i % skip_every == 0 else f"Intro {i}. Passage {i} ends here."
        for i in range(n)
    ]


def _oai_shuffled(texts: list[str], seed: int) -> list[str]:
    """The texts in OAI's order: Python's global `random.seed(seed); random.shuffle(texts)` (datasets/books.py)."""
    shuffled = list(texts)
    state = random.getstate()
    random.seed(seed)
    random.shuffle(shuffled)
    random.setstate(state)
    return shuffled


def _expected_queries(texts, tokenizer, task, data_seed=0):
    """The valid queries of one pass in OAI's order, derived directly from Python's shuffle and build_query."""
    start, end = text_to_token(tokenizer, task.start_text), text_to_token(tokenizer, task.end_text)
    tokens = encode_texts(tokenizer, _oai_shuffled(texts, data_seed))
    queries = [build_query(t, task.query_length, start, end, tokenizer.pad_token_id) for t in tokens]
    return [q for q in queries if q is not None]


BOOKS = dataclasses.replace(TASKS["sentiment"], query_length=12)


def test_query_stream_follows_seeded_permutation_and_right_pads(tokenizer):
    texts = _numbered_texts(40, skip_every=3)
    stream = QueryStream(texts, tokenizer, BOOKS, rank=0, world_size=1, chunk_size=16)
    batch = stream.next_batch(20)
    assert batch.shape == (20, 12) and batch.dtype == torch.long
    assert batch.tolist() == _expected_queries(texts, tokenizer, BOOKS)[:20]
    real = batch != PAD
    assert real[:, 0].all()
    assert torch.equal(real, real.cummin(dim=1).values)  # PADs only on the right
    assert (~real).any()


@pytest.mark.parametrize("num_texts", [1, 2, 7, 1000, 70_000])
def test_oai_shuffle_order_equals_python_random_shuffle_of_the_texts(num_texts):
    texts = [f"text {i}" for i in range(num_texts)]
    order = oai_shuffle_order(num_texts, 0)
    assert [texts[i] for i in order] == _oai_shuffled(texts, 0)
    assert sorted(order.tolist()) == list(range(num_texts))


def test_query_stream_order_is_oai_python_shuffle(tokenizer):
    texts = [f"Intro {i}. Passage {i} ends here." for i in range(10)]
    period = text_to_token(tokenizer, ".")
    expected = [build_query(t, 12, period, period, PAD) for t in encode_texts(tokenizer, _oai_shuffled(texts, 0))]
    assert QueryStream(texts, tokenizer, BOOKS, rank=0, world_size=1).next_batch(10).tolist() == expected
    # NumPy's permutation (the order used before) starts with another text
    assert texts[np.random.RandomState(0).permutation(10)[0]] != _oai_shuffled(texts, 0)[0]


@pytest.mark.parametrize("chunk_size", [4, 1024])
def test_query_stream_ranks_disjoint_and_union_equals_single_rank(tokenizer, chunk_size):
    texts = _numbered_texts(30, skip_every=4)
    single = QueryStream(texts, tokenizer, BOOKS, rank=0, world_size=1, data_seed=3).next_batch(40)
    ranks = [
        QueryStream(texts, tokenizer, BOOKS, rank=r, world_size=2, data_seed=3, chunk_size=chunk_size).next_batch(20)
        for r in range(2)
    ]
    assert torch.equal(ranks[0], single[0::2])
    assert torch.equal(ranks[1], single[1::2])
    first_pass = {tuple(q) for q in _expected_queries(texts, tokenizer, BOOKS, data_seed=3)}
    rank0, rank1 = ({tuple(q) for q in r[:5].tolist()} for r in ranks)
    assert rank0.isdisjoint(rank1) and rank0 | rank1 <= first_pass


@pytest.mark.parametrize("world_size, virtual_ranks", [(1, 2), (2, 2), (1, 4)])
def test_query_stream_virtual_ranks_hold_the_queries_of_oai_ranks(tokenizer, world_size, virtual_ranks):
    # spec D4: virtual rank g of process r stands for rank r + world_size * g of world_size * virtual_ranks ranks
    texts = _numbered_texts(30, skip_every=4)
    group = 3
    ranks = world_size * virtual_ranks
    oai = [QueryStream(texts, tokenizer, BOOKS, rank=r, world_size=ranks, chunk_size=5) for r in range(ranks)]
    for r in range(world_size):
        stream = QueryStream(texts, tokenizer, BOOKS, rank=r, world_size=world_size, chunk_size=7)
        for _ in range(3):  # three updates: the grouping holds batch after batch
            batch = stream.next_batch(group * virtual_ranks, virtual_ranks)
            for g in range(virtual_ranks):
                expected = oai[r + world_size * g].next_batch(group)
                assert torch.equal(batch[g * group : (g + 1) * group], expected), (r, g)
    with pytest.raises(ValueError, match="multiple of virtual_ranks 2"):
        stream.next_batch(5, 2)


def test_query_stream_repeats_forever_in_the_same_order(tokenizer):
    texts = _numbered_texts(4, skip_every=4)  # text 0 is skipped: 3 valid queries per pass
    expected = _expected_queries(texts, tokenizer, BOOKS)
    assert len(expected) == 3
    stream = QueryStream(texts, tokenizer, BOOKS, rank=0, world_size=1, chunk_size=2)
    assert stream.next_batch(8).tolist() == [expected[i % 3] for i in range(8)]
    # rank 1 of 2 continues the stride across the pass boundary: global valid indices 1, 3, 5, 7
    rank1 = QueryStream(texts, tokenizer, BOOKS, rank=1, world_size=2, chunk_size=2)
    assert rank1.next_batch(4).tolist() == [expected[i % 3] for i in (1, 3, 5, 7)]


def test_query_stream_deterministic_and_seeded(tokenizer):
    texts = _numbered_texts(50)
    a = QueryStream(texts, tokenizer, BOOKS, 0, 1, data_seed=0).next_batch(10)
    b = QueryStream(texts, tokenizer, BOOKS, 0, 1, data_seed=0, chunk_size=7).next_batch(10)
    c = QueryStream(texts, tokenizer, BOOKS, 0, 1, data_seed=1).next_batch(10)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_query_stream_leaves_global_rngs_untouched(tokenizer):
    np.random.seed(1)
    random.seed(2)
    state, python_state = np.random.get_state(), random.getstate()
    stream = QueryStream(_numbered_texts(20), tokenizer, BOOKS, 0, 1, data_seed=5)
    stream.next_batch(30)
    after = np.random.get_state()
    assert all(np.array_equal(x, y) for x, y in zip(state, after))
    assert random.getstate() == python_state
    assert np.random.permutation(4992)[:4].tolist() == [4486, 2985, 3023, 1328]  # TV13 order still intact


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_query_stream_state_dict_resumes(tokenizer, rank, world_size):
    texts = _numbered_texts(13, skip_every=5)
    stream = QueryStream(texts, tokenizer, BOOKS, rank, world_size, chunk_size=4)
    stream.next_batch(5)
    state = json.loads(json.dumps(stream.state_dict()))
    continued = stream.next_batch(11)
    resumed = QueryStream(texts, tokenizer, BOOKS, rank, world_size, chunk_size=8)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_batch(11), continued)


def test_query_stream_state_dict_rejects_other_stream(tokenizer):
    texts = _numbered_texts(10)
    state = QueryStream(texts, tokenizer, BOOKS, 0, 1, data_seed=0).state_dict()
    with pytest.raises(ValueError, match="data_seed"):
        QueryStream(texts, tokenizer, BOOKS, 0, 1, data_seed=1).load_state_dict(state)


def test_query_stream_reads_hub_texts_lazily(tokenizer):
    texts = _numbered_texts(25, skip_every=6)
    hub_texts = HubTexts(datasets.Dataset.from_dict({"text": texts, "id": list(range(25))}), "text")
    assert len(hub_texts) == 25 and hub_texts[3] == texts[3] and hub_texts[1:3] == texts[1:3]
    expected = QueryStream(texts, tokenizer, BOOKS, 0, 1).next_batch(30)
    assert torch.equal(QueryStream(hub_texts, tokenizer, BOOKS, 0, 1, chunk_size=8).next_batch(30), expected)


def test_query_stream_without_valid_queries_raises(tokenizer):
    with pytest.raises(ValueError, match="start_text"):
        QueryStream(["no period here", "nor here"], tokenizer, BOOKS, 0, 1).next_batch(1)


def test_query_stream_rejects_bad_rank(tokenizer):
    with pytest.raises(ValueError, match="rank 2"):
        QueryStream(["a."], tokenizer, BOOKS, rank=2, world_size=2)
