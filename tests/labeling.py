"""Helpers of the human-labeling tests: a candidates file written from texts, a label server in a thread."""

import dataclasses
import threading
import time

from lm_human_preference_details.labeling.labelstore import TASK_INSTRUCTIONS, save_candidates
from lm_human_preference_details.labels import OAI_PAD_TOKEN, get_label_type
from lm_human_preference_details.tokenizer import tokenizer_fingerprint
from tests.planted import books_task

QUERY_LENGTH, RESPONSE_LENGTH = 16, 12
SCRIPT = "<script>alert(1)</script>"
QUERIES = [
    "The cat walked to the house in the morning.",
    "A dog looked at the river after dinner.",
    "My friend found a small boat at night.",
    "The teacher visited the garden with a smile.",
    "Her sister left the city before the rain.",
    "The old man saw the forest for a while.",
]
RESPONSES = [
    [" It was a happy day.", " It was a sad day.", " I love it.", " I hate it."],
    [" She smiled.", " He cried.", " The sun was warm.", " It was cold."],
    [" What a lovely trip.", " What a terrible trip.", " It was fine.", " " + SCRIPT],
    [" They laughed.", " They wept.", " Good times.", " Bad times."],
    [" A wonderful walk.", " An awful walk.", " A walk.", " Rain again."],
    [" He felt great.", " He felt bad.", " He felt nothing.", " He slept."],
]


def padded(tokens: list[int], length: int) -> list[int]:
    """Tokens cut to `length` and right-padded with OAI's PAD."""
    return tokens[:length] + [OAI_PAD_TOKEN] * (length - len(tokens[:length]))


def write_candidates(path, tokenizer, model_dir: str, label_type: str = "best_of_4", num_rows: int = len(QUERIES)):
    """A candidates file of the rows above (the first num_samples responses each), as `sample` writes them."""
    kind = get_label_type(label_type)
    task = books_task(query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH)
    rows = []
    for query, responses in zip(QUERIES[:num_rows], RESPONSES):
        texts = responses[: kind.num_samples]
        query_tokens = padded(tokenizer.encode(query), QUERY_LENGTH)
        samples = [padded(tokenizer.encode(text), RESPONSE_LENGTH) for text in texts]
        decoded = [tokenizer.decode([t for t in s if t != OAI_PAD_TOKEN]) for s in samples]
        rows.append({"query": query_tokens, "samples": samples, "query_text": query, "sample_texts": decoded})
    meta = {
        "label_type": kind.name,
        "base_model": model_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_pad_token_id": tokenizer.pad_token_id,
        "pad_id": OAI_PAD_TOKEN,
        "task_id": "sentiment",
        "task": dataclasses.asdict(task),
    }
    save_candidates(str(path), kind, rows, meta, TASK_INSTRUCTIONS["sentiment"])
    return path


class ThreadedServer:
    """The labeling app served by uvicorn on a free loopback port, in a background thread."""

    def __init__(self, app):
        import socket

        import uvicorn

        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the label server did not start within 20 s")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
