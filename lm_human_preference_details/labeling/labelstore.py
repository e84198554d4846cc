"""Human labels collected in a browser: the candidates file, the append-only judgements log, and the label file.

`label_generation.py sample` writes a candidates file: the settings and one unlabelled row per query (the query and
its N responses, truncated and filtered as in training, tokens and texts). `label_generation.py serve` shows them to
labelers (labelserver.py); every action of a labeler (label, skip, undo) is appended to `<output>.judgements.jsonl`
with fsync before the page shows the next row, and the label file in OAI's schema is rebuilt from it: one label per
row, decided by the majority rule below. Nothing here imports a web framework, so training never needs one.
"""

import errno
import hashlib
import json
import os
import random
import re
import secrets
import sys
import threading
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from lm_human_preference_details.files import write_atomic

try:
    import fcntl
except ImportError:  # Windows: no advisory lock against a second server on the same output
    fcntl = None
from lm_human_preference_details.labels import LabelType, get_label_type, save_label_file

CANDIDATES_FORMAT = "lm-human-preference-details candidates"
"""the `format` field of a candidates file"""
JUDGEMENTS_SUFFIX = ".judgements.jsonl"
"""suffix of the judgements log written beside a label file"""
RATING_SCALE = (1, 7)
"""scalar_rating: the labeler's score, 1 (bad) to 7 (good), is the row's `score`"""
COMPARE_SCALE = (-2, 2)
"""scalar_compare: how much better the response shown second is than the one shown first, -2 to 2"""
CLAIM_SECONDS = 600.0
"""a row shown to one labeler (and not shared) is kept from the others this long, unless that labeler moves on"""
THROUGHPUT_WINDOW_SECONDS = 600.0
"""the throughput shown on the page counts the labels of the last ten minutes"""
EXPORT_SECONDS = 1.0
"""the label file is rewritten at most this often while labelers work (every judgement is in the log at once)"""
EXPORT_RETRY_SECONDS = 10.0
"""a rewrite of the label file that failed (disk full, read-only directory) is tried again this much later"""
MAJORITY_RULE = (
    "one label per row: the value most of the row's labelers gave (plurality); a tie goes to the tied value that was "
    "given first (the earliest judgement); undone judgements do not count"
)
TASK_INSTRUCTIONS = {
    "sentiment": "Pick the continuation that is the most positive and happy, while still a natural continuation.",
    "descriptiveness": "Pick the continuation that is the most vividly descriptive (physical details, sights, sounds).",
    "tldr": "Pick the best summary of the post: accurate, covering its main points, fluent.",
    "cnndm": "Pick the best summary of the article: accurate, covering its main points, fluent.",
}
"""the short task description shown above each row, per --task"""


LABELER_NAME = re.compile(r"[^\W_][\w .@-]{0,39}")
"""a labeler's name: 1 to 40 letters, digits, spaces and . @ - _, starting with a letter or digit"""
SCRIPT_GROUPS = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK"}
"""scripts written together in one name (Japanese, Korean with Han characters); any other mix is refused"""


def _script(char: str) -> str:
    """The script of a letter, from its Unicode name ('LATIN SMALL LETTER A' -> LATIN)."""
    script = unicodedata.name(char, "UNKNOWN").split(" ")[0]
    return SCRIPT_GROUPS.get(script, script)


def normalize_labeler(name: Any) -> str:
    """One spelling per labeler: Unicode NFKC, case folded, spaces trimmed and collapsed ('Ann ', 'ANN' and 'ann' are
    one labeler). JudgementError 422 for a name LABELER_NAME does not allow, or one mixing scripts (a Cyrillic 'а'
    in 'аnn' looks like 'ann' but would count as another labeler)."""
    if not isinstance(name, str):
        raise JudgementError(422, "a labeler name must be a string.")
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())
    folded = " ".join(folded.split())
    if not LABELER_NAME.fullmatch(folded):
        raise JudgementError(
            422, "a labeler name is 1 to 40 letters, digits, spaces or . @ - _, starting with a letter or digit."
        )
    scripts = sorted({_script(c) for c in folded if c.isalpha()})
    if len(scripts) > 1:
        raise JudgementError(
            422,
            f"the labeler name {name!r} mixes {' and '.join(s.title() for s in scripts)} letters, which can look "
            "alike and would count as another labeler; type it in one script.",
        )
    return folded


class JudgementError(Exception):
    """A request that cannot be applied (unknown row, answer out of range, second label): nothing changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- candidates


@dataclass
class Candidates:
    """The unlabelled rows of a candidates file and its settings."""

    path: str
    label_type: LabelType
    meta: dict
    """the settings the rows were sampled with (base model, tokenizer fingerprint, PAD id written, task, counts)"""
    instructions: str
    rows: list[dict]
    """per row: query (tokens), samples (N token lists), query_text, sample_texts (N strings)"""
    sha256: str

    @property
    def num_samples(self) -> int:
        return self.label_type.num_samples


def save_candidates(path: str, label_type: LabelType, rows: list[dict], meta: dict, instructions: str) -> None:
    """Write a candidates file atomically."""
    content = {
        "format": CANDIDATES_FORMAT,
        "label_type": label_type.name,
        "instructions": instructions,
        "meta": meta,
        "rows": rows,
    }
    write_atomic(path, lambda f: json.dump(content, f), "--output")


def _is_tokens(value: Any) -> bool:
    """True for a non-empty list of ints >= 0."""
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _check_candidate_row(row: Any, i: int, n: int, where: str) -> None:
    """ValueError naming the row and field of a malformed candidates row."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row {i} is a {type(row).__name__}, expected an object; re-run `sample`.")
    samples, texts = row.get("samples"), row.get("sample_texts")
    problem = None
    if not _is_tokens(row.get("query")):
        problem = "'query' must be a non-empty list of token ids"
    elif not isinstance(row.get("query_text"), str):
        problem = "'query_text' must be a string"
    elif not (isinstance(samples, list) and len(samples) == n and all(_is_tokens(s) for s in samples)):
        problem = f"'samples' must be {n} non-empty lists of token ids"
    elif not (isinstance(texts, list) and len(texts) == n and all(isinstance(t, str) for t in texts)):
        problem = f"'sample_texts' must be {n} strings"
    if problem:
        raise ValueError(f"{where}: row {i}: {problem}; re-run `label_generation.py sample` to rewrite the file.")


def load_candidates(path: str, flag: str = "--candidates") -> Candidates:
    """A candidates file, validated; ValueError naming the flag and the problem otherwise."""
    where = f"{flag} '{path}'"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist; write it with `label_generation.py sample --output FILE`.")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        content = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where} is not JSON ({e}); pass a file written by `label_generation.py sample`.") from e
    if not isinstance(content, dict) or content.get("format") != CANDIDATES_FORMAT:
        raise ValueError(
            f'{where} is not a candidates file (no "format": "{CANDIDATES_FORMAT}"); pass a file written by '
            "`label_generation.py sample` (a label file is not one)."
        )
    label_type = get_label_type(str(content.get("label_type")), flag=f"{where} label_type")
    rows, meta = content.get("rows"), content.get("meta")
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where} holds no rows; re-run `label_generation.py sample` with --num_queries >= 1.")
    if not isinstance(meta, dict) or type(meta.get("pad_id")) is not int:
        raise ValueError(f"{where}: 'meta' must be an object with the file's 'pad_id'; re-run `sample`.")
    for i, row in enumerate(rows):
        _check_candidate_row(row, i, label_type.num_samples, where)
    lengths = {len(row["query"]) for row in rows}, {len(s) for row in rows for s in row["samples"]}
    if len(lengths[0]) != 1 or len(lengths[1]) != 1:
        raise ValueError(f"{where}: every query and every sample must have the same length; re-run `sample`.")
    instructions = content.get("instructions")
    return Candidates(
        path=str(path),
        label_type=label_type,
        meta=meta,
        instructions=instructions if isinstance(instructions, str) else "",
        rows=rows,
        sha256=hashlib.sha256(raw).hexdigest(),
    )


# ---------------------------------------------------------------- answers


def answer_range(label_type: LabelType) -> tuple[int, int]:
    """The answers a labeler can give (inclusive): a shown position (best_of_N), a rating, or a comparison."""
    if label_type.label_field == "best":
        return 0, label_type.num_samples - 1
    return RATING_SCALE if label_type.label_field == "score" else COMPARE_SCALE


def shown_order(labeler: str, row: int, num_samples: int) -> list[int]:
    """The order in which `labeler` sees the responses of `row`: a permutation fixed by (labeler, row)."""
    seed = int.from_bytes(hashlib.sha256(f"{labeler}\0{row}".encode()).digest()[:8], "big")
    order = list(range(num_samples))
    random.Random(seed).shuffle(order)
    return order


def label_from_answer(label_type: LabelType, answer: int, order: list[int]) -> int | float:
    """The label of OAI's schema from an answer on the page: the best sample's index, the score, or score1 - score0."""
    if label_type.label_field == "best":
        return order[answer]
    if label_type.label_field == "score":
        return float(answer)
    # the answer says how much better the response shown second is; difference = score(sample1) - score(sample0)
    return float(answer if order == [0, 1] else -answer)


# ---------------------------------------------------------------- judgements


@dataclass
class Judgement:
    """One label that was not undone."""

    labeler: str
    row: int
    label: int | float
    seq: int
    """position in the judgements log (earlier judgements have smaller seq)"""


def majority_label(judgements: list[Judgement]) -> int | float:
    """The label of one row under MAJORITY_RULE: the most frequent value; a tie goes to the value given first."""
    counts = Counter(j.label for j in judgements)
    top = max(counts.values())
    return min((j for j in judgements if counts[j.label] == top), key=lambda j: j.seq).label


def judgements_path(output: str) -> str:
    """The judgements log beside a label file."""
    return f"{output}{JUDGEMENTS_SUFFIX}"


def read_log(path: str) -> tuple[list[dict], int]:
    """Records of a judgements log and the byte length of its complete lines. A torn last line (no newline, or not
    JSON: a write cut short by a crash or a full disk, never confirmed) is left out; any other bad line is an error."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw[: raw.rfind(b"\n") + 1].splitlines(keepends=True)
    records, complete = [], 0
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if number == len(lines):
                break
            raise ValueError(f"judgements log '{path}' line {number} is not JSON ({e}); restore it from a copy.") from e
        if not isinstance(record, dict) or "event" not in record:
            raise ValueError(f"judgements log '{path}' line {number} is not a judgement record; restore it.")
        records.append(record)
        complete += len(line)
    return records, complete


@dataclass
class LabelerState:
    """What one labeler did, replayed from the log."""

    actions: list[dict] = field(default_factory=list)
    """label and skip records not undone, in order (undo pops the last one)"""
    labels: dict[int, dict] = field(default_factory=dict)
    skipped: set[int] = field(default_factory=set)
    times: list[float] = field(default_factory=list)
    """times of the labels given (for the throughput)"""


class JudgementState:
    """What every labeler did, replayed from the records of a judgements log."""

    def __init__(self):
        self.labelers: dict[str, LabelerState] = {}
        self.row_labels: dict[int, dict[str, dict]] = {}
        """row -> labeler -> label record"""
        self.seq = 0
        """the seq of the next record"""
        self.keys: dict[str, str] = {}
        """labeler -> SHA-256 of their labeler key (LabelStore.authorize)"""

    def apply(self, record: dict) -> None:
        """Replay one record on the state."""
        self.seq = max(self.seq, int(record.get("seq", 0)) + 1)
        event, name = record["event"], record.get("labeler")
        if event == "start":
            return
        if event == "key":
            self.keys[name] = record["key_sha256"]
            return
        state = self.labelers.setdefault(name, LabelerState())
        row = record.get("row")
        if event == "label":
            state.actions.append(record)
            state.labels[row] = record
            state.times.append(record["time"])
            self.row_labels.setdefault(row, {})[name] = record
        elif event == "skip":
            state.actions.append(record)
            state.skipped.add(row)
        elif event == "undo" and state.actions:
            undone = state.actions.pop()
            if undone["event"] == "label":
                del state.labels[undone["row"]]
                del self.row_labels[undone["row"]][name]
                state.times.remove(undone["time"])
            else:
                state.skipped.discard(undone["row"])

    def judgements(self) -> list[Judgement]:
        """Every label not undone, in log order."""
        labelled = [r for state in self.labelers.values() for r in state.labels.values()]
        records = sorted(labelled, key=lambda r: r["seq"])
        return [Judgement(r["labeler"], r["row"], r["label"], r["seq"]) for r in records]

    def skips(self) -> dict[str, int]:
        """Rows skipped per labeler."""
        return {name: len(state.skipped) for name, state in self.labelers.items()}


class LabelStore(JudgementState):
    """The judgements of every labeler: an append-only log with fsync, one lock around every change, and the state
    replayed from it. The label file (and the pairs file) are rebuilt from the state after a change (at most every
    EXPORT_SECONDS), at start and at close."""

    def __init__(
        self,
        candidates: Candidates,
        output: str,
        shared_fraction: float = 0.0,
        pairs_output: str | None = None,
    ):
        self.candidates, self.output, self.pairs_output = candidates, output, pairs_output
        self.log_path = judgements_path(output)
        super().__init__()
        self.lock = threading.Lock()
        self.claims: dict[int, tuple[str, float]] = {}
        self.timer: threading.Timer | None = None
        self.last_export = -EXPORT_SECONDS
        self.export_error: str | None = None
        """why the last rewrite of the label file failed (None: it is up to date or pending)"""
        self.broken: str | None = None
        """why no judgement can be saved until a restart (a failed write that could not be cut back)"""
        self.notices: list[str] = []
        """what was repaired when the log was opened (a torn last line), one line each"""
        n = len(candidates.rows)
        self.shared = set(random.Random(0).sample(range(n), round(shared_fraction * n)))
        self._open_log()

    # ------------------------------------------------ log

    def _open_log(self) -> None:
        """Replay an existing log (checking it belongs to these candidates) or start one; hold it locked."""
        exists = os.path.isfile(self.log_path) and os.path.getsize(self.log_path) > 0
        records, complete = read_log(self.log_path) if exists else ([], 0)
        # unbuffered: a write that fails leaves nothing in a buffer that a later write could flush to the file
        self.fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            raise ValueError(
                f"'{self.log_path}' is in use by another `label_generation.py serve`; stop it or choose another "
                "--output."
            ) from e
        if exists and os.path.getsize(self.log_path) > complete:
            self._cut_torn_tail(complete)
        self.log_size = complete
        """bytes of the log's complete lines: what a failed append is cut back to"""
        if records:
            header = records[0]
            if header.get("event") != "start" or header.get("candidates_sha256") != self.candidates.sha256:
                os.close(self.fd)
                raise ValueError(
                    f"--output '{self.output}': its judgements '{self.log_path}' were collected on other candidates "
                    f"than --candidates '{self.candidates.path}' (content differs); pass the candidates they were "
                    "collected on, or choose another --output."
                )
            for record in records:
                self.apply(record)
        else:
            self._append(
                {
                    "event": "start",
                    "candidates": self.candidates.path,
                    "candidates_sha256": self.candidates.sha256,
                    "label_type": self.candidates.label_type.name,
                }
            )

    def _cut_torn_tail(self, complete: int) -> None:
        """Cut a last line torn by a crash or a full disk (never confirmed to a labeler) off the log, keeping its
        bytes in `<log>.torn` when there is room; one notice says so."""
        with open(self.log_path, "rb") as f:
            f.seek(complete)
            torn = f.read()
        kept = f"kept in '{self.log_path}.torn'"
        try:
            with open(f"{self.log_path}.torn", "ab") as f:
                f.write(torn + b"\n")
        except OSError as e:
            kept = f"not kept ({e.strerror or e})"
        os.ftruncate(self.fd, complete)
        self.notices.append(
            f"judgements log '{self.log_path}': its last line was half-written ({len(torn)} bytes, never confirmed "
            f"to a labeler); cut off, {kept}."
        )

    def _append(self, record: dict) -> dict:
        """Write one record as one line and fsync it; only then is it applied (and confirmed to the page). On a write
        error (disk full) the log is cut back to its last complete line and JudgementError 507 says nothing was
        saved."""
        if self.broken is not None:
            raise JudgementError(503, f"not saved: {self.broken}.")
        record = {**record, "seq": self.seq, "time": time.time()}
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        try:
            written = 0
            while written < len(line):  # O_APPEND and the lock: a short write is continued, never interleaved
                written += os.write(self.fd, line[written:])
            os.fsync(self.fd)
        except OSError as e:
            self._cut_back(record["seq"])
            reason = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise JudgementError(
                507, f"not saved: {reason} (judgements log '{self.log_path}'); free space, then answer again."
            ) from e
        self.log_size += len(line)
        self.seq += 1
        return record

    def _cut_back(self, seq: int) -> None:
        """Remove the bytes of a failed append, so no part of it is ever read back as a judgement. If even that
        fails, the record may be on disk though refused: every later write is refused (503) and the console says
        so, until the server is restarted."""
        try:
            os.ftruncate(self.fd, self.log_size)
        except OSError as e:
            self.broken = (
                f"the judgements log '{self.log_path}' could not be cut back after a failed write "
                f"({e.strerror or e}), so its record seq {seq} may be on disk though it was refused; stop the server, "
                "free space, remove that record from the log if it is there, and start again"
            )
            print(f"error: {self.broken}", file=sys.stderr, flush=True)
            return
        try:
            os.fsync(self.fd)  # the cut on disk too (a crash before it could bring back a line the page was refused)
        except OSError:
            pass  # the cut stands in the page cache; the next append's fsync writes it

    def close(self) -> None:
        """Write the label file if a change is pending, release the log."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
                self._export_now()
                if self.timer is not None:  # it failed: no retry after the close (the next start rebuilds it)
                    self.timer.cancel()
                    self.timer = None
            os.close(self.fd)

    def _export_soon(self) -> None:
        """Rewrite the label file now, or at most EXPORT_SECONDS after the last rewrite (the log is already on disk;
        a restart rebuilds the label file from it)."""
        wait = self.last_export + EXPORT_SECONDS - time.monotonic()
        if wait <= 0:
            self._export_now()
        elif self.timer is None:
            self._start_timer(wait)

    def _start_timer(self, wait: float) -> None:
        self.timer = threading.Timer(wait, self._export_pending)
        self.timer.daemon = True
        self.timer.start()

    def _export_now(self) -> None:
        """export(); a failure (disk full, read-only directory) never fails the judgement that is already saved: it
        is kept in export_error (shown on the page and in /api/stats), warned about once on the console, and retried
        EXPORT_RETRY_SECONDS later."""
        try:
            self.export()
        except OSError as e:
            message = f"the label file could not be written ({e})"
            if message != self.export_error:
                print(f"warning: {message}; trying again every {EXPORT_RETRY_SECONDS:g} s", file=sys.stderr, flush=True)
            self.export_error = message
            if self.timer is None:
                self._start_timer(EXPORT_RETRY_SECONDS)
            return
        if self.export_error is not None:
            print(f"the label file '{self.output}' is written again", file=sys.stderr, flush=True)
            self.export_error = None

    def _export_pending(self) -> None:
        """The delayed rewrite of _export_soon."""
        with self.lock:
            if self.timer is not None:
                self.timer = None
                self._export_now()

    # ------------------------------------------------ requests

    @staticmethod
    def check_labeler(name: Any) -> str:
        """The labeler's name normalized (normalize_labeler), or JudgementError 422 when it is not a name."""
        return normalize_labeler(name)

    def check_key(self, labeler: Any, key: Any) -> bool:
        """Refuse (403) a request for a labeler whose name is bound to a labeler key it does not carry, so nobody
        labels or undoes as someone else; -> True when the name is not bound yet (issue_key binds it)."""
        labeler = self.check_labeler(labeler)
        known = self.keys.get(labeler)
        if known is None:
            return True
        given = hashlib.sha256(key.encode()).hexdigest() if isinstance(key, str) else ""
        if not secrets.compare_digest(given, known):
            raise JudgementError(
                403,
                f"the name {labeler!r} is in use in another browser or program: continue there, type its labeler key "
                "(shown there on the page) with the name, or choose another name.",
            )
        return False

    def issue_key(self, labeler: str) -> str | None:
        """Bind `labeler` to a new random labeler key (its SHA-256 is logged) after their first request succeeded;
        -> the key, or None when the name was bound meanwhile."""
        labeler = self.check_labeler(labeler)
        with self.lock:
            if labeler in self.keys:
                return None
            key = secrets.token_urlsafe(18)
            digest = hashlib.sha256(key.encode()).hexdigest()
            self.apply(self._append({"event": "key", "labeler": labeler, "key_sha256": digest}))
        return key

    def _check_row(self, row: Any) -> int:
        """The row index, or JudgementError 404 for an unknown row."""
        if type(row) is not int or not 0 <= row < len(self.candidates.rows):
            raise JudgementError(404, f"unknown row {row!r}: rows are 0 to {len(self.candidates.rows) - 1}.")
        return row

    def judge(self, labeler: str, row: Any, answer: Any) -> dict:
        """Record `labeler`'s answer for `row` (fsync'ed), rebuild the label file; the appended record."""
        labeler = self.check_labeler(labeler)
        row = self._check_row(row)
        low, high = answer_range(self.candidates.label_type)
        if type(answer) is not int or not low <= answer <= high:
            raise JudgementError(422, f"answer {answer!r} is out of range: give an integer from {low} to {high}.")
        with self.lock:
            state = self.labelers.get(labeler, LabelerState())
            if row in state.labels or row in state.skipped:
                done = "labelled" if row in state.labels else "skipped"
                raise JudgementError(409, f"{labeler} already {done} row {row}; undo it first to change it.")
            order = shown_order(labeler, row, self.candidates.num_samples)
            label = label_from_answer(self.candidates.label_type, answer, order)
            record = {"event": "label", "labeler": labeler, "row": row, "answer": answer, "label": label}
            record = self._append({**record, "shown_order": order})
            self.apply(record)
            self.claims.pop(row, None)
            self._export_soon()
        return record

    def skip(self, labeler: str, row: Any) -> dict:
        """Record that `labeler` skipped `row` (it is not shown to them again)."""
        labeler = self.check_labeler(labeler)
        row = self._check_row(row)
        with self.lock:
            state = self.labelers.get(labeler, LabelerState())
            if row in state.labels or row in state.skipped:
                raise JudgementError(409, f"{labeler} already answered row {row}; undo it first.")
            order = shown_order(labeler, row, self.candidates.num_samples)
            record = self._append({"event": "skip", "labeler": labeler, "row": row, "shown_order": order})
            self.apply(record)
            self.claims.pop(row, None)
        return record

    def undo(self, labeler: str) -> dict:
        """Undo `labeler`'s last label or skip (appended as an undo record; the log keeps both)."""
        labeler = self.check_labeler(labeler)
        with self.lock:
            state = self.labelers.get(labeler)
            if state is None or not state.actions:
                raise JudgementError(409, f"{labeler} has nothing to undo.")
            last = state.actions[-1]
            record = self._append({"event": "undo", "labeler": labeler, "row": last["row"], "undoes": last["seq"]})
            self.apply(record)
            self._claim(labeler, last["row"], time.time())  # the undone row is shown to them next
            if last["event"] == "label":
                self._export_soon()
        return record

    def _claimed_row(self, labeler: str) -> int | None:
        """The row `labeler` holds a claim on (each labeler holds at most one), or None."""
        return next((row for row, (name, _) in self.claims.items() if name == labeler), None)

    def _claim(self, labeler: str, row: int, now: float) -> None:
        """`row` is shown to `labeler` from `now`: their previous claim is released (call under the lock)."""
        self.claims.pop(self._claimed_row(labeler), None)
        self.claims[row] = (labeler, now)

    def next_row(self, labeler: str) -> dict:
        """Claim the next row for `labeler` (shown order applied); with their progress, their normalized name and a
        failed export's reason. Row None when none is left for them: `progress.claimed_by_others` then counts the
        rows still shown to someone else (they come back when that claim expires)."""
        labeler = self.check_labeler(labeler)
        with self.lock:
            state = self.labelers.get(labeler, LabelerState())
            now = time.time()
            available, claimed_by_others = [], 0
            for row in range(len(self.candidates.rows)):
                if row in state.labels or row in state.skipped:
                    continue
                if row not in self.shared:
                    others = set(self.row_labels.get(row, {})) - {labeler}
                    claim = self.claims.get(row)
                    claimed = claim is not None and claim[0] != labeler and now - claim[1] < CLAIM_SECONDS
                    if others or claimed:
                        claimed_by_others += bool(claimed and not others)
                        continue
                available.append(row)
            progress = {
                "labelled": len(state.labels),
                "skipped": len(state.skipped),
                "remaining": len(available),
                "claimed_by_others": claimed_by_others,
                "total": len(self.candidates.rows),
                "can_undo": bool(state.actions),
                "per_minute": labels_per_minute(state.times, now),
            }
            status = {"labeler": labeler, "progress": progress, "export_error": self.export_error}
            if not available:
                return {"row": None, **status}
            # a reloaded page shows the row this labeler was shown, while it is still theirs to answer
            own = self._claimed_row(labeler)
            row = own if own in set(available) else available[0]
            self._claim(labeler, row, now)
        candidate = self.candidates.rows[row]
        order = shown_order(labeler, row, self.candidates.num_samples)
        return {
            "row": row,
            "query": candidate["query_text"],
            "responses": [candidate["sample_texts"][i] for i in order],
            "shared": row in self.shared,
            **status,
        }

    # ------------------------------------------------ results

    def export(self) -> int:
        """Rewrite the label file (majority label per labelled row), its metadata and the pairs file; -> rows."""
        self.last_export = time.monotonic()
        rows = label_rows(self.candidates, self.judgements())
        if not rows:
            return 0
        label_type = self.candidates.label_type
        meta = {
            **{k: v for k, v in self.candidates.meta.items() if k != "counts"},
            "format": f"{label_type.name} labels in OAI's schema: {', '.join(label_type.fields)}",
            "label_type": label_type.name,
            "labeler": "human (label_generation.py serve)",
            "labelers": sorted(self.labelers),
            "candidates": self.candidates.path,
            "candidates_sha256": self.candidates.sha256,
            "judgements": self.log_path,
            "majority_rule": MAJORITY_RULE,
            "counts": {
                "rows": len(rows),
                "judgements": len(self.judgements()),
                "candidate_rows": len(self.candidates.rows),
            },
        }
        pad_id = self.candidates.meta["pad_id"]
        save_label_file(self.output, [row for _, row in rows], pad_id, pad_id, meta)
        if self.pairs_output:
            pairs = preference_pairs(self.candidates, rows)
            write_atomic(
                self.pairs_output, lambda f: f.writelines(json.dumps(p) + "\n" for p in pairs), "--pairs_output"
            )
        return len(rows)


def labels_per_minute(times: list[float], now: float, window: float = THROUGHPUT_WINDOW_SECONDS) -> float | None:
    """A labeler's throughput: labels given in the last `window` seconds per minute since the first of them; None
    below two such labels."""
    recent = [t for t in times if now - t <= window]
    if len(recent) < 2:
        return None
    return 60.0 * len(recent) / max(now - min(recent), 1.0)


def label_rows(candidates: Candidates, judgements: list[Judgement]) -> list[tuple[int, dict]]:
    """(row index, label row in OAI's schema) of every labelled row, in candidates order, label by majority."""
    by_row: dict[int, list[Judgement]] = {}
    for j in judgements:
        by_row.setdefault(j.row, []).append(j)
    label_type = candidates.label_type
    out = []
    for row in sorted(by_row):
        candidate = candidates.rows[row]
        label = majority_label(by_row[row])
        samples = dict(zip(label_type.sample_fields, candidate["samples"]))
        out.append((row, {"query": candidate["query"], **samples, label_type.label_field: label}))
    return out


def preference_pairs(candidates: Candidates, rows: list[tuple[int, dict]]) -> list[dict]:
    """chosen/rejected text pairs: the best response against each other one, or the better of a comparison (ties
    are left out); scalar ratings give none."""
    label_type, pairs = candidates.label_type, []
    for row, label_row in rows:
        candidate = candidates.rows[row]
        texts = candidate["sample_texts"]
        if label_type.label_field == "best":
            best = label_row["best"]
            chosen_rejected = [(best, i) for i in range(len(texts)) if i != best]
        elif label_type.label_field == "difference" and label_row["difference"] != 0:
            chosen_rejected = [(1, 0) if label_row["difference"] > 0 else (0, 1)]
        else:
            chosen_rejected = []
        for chosen, rejected in chosen_rejected:
            pairs.append(
                {"row": row, "prompt": candidate["query_text"], "chosen": texts[chosen], "rejected": texts[rejected]}
            )
    return pairs


def read_judgements(path: str, flag: str = "--judgements") -> tuple[list[Judgement], dict[str, int]]:
    """The labels (not undone) and the skips per labeler of a judgements log, or of the log beside a label file."""
    if not path.endswith(JUDGEMENTS_SUFFIX) and os.path.isfile(judgements_path(path)):
        path = judgements_path(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{flag} '{path}' does not exist; pass the `<output>{JUDGEMENTS_SUFFIX}` that `serve --output` wrote."
        )
    records, _ = read_log(path)
    if not records or records[0].get("event") != "start":
        raise ValueError(f"{flag} '{path}' is not a judgements log written by `label_generation.py serve`.")
    state = JudgementState()
    for record in records:
        state.apply(record)
    return state.judgements(), state.skips()
