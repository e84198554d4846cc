"""Text sources, query stream order and sharding (spec D3). The per-text query construction (G3) and the context
formatting (G4) of tasks.py are tested in tests/test_tasks.py, label files (R7) in tests/test_labels.py."""

import dataclasses
import json
import random

import datasets
import numpy as np
import pytest
import torch

from lm_human_preference_details.data import QueryStream, load_texts, oai_shuffle_order
from lm_human_preference_details.sources import HubTexts
from lm_human_preference_details.tasks import TASKS, build_query, encode_texts, text_to_token

PAD = 50257


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
