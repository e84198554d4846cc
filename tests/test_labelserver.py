"""Human labels from a browser, without a browser: sample, the judgements log, the majority rule, the agreement
figures against a hand computation, the app's access control and its 4xx answers (Starlette's test client)."""

import asyncio
import errno
import json
import os
import shutil
import threading
import time

import pytest
import torch

import label_generation
from lm_human_preference_details import cli
from lm_human_preference_details.labelers import VaderLabeler
from lm_human_preference_details.labeling import labelstore
from lm_human_preference_details.labeling.agreement import (
    agreement_report,
    cohen_kappa,
    fleiss_kappa,
    krippendorff_alpha,
)
from lm_human_preference_details.labeling.labelstore import (
    CLAIM_SECONDS,
    Judgement,
    JudgementError,
    LabelStore,
    label_from_answer,
    labels_per_minute,
    load_candidates,
    majority_label,
    read_judgements,
    shown_order,
)
from lm_human_preference_details.labels import OAI_PAD_TOKEN, load_labels
from tests.labeling import QUERY_LENGTH, RESPONSE_LENGTH, write_candidates
from tests.planted import REPO
from tests.test_label_generation import generate_flags as world_flags
from tests.test_label_generation import (  # noqa: F401 (the fixture `world`)
    passes_filter_and_is_truncated,
    read_rows,
    run_label_generation,
    world,
)

pytestmark = pytest.mark.usefixtures("single_thread")

# ---------------------------------------------------------------- agreement against a hand computation

# three labelers, best_of_4 labels, in this order (seq): row 0 A0 B0 C1; row 1 A1 B1 C1; row 2 A2 B3; row 3 A0; row 4
# B2 C2
HAND = [
    ("A", 0, 0),
    ("B", 0, 0),
    ("C", 0, 1),
    ("A", 1, 1),
    ("B", 1, 1),
    ("C", 1, 1),
    ("A", 2, 2),
    ("B", 2, 3),
    ("A", 3, 0),
    ("B", 4, 2),
    ("C", 4, 2),
]


def hand_judgements() -> list[Judgement]:
    return [Judgement(name, row, label, seq) for seq, (name, row, label) in enumerate(HAND)]


def test_agreement_figures_equal_a_hand_computation():
    report = agreement_report(hand_judgements(), {"C": 1})
    # A&B on rows 0,1,2: agree 2/3; chance (1*1 + 1*1) / 9 = 2/9; kappa (2/3 - 2/9) / (7/9) = 4/7
    # A&C on rows 0,1: agree 1/2; chance 2/4 = 1/2; kappa 0
    # B&C on rows 0,1,4: agree 2/3; chance (1*2 + 1*1) / 9 = 1/3; kappa (2/3 - 1/3) / (2/3) = 1/2
    pairs = {tuple(p["labelers"]): (p["rows"], p["agreement"], p["cohen_kappa"]) for p in report["pairs"]}
    expected = {("A", "B"): (3, 2 / 3, 4 / 7), ("A", "C"): (2, 1 / 2, 0.0), ("B", "C"): (3, 2 / 3, 1 / 2)}
    assert pairs == {key: pytest.approx(value) for key, value in expected.items()}
    # Fleiss over rows 0,1,2,4: P_i = 1/3, 1, 0, 1 -> P = 7/12; label totals 0:2 1:4 2:3 3:1 of 10 -> P_e = 0.3
    assert report["fleiss_kappa"] == pytest.approx((7 / 12 - 0.3) / 0.7) and report["shared_rows"] == 4
    # the others' majority; row 0's tie for A (B0, C1) goes to B's earlier 0, for B (A0, C1) to A's 0
    majority = {name: (v["rows"], v["agreement"]) for name, v in report["majority_agreement"].items()}
    expected = {"A": (3, 2 / 3), "B": (4, 3 / 4), "C": (3, 2 / 3)}
    assert majority == {key: pytest.approx(value) for key, value in expected.items()}
    counts = {name: (v["labels"], v["skipped"], v["shared_rows"]) for name, v in report["labelers"].items()}
    assert counts == {"A": (4, 0, 3), "B": (4, 0, 4), "C": (3, 1, 3)}


def test_kappas_are_undefined_when_chance_agreement_is_certain():
    assert cohen_kappa([1, 1], [1, 1]) is None and fleiss_kappa([[2, 2], [2, 2]]) is None
    assert cohen_kappa([0, 1], [1, 0]) == pytest.approx(-1.0)


def test_majority_rule_plurality_and_tie_to_the_earliest():
    by_row = {}
    for j in hand_judgements():
        by_row.setdefault(j.row, []).append(j)
    assert majority_label(by_row[0]) == 0  # 0, 0, 1
    assert majority_label(by_row[2]) == 2  # tie 2 (seq 6) vs 3 (seq 7): the earlier
    late_first = [Judgement("B", 2, 3, 1), Judgement("A", 2, 2, 6)]
    assert majority_label(late_first) == 3


# ---------------------------------------------------------------- the store


@pytest.fixture(scope="module")
def candidates_file(tmp_path_factory, tokenizer, tiny_model_dir):
    return write_candidates(tmp_path_factory.mktemp("candidates") / "candidates.json", tokenizer, tiny_model_dir)


@pytest.fixture
def candidates(tmp_path, candidates_file):
    """A fresh copy of the six best_of_4 candidate rows of tests/labeling.py."""
    return str(shutil.copy(candidates_file, tmp_path / "candidates.json"))


def log_bytes(output) -> bytes:
    with open(f"{output}.judgements.jsonl", "rb") as f:
        return f.read()


def test_judgements_survive_a_restart_and_undo_and_export_in_oais_schema(candidates, tmp_path, tokenizer):
    output = str(tmp_path / "human.json")
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    first = store.next_row("ann")
    assert first["row"] == 0 and first["responses"] == [
        store.candidates.rows[0]["sample_texts"][i] for i in shown_order("ann", 0, 4)
    ]
    store.judge("ann", 0, 2)
    store.judge("ann", 1, 0)
    store.skip("ann", 2)
    assert store.undo("ann")["row"] == 2 and store.undo("ann")["row"] == 1
    store.judge("ann", 1, 3)
    store.judge("bob", 0, 1)
    store.close()

    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)  # the same command again
    assert store.next_row("ann")["row"] == 2 and store.next_row("bob")["row"] == 1
    with pytest.raises(Exception, match="already labelled row 0"):
        store.judge("ann", 0, 1)
    labels = {(j.labeler, j.row): j.label for j in store.judgements()}
    assert labels == {
        ("ann", 0): shown_order("ann", 0, 4)[2],
        ("ann", 1): shown_order("ann", 1, 4)[3],
        ("bob", 0): shown_order("bob", 0, 4)[1],
    }
    store.close()
    rows = read_rows(output)
    assert [r["best"] for r in rows] == [labels["ann", 0], labels["ann", 1]]  # tie on row 0: ann's came first
    assert rows[0]["query"][-1] == OAI_PAD_TOKEN and rows[0]["sample0"] == store.candidates.rows[0]["samples"][0]
    loaded = load_labels(output, QUERY_LENGTH, RESPONSE_LENGTH, tokenizer.pad_token_id, 2, "best_of_4", "--output")
    assert loaded.label.tolist() == [labels["ann", 0], labels["ann", 1]]
    with open(f"{output}.meta.json", encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["pad_id"] == OAI_PAD_TOKEN and meta["labelers"] == ["ann", "bob"] and "tie" in meta["majority_rule"]
    records = [json.loads(line) for line in log_bytes(output).splitlines()]
    assert [r["event"] for r in records] == ["start", "label", "label", "skip", "undo", "undo", "label", "label"]
    assert [r["seq"] for r in records] == list(range(8))  # one order across the restart; nothing is deleted


def test_unshared_rows_go_to_one_labeler_and_shared_rows_to_all(candidates, tmp_path):
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"), shared_fraction=0.5)
    assert len(store.shared) == 3
    seen = {"ann": [], "bob": []}
    for name in ("ann", "bob", "ann", "bob", "ann", "bob", "ann", "bob", "ann", "bob"):
        row = store.next_row(name)["row"]
        if row is not None:
            store.judge(name, row, 0)
            seen[name].append(row)
    assert store.shared <= set(seen["ann"]) & set(seen["bob"])
    unshared = set(range(6)) - store.shared
    assert set(seen["ann"]) | set(seen["bob"]) >= unshared and not (set(seen["ann"]) & set(seen["bob"]) & unshared)
    store.close()


def test_a_reload_shows_the_claimed_row_and_a_claim_expires_after_ten_minutes(candidates, tmp_path, monkeypatch):
    # a reload (next_row again) shows the labeler the row they hold, even when a lower row became free meanwhile,
    # never another labeler's; their label of it is accepted once; an unanswered claim keeps the row from the others
    # for CLAIM_SECONDS, then another labeler gets it and the first one's reload does not
    clock = [1000.0]
    monkeypatch.setattr(labelstore.time, "time", lambda: clock[0])
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"), shared_fraction=0.0)
    assert store.next_row("bob")["row"] == 0
    ann = store.next_row("ann")
    assert ann["row"] == 1
    store.skip("bob", 0)  # row 0 is free again, and lower than ann's
    assert store.next_row("bob")["row"] == 2
    reloaded = store.next_row("ann")
    assert (reloaded["row"], reloaded["responses"]) == (1, ann["responses"])
    store.judge("ann", 1, 0)
    with pytest.raises(JudgementError, match="already labelled row 1"):
        store.judge("ann", 1, 0)
    clock[0] += 100
    assert store.next_row("ann")["row"] == 0  # answered: the next row, the free one
    # bob leaves row 2 unanswered: kept from cara until CLAIM_SECONDS have passed since it was shown to him
    clock[0] = 1000.0 + CLAIM_SECONDS - 1
    assert store.next_row("cara")["row"] == 3
    assert store.next_row("cara")["row"] == 3
    clock[0] = 1000.0 + CLAIM_SECONDS + 1  # ann's claim of row 0, 100 s younger, still holds
    assert store.next_row("dan")["row"] == 2
    assert store.next_row("bob")["row"] == 4  # dan's now: bob's reload moves him on
    # an undo shows the undone row next, not the row the page showed before
    store.judge("cara", 3, 0)
    assert store.next_row("cara")["row"] == 5
    assert store.undo("cara")["row"] == 3 and store.next_row("cara")["row"] == 3
    store.close()


def test_two_threads_never_lose_or_duplicate_a_judgement(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    results = []

    def label(name):
        for row in range(6):
            for _ in range(2):  # every judgement sent twice (a double click): one must be refused
                try:
                    store.judge(name, row, 1)
                    results.append((name, row))
                except Exception as e:
                    assert "already labelled" in str(e)

    threads = [threading.Thread(target=label, args=(name,)) for name in ("ann", "ann", "bob", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert sorted(results) == sorted((n, r) for n in ("ann", "bob") for r in range(6))
    judgements, _ = read_judgements(output)
    assert sorted((j.labeler, j.row) for j in judgements) == sorted(results)


def test_scalar_answers_map_to_oais_labels():
    from lm_human_preference_details.labels import get_label_type

    compare, rating = get_label_type("scalar_compare"), get_label_type("scalar_rating")
    # "the response shown second is better by 2": sample1 when shown in order, sample0 when swapped
    assert label_from_answer(compare, 2, [0, 1]) == 2.0 and label_from_answer(compare, 2, [1, 0]) == -2.0
    assert label_from_answer(rating, 6, [0]) == 6.0


def test_throughput_counts_the_labels_of_the_last_ten_minutes():
    assert labels_per_minute([0.0, 30.0, 60.0], now=60.0) == pytest.approx(3.0)
    assert labels_per_minute([0.0, 1000.0, 1030.0], now=1060.0) == pytest.approx(2.0)  # the first is too old
    assert labels_per_minute([1000.0], now=1060.0) is None


def test_scalar_compare_store_and_pairs(tmp_path, tokenizer, tiny_model_dir):
    candidates = write_candidates(tmp_path / "c.json", tokenizer, tiny_model_dir, "scalar_compare")
    output, pairs = str(tmp_path / "out.json"), str(tmp_path / "pairs.jsonl")
    store = LabelStore(load_candidates(str(candidates)), output, 0.0, pairs)
    store.judge("ann", 0, 1)
    store.judge("ann", 1, 0)
    store.close()
    rows = read_rows(output)
    order = shown_order("ann", 0, 2)
    assert rows[0]["difference"] == (1.0 if order == [0, 1] else -1.0) and rows[1]["difference"] == 0.0
    with open(pairs, encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    texts = store.candidates.rows[0]["sample_texts"]
    assert written == [{"row": 0, "prompt": store.candidates.rows[0]["query_text"], "chosen": texts[order[1]],
                        "rejected": texts[order[0]]}]  # fmt: skip


def test_a_second_server_on_the_same_output_is_refused(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    with pytest.raises(ValueError, match="in use by another"):
        LabelStore(load_candidates(candidates), output)
    store.close()
    LabelStore(load_candidates(candidates), output).close()


def test_a_torn_last_line_is_kept_aside_and_labeling_continues(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    store.judge("ann", 0, 1)
    store.close()
    with open(f"{output}.judgements.jsonl", "ab") as f:
        f.write(b'{"event": "label", "labeler": "ann", "ro')
    store = LabelStore(load_candidates(candidates), output)
    store.judge("ann", 1, 1)
    store.close()
    assert [(j.row, j.label) for j in read_judgements(output)[0]] == [
        (0, shown_order("ann", 0, 4)[1]),
        (1, shown_order("ann", 1, 4)[1]),
    ]
    with open(f"{output}.judgements.jsonl.torn", "rb") as f:
        assert f.read().startswith(b'{"event": "label", "labeler": "ann", "ro')


def test_a_last_line_cut_by_a_full_disk_is_reported_once_and_cut_off(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    store.judge("ann", 0, 1)
    store.close()
    with open(f"{output}.judgements.jsonl", "ab") as f:
        f.write(b'{"event": "label", "labeler": "ann", "row": 1, "ans\x00\x00\x00\n')  # ends in a newline
    store = LabelStore(load_candidates(candidates), output)
    assert len(store.notices) == 1 and "half-written" in store.notices[0] and "cut off" in store.notices[0]
    assert [j.row for j in store.judgements()] == [0] and store.next_row("ann")["row"] == 1
    store.judge("ann", 1, 1)
    store.close()
    assert [j.row for j in read_judgements(output)[0]] == [0, 1]


# ---------------------------------------------------------------- faults: a full disk, a failing export


class ApiLabeler:
    """POSTs of one labeler through the app, carrying the labeler key its first answer gave (as the page does)."""

    def __init__(self, client, name: str):
        self.client, self.name, self.key = client, name, None

    def post(self, path: str, **body):
        response = self.client.post(path, json={"labeler": self.name, "key": self.key, **body})
        if response.status_code == 200:
            self.key = response.json().get("labeler_key", self.key)
        return response


class FullDisk:
    """os.write and os.fsync of one file descriptor fail as on a full disk: a write stores part of its bytes, then
    ENOSPC; or fsync reports ENOSPC after the bytes were written (the page cache could not be flushed)."""

    def __init__(self, monkeypatch, fd: int, where: str):
        self.fd, self.where, self.full = fd, where, True
        self.real_write, self.real_fsync = os.write, os.fsync
        self.partial_done = False
        monkeypatch.setattr(os, "write", self.write)
        monkeypatch.setattr(os, "fsync", self.fsync)

    def write(self, fd, data):
        if fd != self.fd or not self.full or self.where != "write":
            return self.real_write(fd, data)
        if not self.partial_done:
            self.partial_done = True
            return self.real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def fsync(self, fd):
        if fd == self.fd and self.full and self.where == "fsync":
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real_fsync(fd)


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_judgement_on_a_full_disk_is_refused_and_never_reaches_the_log(candidates, tmp_path, monkeypatch, where):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    ann = ApiLabeler(client_for(store, "127.0.0.1")[0], "ann")
    assert ann.post("/api/judge", row=0, answer=1).status_code == 200
    before = log_bytes(output)
    disk = FullDisk(monkeypatch, store.fd, where)
    for _ in range(2):  # the labeler's retry while the disk is still full
        response = ann.post("/api/judge", row=1, answer=2)
        assert response.status_code == 507 and "not saved: the disk is full" in response.json()["error"]
        assert log_bytes(output) == before
    disk.full = False  # space again: the retry is saved, once
    response = ann.post("/api/judge", row=1, answer=2)
    assert response.status_code == 200 and response.json()["next"]["progress"]["labelled"] == 2
    store.close()
    store = LabelStore(load_candidates(candidates), output)  # the restart counts what the server confirmed
    assert [j.row for j in store.judgements()] == [0, 1] and not store.notices
    store.close()
    records = [json.loads(line) for line in log_bytes(output).splitlines()]
    assert [(r["event"], r["seq"]) for r in records] == [("start", 0), ("label", 1), ("key", 2), ("label", 3)]


def test_a_failed_write_that_cannot_be_cut_back_stops_every_later_write(candidates, tmp_path, monkeypatch, capsys):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    client, _ = client_for(store, "127.0.0.1")
    FullDisk(monkeypatch, store.fd, "fsync")  # the line is written, its fsync fails ...

    def no_truncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "ftruncate", no_truncate)  # ... and it cannot be removed again
    response = client.post("/api/judge", json={"labeler": "ann", "row": 0, "answer": 1})
    assert response.status_code == 507
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "may be on disk though it was refused" in line and "seq 1" in line
    monkeypatch.undo()  # space again: still refused, as the log may hold a refused judgement
    response = client.post("/api/judge", json={"labeler": "ann", "row": 1, "answer": 1})
    assert response.status_code == 503 and "could not be cut back" in response.json()["error"]
    store.close()


def test_a_failing_export_keeps_the_judgement_saved_shows_why_and_retries(candidates, tmp_path, monkeypatch, capsys):
    from lm_human_preference_details.files import OutputError
    from lm_human_preference_details.labeling import labelstore

    output = str(tmp_path / "out.json")
    real_save = labelstore.save_label_file
    broken = {"on": True}

    def save(path, *args):
        if broken["on"]:
            raise OutputError(
                f"could not write '{path}' (label file): disk full; it is unchanged. Free space or fix it."
            )
        return real_save(path, *args)

    monkeypatch.setattr(labelstore, "save_label_file", save)
    monkeypatch.setattr(labelstore, "EXPORT_RETRY_SECONDS", 0.2)
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    client, _ = client_for(store, "127.0.0.1")
    ann = ApiLabeler(client, "ann")
    response = ann.post("/api/judge", row=0, answer=1)
    assert response.status_code == 200 and "disk full" in response.json()["next"]["export_error"]
    assert "disk full" in client.get("/api/stats").json()["export_error"]
    assert ann.post("/api/judge", row=1, answer=1).status_code == 200
    time.sleep(0.5)  # the retries on the timer fail too: one warning in all
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and output in warnings[0] and "disk full" in warnings[0]
    broken["on"] = False
    deadline = time.time() + 10
    while store.export_error is not None and time.time() < deadline:
        time.sleep(0.05)
    assert store.export_error is None and client.get("/api/stats").json()["export_error"] is None
    assert len(read_rows(output)) == 2
    broken["on"] = True
    assert ann.post("/api/judge", row=2, answer=1).status_code == 200
    store.close()  # the last rewrite fails too: said, and no retry is left running after the close
    assert "disk full" in store.export_error and store.timer is None


# ---------------------------------------------------------------- the app: access and malformed requests


def client_for(store, host: str, client=("127.0.0.1", 50000)):
    from starlette.testclient import TestClient

    from lm_human_preference_details.labeling.labelserver import access_token, create_app

    token = access_token(host, None)
    return TestClient(create_app(store, token), base_url="http://127.0.0.1:8765", client=client), token


def test_bound_to_all_addresses_state_changes_need_the_token(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output)
    client, token = client_for(store, "0.0.0.0", client=("203.0.113.7", 40000))
    assert token and len(token) >= 16
    before = log_bytes(output)
    body = {"labeler": "ann", "row": 0, "answer": 1}
    for headers in ({}, {"X-Label-Token": "wrong" + token}):
        response = client.post("/api/judge", json=body, headers=headers)
        assert response.status_code == 403 and "token" in response.json()["error"]
        assert client.post("/api/next", json={"labeler": "ann"}, headers=headers).status_code == 403
    assert log_bytes(output) == before
    response = client.post("/api/judge", json=body, headers={"X-Label-Token": token})
    assert response.status_code == 200 and response.json()["next"]["row"] == 1
    store.close()


def test_loopback_server_refuses_other_clients_and_hosts(candidates, tmp_path):
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"))
    client, token = client_for(store, "127.0.0.1")
    assert token is None and client.get("/api/info").status_code == 200
    assert client.get("/api/info", headers={"Host": "evil.example:8765"}).status_code == 403  # DNS rebinding
    outsider, _ = client_for(store, "127.0.0.1", client=("203.0.113.7", 40000))
    assert outsider.post("/api/judge", json={"labeler": "ann", "row": 0, "answer": 1}).status_code == 403
    store.close()


@pytest.mark.parametrize(
    "path", ["/static/../labelstore.py", "/static/%2e%2e/labelstore.py", "/static/..%2flabels.py", "/etc/passwd",
             "/static/index.html/..", "/static/"]
)  # fmt: skip
def test_no_file_outside_the_assets_is_served(candidates, tmp_path, path):
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"))
    client, _ = client_for(store, "127.0.0.1")
    response = client.get(path)
    assert response.status_code == 404 and b"import" not in response.content
    page = client.get("/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    store.close()


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"labeler": "ann", "row": 99, "answer": 1}, 404, "unknown row 99"),
        ({"labeler": "ann", "row": "0", "answer": 1}, 404, "unknown row"),
        ({"labeler": "ann", "row": 0, "answer": 4}, 422, "out of range"),
        ({"labeler": "ann", "row": 0, "answer": True}, 422, "out of range"),
        ({"labeler": "<b>x</b>", "row": 0, "answer": 1}, 422, "labeler name"),
        ({"labeler": "ann", "row": 1, "answer": 0}, 409, "already labelled row 1"),
        ([1, 2], 400, "JSON object"),
    ],
)
def test_malformed_requests_get_a_clear_4xx_and_change_nothing(candidates, tmp_path, body, status, message):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    store.judge("ann", 1, 2)
    client, _ = client_for(store, "127.0.0.1")
    before = log_bytes(output)
    response = client.post("/api/judge", json=body)
    assert response.status_code == status and message in response.json()["error"]
    assert client.post("/api/judge", content=b"{", headers={"Content-Type": "application/json"}).status_code == 400
    assert client.post("/api/judge", data={"labeler": "ann", "row": 0, "answer": 1}).status_code == 415
    assert client.post("/api/undo", json={"labeler": "bob"}).status_code == 409
    assert log_bytes(output) == before
    store.close()


def post_streamed(app, total: int, chunk: int, declared: int | None = None) -> tuple[int, int]:
    """POST `total` bytes of body to /api/judge in `chunk`-byte messages, straight through ASGI; -> (status, bytes
    the app asked for)."""
    sent, status = 0, []

    async def receive():
        nonlocal sent
        size = min(chunk, total - sent)
        sent += size
        return {"type": "http.request", "body": b" " * size, "more_body": sent < total}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    headers = [(b"host", b"127.0.0.1:8765"), (b"content-type", b"application/json")]
    if declared is not None:
        headers.append((b"content-length", str(declared).encode()))
    scope = {"type": "http", "method": "POST", "path": "/api/judge", "raw_path": b"/api/judge", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8765), "scheme": "http",
             "http_version": "1.1", "root_path": ""}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return status[0], sent


def test_a_large_body_is_refused_while_it_arrives(candidates, tmp_path):
    from lm_human_preference_details.labeling.labelserver import MAX_BODY_BYTES, create_app

    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"))
    app = create_app(store, None)
    status, read = post_streamed(app, total=32 << 20, chunk=4096)  # 32 MiB, no Content-Length (chunked)
    assert status == 413 and read <= MAX_BODY_BYTES + 4096
    status, read = post_streamed(app, total=32 << 20, chunk=4096, declared=32 << 20)
    assert status == 413 and read == 0  # refused on its Content-Length, before a byte is read
    store.close()


def test_deep_json_and_internal_errors_answer_with_the_security_headers(candidates, tmp_path):
    from starlette.testclient import TestClient

    from lm_human_preference_details.labeling.labelserver import SECURITY_HEADERS, create_app

    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"))
    app = create_app(store, None)
    client = TestClient(
        app, base_url="http://127.0.0.1:8765", client=("127.0.0.1", 5000), raise_server_exceptions=False
    )
    deep = b"[" * 6000 + b"]" * 6000  # under the size limit, deeper than Python's recursion limit
    response = client.post("/api/judge", content=deep, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "nests too deeply" in response.json()["error"]
    store.next_row = None  # any bug in a handler: a 500
    response = client.post("/api/next", json={"labeler": "ann"})
    assert response.status_code == 500 and "internal error" in response.json()["error"]
    for r in (response, client.get("/nothing"), client.put("/api/judge")):
        assert {k: r.headers.get(k) for k in SECURITY_HEADERS} == SECURITY_HEADERS
    store.close()


def test_a_row_is_claimed_only_by_a_same_origin_json_post(candidates, tmp_path):
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"), shared_fraction=0.0)
    client, _ = client_for(store, "127.0.0.1")
    for name in ("x1", "x2", "x3", "x4", "x5", "x6"):  # what six <img src=".../api/next?labeler=..."> on a page send
        assert client.get(f"/api/next?labeler={name}").status_code == 405
    assert (
        client.post("/api/next", content=b'{"labeler": "x7"}', headers={"Content-Type": "text/plain"}).status_code
        == 415
    )
    cross_site = client.post("/api/next", json={"labeler": "x8"}, headers={"Sec-Fetch-Site": "same-site"})
    assert cross_site.status_code == 403 and "cross-origin" in cross_site.json()["error"]
    response = client.post("/api/next", json={"labeler": "ann"}, headers={"Sec-Fetch-Site": "same-origin"})
    assert response.status_code == 200 and response.json()["row"] == 0  # nothing was claimed by the others
    assert client.post("/api/next", json={"labeler": "bob"}).json()["row"] == 1
    store.close()


def test_the_token_url_sets_a_cookie_and_redirects_to_the_url_without_it(candidates, tmp_path):
    from starlette.testclient import TestClient

    from lm_human_preference_details.labeling.labelserver import create_app

    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"))
    token = "t" * 24
    client = TestClient(create_app(store, token), base_url="http://192.0.2.1:8765", client=("192.0.2.9", 40000))
    assert client.get("/api/info").status_code == 403
    for path in ("/", "/stats"):
        response = client.get(f"{path}?token={token}", follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == path and not response.content
        cookie = response.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and token in cookie
    assert client.get("/api/info").status_code == 200  # the cookie carries the token now
    assert client.get("/?token=" + "x" * 24, follow_redirects=False).status_code == 403
    store.close()


def test_labeler_names_are_normalized_and_mixed_scripts_refused(candidates, tmp_path):
    from lm_human_preference_details.labeling.labelstore import JudgementError

    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"), shared_fraction=1.0)
    store.judge("Ann ", 0, 1)
    for same in ("ann", "  ANN", "\uff21nn", "Ann\u00a0"):  # fullwidth A, no-break space
        with pytest.raises(JudgementError, match="ann already labelled row 0"):
            store.judge(same, 0, 1)
    store.judge("Mary  Ann", 0, 1)
    with pytest.raises(JudgementError, match="mixes Cyrillic and Latin") as refused:
        store.judge("\u0430nn", 1, 1)  # a Cyrillic a
    assert refused.value.status == 422
    assert store.next_row("ANN")["labeler"] == "ann" and sorted(store.labelers) == ["ann", "mary ann"]
    store.close()


def test_a_labelers_name_is_bound_to_the_key_of_its_first_use(candidates, tmp_path):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    client, _ = client_for(store, "127.0.0.1")
    ann = ApiLabeler(client, "ann")
    assert ann.post("/api/judge", row=99, answer=1).status_code == 404 and ann.key is None  # a refusal binds nothing
    assert ann.post("/api/next").json()["labeler_key"] == ann.key and len(ann.key) >= 16
    for impostor in ("ann", "Ann ", "ANN"):
        for path, body in [("/api/judge", {"row": 0, "answer": 1}), ("/api/undo", {}), ("/api/next", {})]:
            response = client.post(path, json={"labeler": impostor, **body})
            assert response.status_code == 403 and "'ann' is in use in another browser" in response.json()["error"]
    assert ann.post("/api/judge", row=0, answer=1).status_code == 200
    again = client.post("/api/judge", json={"labeler": "Ann", "key": ann.key, "row": 1, "answer": 1})
    assert again.status_code == 200 and "labeler_key" not in again.json()
    store.close()
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)  # the binding survives a restart
    client, _ = client_for(store, "127.0.0.1")
    assert client.post("/api/undo", json={"labeler": "ann"}).status_code == 403
    assert client.post("/api/undo", json={"labeler": "ann", "key": ann.key}).json()["undone"] == 1
    assert sorted(agreement_report(store.judgements(), store.skips())["labelers"]) == ["ann"]
    store.close()


def test_krippendorffs_alpha_of_his_example_with_missing_labels():
    # Krippendorff (2011), "Computing Krippendorff's alpha-reliability": 4 observers, 12 units, nominal alpha 0.743
    a = [1, 2, 3, 3, 2, 1, 4, 1, 2, None, None, None]
    b = [1, 2, 3, 3, 2, 2, 4, 1, 2, 5, None, 3]
    c = [None, 3, 3, 3, 2, 3, 4, 2, 2, 5, 1, None]
    d = [1, 2, 3, 3, 2, 4, 4, 1, 2, 5, 1, None]
    units = [[v for v in unit if v is not None] for unit in zip(a, b, c, d)]
    assert krippendorff_alpha(units) == pytest.approx(0.743, abs=5e-4)
    assert krippendorff_alpha([[1, 1], [2, 2]]) == 1.0 and krippendorff_alpha([[1, 1], [1]]) is None


class CountingList(list):
    """A list that counts the elements read by iterating it."""

    reads = 0

    def __iter__(self):
        for item in super().__iter__():
            self.reads += 1
            yield item


def test_stats_of_many_labelers_take_time_linear_in_the_judgements():
    import random

    rng = random.Random(0)
    judgements = CountingList(
        Judgement(f"l{i:03d}", row, rng.randrange(4), seq)
        for seq, (i, row) in enumerate((i, row) for row in range(5) for i in range(120))
    )
    agreement_report(judgements)
    assert judgements.reads <= 4 * len(judgements)  # not once per labeler (120 x 600 before)
    report = agreement_report(judgements, max_pair_labelers=40)
    assert report["pairs"] == [] and "120 labelers share rows, 7140 pairs" in report["pairs_left_out"]
    by_row = {}
    for j in judgements:
        by_row.setdefault(j.row, []).append(j)
    for name in ("l000", "l061", "l119"):  # the linear-time majority of the others equals the majority rule's
        mine = [j for j in judgements if j.labeler == name]
        hits = [j.label == majority_label([o for o in by_row[j.row] if o.labeler != name]) for j in mine]
        assert report["majority_agreement"][name] == {"rows": 5, "agreement": sum(hits) / 5}
    assert (
        agreement_report(hand_judgements())["pairs"]
        == agreement_report(hand_judgements(), max_pair_labelers=3)["pairs"]
    )


def test_stats_are_computed_off_the_event_loop_once_per_change(candidates, tmp_path, monkeypatch):
    from lm_human_preference_details.labeling import labelserver

    calls = []

    def report(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            calls.append("on the event loop")
        except RuntimeError:
            calls.append("in a thread")
        return agreement_report(*args, **kwargs)

    monkeypatch.setattr(labelserver, "agreement_report", report)
    store = LabelStore(load_candidates(candidates), str(tmp_path / "out.json"), shared_fraction=1.0)
    client, _ = client_for(store, "127.0.0.1")
    assert client.get("/api/stats").json()["rows_labelled"] == 0
    client.get("/api/stats")
    client.post("/api/judge", json={"labeler": "ann", "row": 0, "answer": 1})
    assert client.get("/api/stats").json()["rows_labelled"] == 1
    assert calls == ["in a thread", "in a thread"]
    store.close()


# ---------------------------------------------------------------- commands


def test_sample_writes_the_rows_generate_labels(world, tmp_path):  # noqa: F811
    flags = ["--num_queries", "6", "--batch_size", "8"]
    candidates_path = tmp_path / "candidates.json"
    run_label_generation(["sample", *world_flags(world, candidates_path, *flags)[1:]])
    run_label_generation(world_flags(world, tmp_path / "vader.json", *flags, "--labeler", "vader"))
    candidates = load_candidates(str(candidates_path))
    generated = read_rows(tmp_path / "vader.json")
    # the same queries and responses as generate with the same seeds: truncated, filtered, PAD written as 50259
    assert [r["query"] for r in candidates.rows] == [r["query"] for r in generated]
    assert [r["samples"] for r in candidates.rows] == [[r[f"sample{i}"] for i in range(4)] for r in generated]
    assert all(passes_filter_and_is_truncated(s) for r in candidates.rows for s in r["samples"])
    assert candidates.rows[0]["sample_texts"][0] and "<|endoftext|>" not in candidates.rows[0]["query_text"]
    assert candidates.meta["pad_id"] == OAI_PAD_TOKEN and candidates.instructions
    with pytest.raises(ValueError, match="exists"):
        run_label_generation(["sample", *world_flags(world, candidates_path, *flags)[1:]])


def serve_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.run(label_generation.main, label_generation.parse, ["serve", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ")
    return lines[0]


def test_serve_validates_candidates_and_output_before_serving(candidates, tmp_path, capsys):
    assert "would overwrite" in serve_error(capsys, "--candidates", candidates, "--output", candidates)
    bad = tmp_path / "labels.json"
    bad.write_text(json.dumps([{"query": [1], "sample0": [1], "sample1": [1], "best": 0}]))
    assert "not a candidates file" in serve_error(capsys, "--candidates", str(bad), "--output", str(tmp_path / "o"))
    assert "does not exist" in serve_error(capsys, "--candidates", str(tmp_path / "none"))
    broken = json.loads(open(candidates, encoding="utf-8").read())
    broken["rows"][3]["samples"] = broken["rows"][3]["samples"][:2]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert "row 3" in serve_error(capsys, "--candidates", str(tmp_path / "broken.json"), "--output", str(bad) + "2")
    other = tmp_path / "other.json"
    other.write_text("[]")
    assert "judgements" in serve_error(capsys, "--candidates", candidates, "--output", str(other))
    (tmp_path / "other.json.judgements.jsonl").write_text("")
    assert "was not collected on" in serve_error(capsys, "--candidates", candidates, "--output", str(other))
    assert os.path.getsize(other) == 2  # untouched


def test_agreement_command_prints_the_figures(tmp_path, candidates, capsys):
    output = str(tmp_path / "out.json")
    store = LabelStore(load_candidates(candidates), output, shared_fraction=1.0)
    for name, row, answer in [("ann", 0, 0), ("bob", 0, 0), ("ann", 1, 1), ("bob", 1, 1)]:
        order = shown_order(name, row, 4)
        store.judge(name, row, order.index(answer))  # both pick sample `answer`
    store.close()
    report = run_label_generation(["agreement", "--judgements", output])
    assert report["pairs"] == [{"labelers": ["ann", "bob"], "rows": 2, "agreement": 1.0, "cohen_kappa": 1.0}]
    text = capsys.readouterr().out
    assert "Cohen's kappa" in text and "ann & bob" in text and "1.000" in text and "Krippendorff's alpha 1.000" in text


@pytest.mark.slow
def test_demo_label_step_through_the_server_labels_every_row_with_vaders_choice(
    world,  # noqa: F811 (the fixture)
    tmp_path,
    tokenizer,
    monkeypatch,
):
    import importlib.util

    monkeypatch.syspath_prepend(str(REPO / "demo"))  # run_demo imports its neighbours, as when run as a script
    spec = importlib.util.spec_from_file_location("run_demo", REPO / "demo" / "run_demo.py")
    run_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_demo)
    labels = tmp_path / "labels" / "vader.json"
    flags = dict(zip(*[iter(world_flags(world, labels, "--num_queries", "6", "--batch_size", "8")[1:-2])] * 2))
    run_demo.label_through_server(flags, labels, tmp_path / "logs")
    rows = read_rows(labels)
    assert len(rows) == 6 and "stopped: 6 judgements" in (tmp_path / "logs" / "labels.log").read_text()
    # the scripted human picked a response VADER scores highest (ties may go to any of them)
    loaded = load_labels(str(labels), 16, 8, tokenizer.pad_token_id, 6, "best_of_4", "--output")
    scores = VaderLabeler(tokenizer, tokenizer.pad_token_id).scores(loaded.query, loaded.samples)  # (6, 4)
    assert torch.equal(scores.gather(1, loaded.label[:, None])[:, 0], scores.max(1).values)


def test_serve_on_all_addresses_prints_a_token_once_and_stops_cleanly(candidates, tmp_path, capsys, monkeypatch):
    import uvicorn

    def interrupted(self, sockets):
        assert sockets[0].getsockname()[0] == "0.0.0.0"
        raise KeyboardInterrupt  # what uvicorn re-raises after its clean shutdown on Ctrl-C

    monkeypatch.setattr(uvicorn.Server, "run", interrupted)
    output = str(tmp_path / "out.json")
    run_label_generation(["serve", "--candidates", candidates, "--output", output, "--host", "0.0.0.0", "--port", "0"])
    text = capsys.readouterr().out
    token = text.split("?token=")[1].split()[0]
    assert len(token) >= 16 and text.count(token) == 2  # in the URL and on its own line, nowhere else
    assert "stopped: 0 judgements" in text


def test_serve_takes_the_token_from_a_file_or_the_environment(candidates, tmp_path, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets: None)
    token_file = tmp_path / "token"
    token_file.write_text("f" * 20 + "\n")
    output = str(tmp_path / "out.json")
    base = ["serve", "--candidates", candidates, "--output", output, "--host", "0.0.0.0", "--port", "0"]
    run_label_generation([*base, "--token_file", str(token_file)])
    assert f"?token={'f' * 20}" in capsys.readouterr().out
    monkeypatch.setenv("LHPD_LABEL_TOKEN", "e" * 20)
    run_label_generation(base)
    assert f"?token={'e' * 20}" in capsys.readouterr().out
    assert "--token_file" in serve_error(capsys, *base[1:], "--token_file", str(tmp_path / "none"))


def test_training_never_imports_the_web_framework():
    import ast

    for path in [
        *(REPO / "lm_human_preference_details").glob("*.py"),
        REPO / "train_reward.py",
        REPO / "train_policy.py",
    ]:
        if path.name == "labelserver.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top_level for a in n.names] + [
            n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)
        ]
        assert not any(name.split(".")[0] in ("starlette", "uvicorn") or "labelserver" in name for name in names), path
