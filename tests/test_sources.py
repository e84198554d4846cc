"""Text and label sources (spec G3, R7): OAI's files through a local cache, HF stand-ins reshaped into OAI-like text.

OAI's storage is played by a loopback HTTP server serving small files shaped like OAI's; the HF stand-ins by
`datasets.Dataset.from_dict` rows shaped like the hub datasets' rows (same columns, casing and spacing).
"""

import dataclasses
import http.server
import json
import logging
import os
import socket
import threading
import time

import datasets
import huggingface_hub.constants
import numpy as np
import pytest

from lm_human_preference_details import labels, sources
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import OAI_PAD_TOKEN, load_labels
from lm_human_preference_details.sources import (
    SourceUnavailableError,
    cached_path,
    clean_cnndm_article,
    clean_cnndm_story,
    clean_tldr_post,
    detokenize_bookcorpus,
    download_cached,
    restore_cnndm_paragraphs,
)
from lm_human_preference_details.tasks import TASKS, build_query, encode_texts, text_to_token
from tests.conftest import tiny_gpt2

REAL_LOAD_HUB_DATASET = sources.load_hub_dataset

# ---------------------------------------------------------------- fixtures shaped like OAI's files

# book_passages/{mode}.jsonl: one JSON string per line, a passage of plain prose (books.py#L8-L11)
OAI_BOOK_PASSAGES = [
    "The rain had not stopped for three days. Martha stood at the window and watched the river rise over the road. "
    "Her father had promised to come back before dark, but the bridge was already under water. She lit the lamp "
    "and set two plates on the table anyway.",
    "He found the letter under a loose floorboard in the attic. The paper was yellow and the ink had faded to brown. "
    "It was addressed to his grandmother, and it was signed with a name he had never heard. He read it twice before "
    "he understood what it meant.",
    '"You are late," said the old woman without looking up from her knitting. Tom mumbled an apology and hung his '
    "coat on the hook by the door. The kitchen smelled of bread and wood smoke. Outside, the dogs were barking at "
    "something in the dark.",
    "Nobody in the village knew where the stranger had come from. He arrived on the morning train with a single "
    "suitcase and took a room above the bakery. Every evening he walked to the lighthouse and back. By the end of "
    "the month, the children had started to follow him.",
    "The ship was smaller than she had imagined. Its deck was crowded with crates, ropes and sailors who shouted "
    "at each other in a language she did not know. Anna held her brother's hand and tried not to look at the "
    "grey water below. The captain nodded at them and pointed to a narrow door.",
    "Snow covered the garden and the gate would not open. James pushed it with his shoulder until the hinges "
    "gave way. The house looked exactly as he remembered it, only smaller. A light was burning in the kitchen.",
    "It was the kind of morning that made everything seem possible. The market was already busy when they arrived. "
    "Lena bought apples, a loaf of black bread and a bunch of yellow flowers. Her sister laughed at the flowers and "
    "said they would be dead by Sunday.",
    "The machine hummed quietly in the corner of the laboratory. Dr. Reyes checked the readings one more time and "
    "wrote them down in her notebook. If the numbers were right, the experiment had worked. If they were wrong, "
    "she had wasted six years of her life.",
]

# tldr/{mode}-subset.json: a JSON list of objects whose `content` is a reddit post (tldr.py#L17-L25); one carries
# mojibake and one a run of blank lines, both of which OAI's ftfy and newline collapse repair
OAI_TLDR_ROWS = [
    {
        "content": "SUBREDDIT: r/relationships\n\nTITLE: My (24F) boyfriend (25M) forgot my birthday\n\nPOST: We have "
        "been together for two years. He didnâ€™t even text me until the evening, and then he said he was busy.\n"
    },
    {
        "content": "SUBREDDIT: r/personalfinance\n\nTITLE: Should I pay off my car loan early?\n\nPOST: I have $8,000 "
        "left at 4% interest.\n\n\n\nI also have $10,000 in savings and no other debt. Is it smart to pay it off?"
    },
    {
        "content": "SUBREDDIT: r/AskReddit\n\nTITLE: What's a small habit that changed your life?\n\nPOST: For me it "
        "was making my bed every morning. It sounds silly but it sets the tone for the whole day."
    },
    {
        "content": "SUBREDDIT: r/cooking\n\nTITLE: My bread never rises\n\nPOST: I follow the recipe exactly, the "
        "yeast is new and the kitchen is warm. The dough just sits there. What am I doing wrong?"
    },
]
OAI_TLDR_CLEAN_0 = (
    "SUBREDDIT: r/relationships\n\nTITLE: My (24F) boyfriend (25M) forgot my birthday\n\nPOST: We have been together "
    "for two years. He didn't even text me until the evening, and then he said he was busy."
)

# labels/sentiment/offline_5k.json: best-of-4 rows, 64-token queries and 24-token responses padded with 50259
OAI_LABEL_ROWS = [
    {
        "query": [464 + i, 1110, 13] + [OAI_PAD_TOKEN] * 61,
        **{f"sample{s}": [314 + s, 373, 845, 13] + [OAI_PAD_TOKEN] * 20 for s in range(4)},
        "best": i % 4,
    }
    for i in range(6)
]

# ---------------------------------------------------------------- rows shaped like the HF stand-ins' rows

# bookcorpus/bookcorpus: column `text`, one lower-cased, space-tokenized sentence per row, `` '' quotes, " ." ends
BOOKCORPUS_ROWS = [
    "usually , he would be tearing around the living room , playing with his toys .",
    "but just one look at a minion sent him practically catatonic .",
    "that had been megan 's plan when she got him dressed earlier .",
    "he 'd seen the movie almost by mistake , considering he was a little young for the pg cartoon .",
    "she liked to think being surrounded by adults and older kids was one reason why he was such a good talker .",
    "`` are n't you being a good boy ? '' she said .",
    "mason barely acknowledged her .",
    "instead , his baby blues remained focused on the television .",
    "since the movie was almost over , megan knew she better slip into the bedroom and finish getting ready .",
    "each time she tried to do something , mason had to be right in the middle of it .",
    "`` i 'll be back in a minute , '' she told him .",
    "the bedroom was a mess , clothes thrown over every chair .",
    "she pulled on the blue dress and checked her reflection in the mirror .",
    "it would have to do .",
    "downstairs , the doorbell rang twice .",
    "`` mama , someone 's here ! '' mason shouted .",
    "she hurried down the stairs , nearly tripping over a toy truck .",
    "her mother stood on the porch with a covered dish in her hands .",
    "`` you look tired , '' her mother said , stepping inside .",
    "megan did n't answer .",
    "she took the dish and carried it to the kitchen .",
    "the oven timer was beeping and the sink was full of dishes .",
    "for a moment she wanted to sit down on the floor and cry .",
    "then mason ran in and wrapped his arms around her legs .",
]
# the first passage of the books stand-in: rows 0-7 detokenized, sentence starts and "I" capitalized, joined
BOOKCORPUS_PASSAGE_0 = (
    "Usually, he would be tearing around the living room, playing with his toys. But just one look at a minion sent "
    "him practically catatonic. That had been megan's plan when she got him dressed earlier. He'd seen the movie "
    "almost by mistake, considering he was a little young for the pg cartoon. She liked to think being surrounded by "
    'adults and older kids was one reason why he was such a good talker. "Aren\'t you being a good boy?" she said. '
    "Mason barely acknowledged her. Instead, his baby blues remained focused on the television."
)

# abisee/cnn_dailymail 3.0.0: columns article, highlights, id; the article is one line: the story's paragraphs joined
# by spaces, " ." added to lines without end punctuation (bylines, datelines), curly quotes kept
CNNDM_ROWS = {
    "article": [
        "By . Daily Mail Reporter . PUBLISHED: . 14:11 EST, 25 October 2013 . | . UPDATED: . 15:36 EST, 25 October "
        "2013 . A bishop has told his congregation that the church roof will be repaired by Christmas. The work, "
        "which is expected to cost \u00a3200,000, was delayed after thieves stole lead from the building in the "
        "summer. \u2018We are grateful to everyone who gave money,\u2019 he said. Local builders have offered to "
        "work at a reduced rate. The church, which dates from the 12th century, has been closed since June.",
        "LONDON, England (CNN) -- Heavy rain caused flooding across southern England on Tuesday, forcing hundreds of "
        "people to leave their homes. Rail services were cancelled and several major roads were closed. \u201cWe "
        "have never seen anything like it,\u201d said one resident of the town of Lewes. The Environment Agency "
        "issued 30 severe flood warnings. Forecasters said more rain was expected later in the week.",
        "(CNN)The U.S. space agency said Monday it would delay the launch of its new rocket by at least two months. "
        "Engineers found a problem with a fuel valve during a test last week. NASA officials said the crew was safe "
        "and the delay would not affect later missions. The rocket is now scheduled to launch in March.",
        "Police are searching for a man who robbed a petrol station in Leeds armed with a hammer . The man, who was "
        "wearing a dark hoodie, threatened a member of staff before escaping with cash and cigarettes. Nobody was "
        "hurt. Police have released CCTV images and asked anyone with information to call them.",
    ],
    "highlights": [
        "Church roof to be repaired by Christmas .\nLead was stolen in the summer .",
        "Hundreds leave their homes .\nRail services cancelled .",
        "Launch delayed by two months .\nProblem found with fuel valve .",
        "Man armed with a hammer robbed petrol station .\nNobody was hurt .",
    ],
    "id": [
        "0001d1afc246a7964130f43ae940af6bc6c57f01",
        "0002095e55fcbd3a2f366d9bf92a95433dc305ef",
        "00027e965c8264c35cc1bc55556db388da82b07f",
        "0002c17436637c4fe1837c935c04de47adb18e9a",
    ],
}
CNNDM_CLEAN_0 = (
    "A bishop has told his congregation that the church roof will be repaired by Christmas.\n\nThe work, which is "
    "expected to cost \u00a3200,000, was delayed after thieves stole lead from the building in the summer.\n\n'We are "
    "grateful to everyone who gave money,' he said.\n\nLocal builders have offered to work at a reduced rate.\n\nThe "
    "church, which dates from the 12th century, has been closed since June."
)

# CarperAI/openai_summarize_tldr: columns prompt, label; the prompt ends in "TL;DR:"
TLDR_HUB_ROWS = {
    "prompt": [
        "SUBREDDIT: r/relationships\nTITLE: My (24F) boyfriend (25M) forgot my birthday\nPOST: We have been together "
        "for two years. He didnâ€™t even text me until the evening.\nTL;DR:",
        "SUBREDDIT: r/cooking\nTITLE: My bread never rises\nPOST: The dough just sits there.\n\n\n\nHelp?\nTL;DR:",
    ],
    "label": ["boyfriend forgot my birthday", "bread does not rise"],
}


# ---------------------------------------------------------------- a loopback stand-in for OAI's storage


class FakeStorage:
    """A loopback HTTP server serving `files` (path -> bytes) under /lm-human-preferences/, counting requests."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.truncated: set[str] = set()
        self.requests: list[str] = []
        storage = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                storage.requests.append(self.path)
                name = self.path.removeprefix("/lm-human-preferences/")
                body = storage.files.get(name)
                self.send_response(200 if body is not None else 404)
                # a truncated file: the connection closes before the announced length has arrived
                extra = 1000 if name in storage.truncated else 0
                self.send_header("Content-Length", str(len(body or b"") + extra))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/lm-human-preferences/"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def closed_port_url() -> str:
    """A loopback URL on which nothing listens: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/lm-human-preferences/"


OAI_FILES = {
    "datasets/book_passages/train.jsonl": "".join(json.dumps(p) + "\n" for p in OAI_BOOK_PASSAGES).encode(),
    "tldr/train-subset.json": json.dumps(OAI_TLDR_ROWS).encode(),
    "labels/sentiment/offline_5k.json": json.dumps(OAI_LABEL_ROWS).encode(),
}


@pytest.fixture
def fresh_sources(monkeypatch, tmp_path):
    """An empty download cache, fallbacks not yet announced, the HF stand-ins unreachable unless a test serves them."""
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "_announced", set())

    def no_hub(repo_id, config, split):
        raise AssertionError(f"the HF stand-in {repo_id} was read although OAI's file is served")

    monkeypatch.setattr(sources, "load_hub_dataset", no_hub)
    return tmp_path / "cache"


@pytest.fixture
def oai_storage(monkeypatch, fresh_sources):
    storage = FakeStorage(dict(OAI_FILES))
    monkeypatch.setenv(sources.OAI_URL_ENV, storage.url)
    yield storage
    storage.close()


@pytest.fixture
def oai_unreachable(monkeypatch, fresh_sources):
    monkeypatch.setenv(sources.OAI_URL_ENV, closed_port_url())


def serve_hub_rows(monkeypatch, rows: dict[str, list]) -> list[tuple]:
    """Make the HF loader return `rows` as a datasets.Dataset; -> the (repo, config, split) calls it receives."""
    calls = []

    def load(repo_id, config, split):
        calls.append((repo_id, config, split))
        return datasets.Dataset.from_dict(rows)

    monkeypatch.setattr(sources, "load_hub_dataset", load)
    return calls


@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """The real HF loader in offline mode with an empty hub cache: hub sources must fail fast."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


# ---------------------------------------------------------------- the download cache


def test_download_cached_downloads_once_then_reads_the_cache(oai_storage, fresh_sources):
    url = oai_storage.url + "tldr/train-subset.json"
    path = download_cached(url)
    assert path == cached_path(url) and path.startswith(str(fresh_sources))
    assert open(path, "rb").read() == OAI_FILES["tldr/train-subset.json"]
    assert download_cached(url) == path
    assert oai_storage.requests == ["/lm-human-preferences/tldr/train-subset.json"]
    assert [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")] == []


def test_download_cached_missing_file_is_one_line_error_and_caches_nothing(oai_storage, fresh_sources):
    url = oai_storage.url + "datasets/book_passages/test.jsonl"
    with pytest.raises(SourceUnavailableError, match="404") as error:
        download_cached(url)
    message = str(error.value)
    assert "\n" not in message and url in message and cached_path(url) in message
    assert not os.path.exists(cached_path(url)) and not os.path.exists(cached_path(url) + f".{os.getpid()}.tmp")


def test_download_cached_truncated_download_leaves_no_file(oai_storage):
    oai_storage.truncated.add("tldr/train-subset.json")
    url = oai_storage.url + "tldr/train-subset.json"
    with pytest.raises(SourceUnavailableError, match="incomplete download"):
        download_cached(url)
    assert os.listdir(os.path.dirname(cached_path(url))) == []


def test_download_cached_unreachable_fails_fast(fresh_sources):
    url = closed_port_url() + "labels/sentiment/offline_5k.json"
    start = time.perf_counter()
    with pytest.raises(SourceUnavailableError, match="could not download http://127.0.0.1"):
        download_cached(url)
    assert time.perf_counter() - start < 3


def test_oai_url_defaults_to_openai_storage(monkeypatch):
    monkeypatch.delenv(sources.OAI_URL_ENV, raising=False)
    expected = "https://openaipublic.blob.core.windows.net/lm-human-preferences/datasets/book_passages/train.jsonl"
    assert sources.oai_url("datasets/book_passages/train.jsonl") == expected


# ---------------------------------------------------------------- OAI's text files


def test_load_texts_books_reads_oai_passages_once(oai_storage):
    assert list(load_texts("books")) == OAI_BOOK_PASSAGES
    assert list(load_texts("books")) == OAI_BOOK_PASSAGES
    assert oai_storage.requests == ["/lm-human-preferences/datasets/book_passages/train.jsonl"]


def test_load_texts_tldr_reads_oai_subset_with_ftfy_and_newline_collapse(oai_storage):
    texts = load_texts("tldr")
    assert len(texts) == len(OAI_TLDR_ROWS)
    assert texts[0] == OAI_TLDR_CLEAN_0
    assert "$8,000 left at 4% interest.\n\nI also have" in texts[1] and "\n\n\n" not in texts[1]
    assert oai_storage.requests == ["/lm-human-preferences/tldr/train-subset.json"]


def test_load_texts_tldr_test_split_reads_valid_subset(oai_storage):
    oai_storage.files["tldr/valid-subset.json"] = json.dumps(OAI_TLDR_ROWS[:2]).encode()
    assert len(load_texts("tldr", split="test")) == 2
    assert oai_storage.requests == ["/lm-human-preferences/tldr/valid-subset.json"]


# ---------------------------------------------------------------- HF stand-ins


def test_detokenize_bookcorpus_rows():
    assert detokenize_bookcorpus("`` are n't you being a good boy ? '' she said .") == (
        '"Aren\'t you being a good boy?" she said.'
    )
    assert detokenize_bookcorpus("i 'm sure , '' he whispered , `` but i ca n't stay .") == (
        "I'm sure,\" he whispered, \"but I can't stay."
    )
    assert detokenize_bookcorpus("she ( the girl ) paid $ 5 for it ... and left !") == (
        "She (the girl) paid $5 for it... and left!"
    )


def test_raw_bookcorpus_rows_give_no_books_queries(tokenizer):
    # the problem the stand-in solves: every row's period is " ." (764), never '.' (13), so nothing passes
    task = TASKS["sentiment"]
    start, end = text_to_token(tokenizer, task.start_text), text_to_token(tokenizer, task.end_text)
    tokens = encode_texts(tokenizer, BOOKCORPUS_ROWS)
    assert all(t[-1] == 764 and 13 not in t for t in tokens)
    assert [build_query(t, 64, start, end, tokenizer.pad_token_id) for t in tokens] == [None] * len(tokens)


def test_books_falls_back_to_bookcorpus_passages_announced_once(monkeypatch, oai_unreachable, caplog):
    calls = serve_hub_rows(monkeypatch, {"text": BOOKCORPUS_ROWS})
    with caplog.at_level(logging.WARNING, logger=sources.__name__):
        texts = load_texts("books")
        load_texts("books")
    assert calls == [("bookcorpus/bookcorpus", None, "train")] * 2
    assert len(texts) == len(BOOKCORPUS_ROWS) // sources.BOOKS_ROWS_PER_PASSAGE == 3
    assert texts[0] == BOOKCORPUS_PASSAGE_0
    assert texts[1].endswith('Downstairs, the doorbell rang twice. "Mama, someone\'s here!" mason shouted.')
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "book_passages/train.jsonl" in warnings[0] and "bookcorpus" in warnings[0]


def test_restore_cnndm_paragraphs_at_added_periods_and_sentence_ends():
    article = (
        "By . Jane Doe . Mr. Smith met Gov. J. Brown at 5 p.m. on Monday. \u201cIt went well,\u201d he said. Done ."
    )
    assert restore_cnndm_paragraphs(article) == (
        "By\n\nJane Doe\n\nMr. Smith met Gov. J. Brown at 5 p.m. on Monday.\n\n"
        "\u201cIt went well,\u201d he said.\n\nDone"
    )


def test_clean_cnndm_story_is_oais_clean_up_start_on_story_text():
    # a story file as OAI reads it: paragraphs separated by blank lines, highlights after @highlight
    story = "By\n\nDaily Mail Reporter\n\nUPDATED:\n\n15:36 EST, 25 October 2013\n\nIt\u2019s over.\n\n@highlight\n\nx"
    assert clean_cnndm_story(story) == "It's over."
    assert clean_cnndm_story("LONDON, England (CNN) -- Rain fell.\n\n\n\nIt was cold.") == "Rain fell.\n\nIt was cold."
    assert clean_cnndm_story("(CNN)Rain fell.") == "Rain fell."
    # OAI drops the first two lines of any text starting with "By", a word like "Byron" included
    assert clean_cnndm_story("Byron stayed home.\n\nIt rained.") == "It rained."


def test_cnndm_uses_hf_articles_with_paragraphs_restored(monkeypatch, fresh_sources, tokenizer, caplog):
    calls = serve_hub_rows(monkeypatch, CNNDM_ROWS)
    with caplog.at_level(logging.WARNING, logger=sources.__name__):
        texts = load_texts("cnndm")
        assert len(load_texts("cnndm", split="valid")) == 4
    assert calls == [("abisee/cnn_dailymail", "3.0.0", "train"), ("abisee/cnn_dailymail", "3.0.0", "validation")]
    assert texts[0] == CNNDM_CLEAN_0 == clean_cnndm_article(CNNDM_ROWS["article"][0])
    assert texts[1].startswith("Heavy rain caused flooding") and '"We have never seen anything like it,"' in texts[1]
    assert texts[2].startswith("The U.S. space agency said Monday it would delay")
    # HF's one-line articles hold no '\n' (198) at all: without the restored paragraphs no cnndm query is possible
    raw = encode_texts(tokenizer, CNNDM_ROWS["article"])
    assert not any(198 in t for t in raw)
    assert texts[3].startswith(
        "Police are searching for a man who robbed a petrol station in Leeds armed with a hammer\n\n"
    )
    assert sum("gs://" in r.getMessage() for r in caplog.records) == 1


def test_tldr_falls_back_to_carperai_prompts(monkeypatch, oai_unreachable):
    calls = serve_hub_rows(monkeypatch, TLDR_HUB_ROWS)
    texts = load_texts("tldr")
    assert calls == [("CarperAI/openai_summarize_tldr", None, "train")]
    assert texts[0] == (
        "SUBREDDIT: r/relationships\nTITLE: My (24F) boyfriend (25M) forgot my birthday\nPOST: We have been together "
        "for two years. He didn't even text me until the evening."
    )
    assert (
        texts[1]
        == clean_tldr_post(TLDR_HUB_ROWS["prompt"][1])
        == ("SUBREDDIT: r/cooking\nTITLE: My bread never rises\nPOST: The dough just sits there.\n\nHelp?")
    )


@pytest.mark.parametrize("name", ["books", "tldr", "cnndm"])
def test_oai_and_hub_unreachable_is_one_line_error(oai_unreachable, hub_offline, monkeypatch, name):
    monkeypatch.setattr(sources, "load_hub_dataset", REAL_LOAD_HUB_DATASET)
    start = time.perf_counter()
    with pytest.raises(
        SourceUnavailableError, match=f"query dataset '{name}'.*{sources.HUB_TEXT_SOURCES[name][0]}"
    ) as e:
        load_texts(name)
    assert "\n" not in str(e.value) and "--task.query_dataset" in str(e.value)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------- label files


@pytest.mark.parametrize("source", ["sentiment/offline_5k.json", f"{labels.OAI_LABELS_URL}sentiment/offline_5k.json"])
def test_load_labels_downloads_oai_label_file_once(oai_storage, source):
    first = load_labels(source, 64, 24, pad_id=50257, num_train=6)
    again = load_labels(source, 64, 24, pad_id=50257, num_train=6)
    assert first.label.tolist() == again.label.tolist() == [0, 1, 2, 3, 0, 1]
    assert first.query[0, :4].tolist() == [464, 1110, 13, 50257]
    assert oai_storage.requests == ["/lm-human-preferences/labels/sentiment/offline_5k.json"]


def test_load_labels_falls_back_to_hub_mirror(monkeypatch, oai_unreachable, tmp_path, caplog):
    mirror = tmp_path / "mirror.json"
    mirror.write_text(json.dumps(OAI_LABEL_ROWS[:5]))
    asked = []
    monkeypatch.setattr(labels, "_hub_label_file", lambda filename, flag: asked.append(filename) or str(mirror))
    with caplog.at_level(logging.WARNING, logger=sources.__name__):
        assert len(load_labels("sentiment/offline_5k.json", 64, 24, pad_id=50257, num_train=5)) == 5
        load_labels("sentiment/offline_5k.json", 64, 24, pad_id=50257, num_train=5)
    assert asked == ["sentiment/offline_5k.json"] * 2
    assert sum(labels.LABELS_REPO in r.getMessage() for r in caplog.records) == 1


def test_load_labels_oai_and_hub_unreachable_is_one_line_error(oai_unreachable, hub_offline):
    start = time.perf_counter()
    with pytest.raises(SourceUnavailableError, match="sentiment/offline_5k.json.*--label_dataset") as e:
        load_labels("sentiment/offline_5k.json", 64, 24, pad_id=50257, num_train=4992)
    assert "\n" not in str(e.value) and labels.LABELS_REPO in str(e.value)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------- the four presets, unchanged

# queries per 100 texts with each preset's unchanged settings, on the fixtures above (docs/data.md, "Query data"):
# OAI's own file where it is public, and the HF stand-in used when it cannot be fetched; sentiment and descriptiveness
# share one task. For contrast, raw HF bookcorpus rows and one-line HF CNN/DM articles give 0 (tests above).
PRESET_QUERY_RATES = {
    ("sentiment", "oai"): 100.0,
    ("sentiment", "stand-in"): 100.0,
    ("tldr", "oai"): 100.0,
    ("tldr", "stand-in"): 100.0,
    ("cnndm", "stand-in"): 100.0,
}
STAND_IN_ROWS = {"books": {"text": BOOKCORPUS_ROWS}, "tldr": TLDR_HUB_ROWS, "cnndm": CNNDM_ROWS}


@pytest.fixture
def preset_sources(monkeypatch, oai_storage):
    """books and tldr from the loopback OAI storage, cnndm from HF-shaped rows (OAI's stories are not public)."""
    serve_hub_rows(monkeypatch, CNNDM_ROWS)
    return oai_storage


@pytest.mark.parametrize("preset, source", list(PRESET_QUERY_RATES))
def test_preset_query_rate_with_oai_settings(monkeypatch, oai_storage, tokenizer, preset, source):
    task = TASKS[preset]
    if source == "stand-in":
        monkeypatch.setenv(sources.OAI_URL_ENV, closed_port_url())
        serve_hub_rows(monkeypatch, STAND_IN_ROWS[task.query_dataset])
    texts = load_texts(task.query_dataset)
    start, end = text_to_token(tokenizer, task.start_text), text_to_token(tokenizer, task.end_text)
    tokens = encode_texts(tokenizer, list(texts))
    queries = [build_query(t, task.query_length, start, end, tokenizer.pad_token_id) for t in tokens]
    valid = [q for q in queries if q is not None]
    assert 100.0 * len(valid) / len(texts) == PRESET_QUERY_RATES[preset, source]
    # the stream hands out exactly these queries in one pass, and each ends at end_text when it is set
    assert sorted(QueryStream(texts, tokenizer, task, 0, 1).next_batch(len(valid)).tolist()) == sorted(valid)
    lengths = [sum(token != tokenizer.pad_token_id for token in q) for q in valid]
    assert min(lengths) >= 8
    if end is not None:
        assert all(q[n - 1] == end for q, n in zip(valid, lengths))


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory, tokenizer):
    """A tiny random GPT-2 with 1024 positions, room for the summarization presets' 500-token queries."""
    path = tmp_path_factory.mktemp("tiny-gpt2-1024")
    tiny_gpt2(n_positions=1024).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["sentiment", "tldr", "cnndm"])
def test_tiny_policy_run_with_oai_task_settings(preset_sources, tmp_path, long_context_model_dir, one_thread, preset):
    from tests.test_train_policy import save_reward_model
    from train_policy import main, task_presets

    args = task_presets()[preset]
    args.base_model, args.run.output_dir = long_context_model_dir, str(tmp_path / "policy")
    args.rewards.trained_model = save_reward_model(tmp_path / "reward", long_context_model_dir, args.task)
    args.run.log_interval, args.run.save_interval, args.run.print_samples = 1, 0, 1
    args.ppo = dataclasses.replace(args.ppo, total_episodes=8, batch_size=8, noptepochs=1)
    history = main(args)
    assert args.task == TASKS[preset]  # the task's data, query and response settings are OAI's
    assert len(history) == 1 and np.isfinite(history[0]["objective/score"])
    served = {"sentiment": ["datasets/book_passages/train.jsonl"], "tldr": ["tldr/train-subset.json"], "cnndm": []}
    assert preset_sources.requests == [f"/lm-human-preferences/{path}" for path in served[preset]]


@pytest.mark.slow
def test_tiny_reward_run_with_oai_label_source(preset_sources, tmp_path, long_context_model_dir, one_thread):
    from train_reward import main, task_presets

    args = task_presets()["sentiment"]
    args.base_model, args.run.output_dir = long_context_model_dir, str(tmp_path / "reward")
    args.labels.num_train, args.batch_size, args.rollout_batch_size, args.normalize_samples = 4, 4, 8, 8
    result = main(args)
    assert args.label_dataset == "sentiment/offline_5k.json" and args.task == TASKS["sentiment"]
    assert os.path.isdir(args.run.output_dir) and result
    assert sorted(preset_sources.requests) == [
        "/lm-human-preferences/datasets/book_passages/train.jsonl",
        "/lm-human-preferences/labels/sentiment/offline_5k.json",
    ]
