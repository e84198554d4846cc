"""labels.py: label types, reading and validating label files in OAI's schema, writing them (spec G1, R7)."""

import errno
import json
import time

import numpy as np
import pytest
import torch

from lm_human_preference_details import validation
from lm_human_preference_details.labels import OAI_PAD_TOKEN, get_label_type, load_labels, read_label_rows, save_labels
from tests.test_validation import tree

PAD = 50257


# ---------------------------------------------------------------- label types


@pytest.mark.parametrize("name", ["best_of_1", "best_of_x", "scalar", "pairwise"])
def test_unknown_label_type_names_the_valid_ones(name):
    with pytest.raises(ValueError, match="best_of_N .* scalar_rating or scalar_compare"):
        get_label_type(name)


# ---------------------------------------------------------------- reading and writing label files


def _label_rows(n: int = 3, query_length: int = 4, response_length: int = 3) -> list[dict]:
    """Label rows in OAI's schema, padded with OAI's PAD 50259."""
    rows = []
    for i in range(n):
        row = {"query": [100 + i, 200 + i] + [OAI_PAD_TOKEN] * (query_length - 2)}
        for s in range(4):
            row[f"sample{s}"] = [10 * i + s] + [OAI_PAD_TOKEN] * (response_length - 1)
        row["best"] = i % 4
        rows.append(row)
    return rows


def _write(path, rows) -> str:
    path.write_text(json.dumps(rows), encoding="utf-8")
    return str(path)


def test_load_labels_maps_oai_pad(tmp_path):
    labels = load_labels(_write(tmp_path / "l.json", _label_rows()), 4, 3, pad_id=PAD, num_train=2)
    assert len(labels) == 3
    assert labels.query.shape == (3, 4) and labels.samples.shape == (3, 4, 3) and labels.label.shape == (3,)
    assert labels.query.dtype == labels.samples.dtype == labels.label.dtype == torch.long
    assert labels.query[1].tolist() == [101, 201, PAD, PAD]
    assert labels.samples[2, 3].tolist() == [23, PAD, PAD]
    assert labels.label.tolist() == [0, 1, 2]
    assert not (labels.query == OAI_PAD_TOKEN).any() and not (labels.samples == OAI_PAD_TOKEN).any()


def _break(field, value):
    """Row 1 of the standard label rows with `field` set to `value` (or removed when value is ...)."""
    rows = _label_rows()
    if value is ...:
        del rows[1][field]
    else:
        rows[1][field] = value
    return rows


@pytest.mark.parametrize(
    "rows, pattern",
    [
        (_break("sample2", ...), "row 1 .*'sample2'"),
        (_break("query", [1, 2, 3]), "row 1 .*'query'.*length 3"),
        (_break("sample0", "abc"), "row 1 .*'sample0'"),
        (_break("sample1", [1, 1.5, 2]), "row 1 .*'sample1'.*1.5"),
        (_break("query", [1, "x", 2, 3]), "row 1 .*'query'.*'x'"),
        (_break("query", [1, -4, 2, 3]), "row 1 .*'query'.*-4"),
        (_break("sample3", [1, None, 2]), "row 1 .*'sample3'.*None"),
        (_break("best", 4), "row 1 .*'best'"),
        (_break("best", "1"), "row 1 .*'best'"),
        (_break("best", True), "row 1 .*'best'"),
        (_break("query", [OAI_PAD_TOKEN, 1, 2, 3]), "row 1 .*'query'.*PAD"),
        ([*_label_rows(1), [1, 2]], "row 1 .*list"),
        ({"query": [1]}, "JSON list"),
    ],
)
def test_load_labels_malformed_rows_name_row_and_field(tmp_path, rows, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_labels(_write(tmp_path / "l.json", rows), 4, 3, pad_id=PAD, num_train=1)


def _scalar_rows(kind: str) -> list[dict]:
    """Three rows of OAI's scalar_rating (query, sample, score) or scalar_compare (query, sample0/1, difference)."""
    rows = []
    for i, row in enumerate(_label_rows()):
        if kind == "scalar_rating":
            rows.append({"query": row["query"], "sample": row["sample1"], "score": [0.5, -2, 1.25][i]})
        else:
            rows.append({"query": row["query"], "sample0": row["sample0"], "sample1": row["sample2"]})
            rows[-1]["difference"] = [1.5, 0, -3][i]
    return rows


@pytest.mark.parametrize("kind", ["scalar_rating", "scalar_compare"])
def test_load_and_save_scalar_label_types(tmp_path, kind):
    # OAI label_types.py#L58-L109: one sample and a float score, or two samples and a float difference
    path = _write(tmp_path / "l.json", _scalar_rows(kind))
    labels = load_labels(path, 4, 3, pad_id=PAD, num_train=3, label_type=kind)
    num_samples = 1 if kind == "scalar_rating" else 2
    assert labels.samples.shape == (3, num_samples, 3) and labels.label.dtype == torch.float32
    expected = [0.5, -2.0, 1.25] if kind == "scalar_rating" else [1.5, 0.0, -3.0]
    assert labels.label.tolist() == expected
    assert labels.samples[0, -1].tolist() == [2 if kind == "scalar_compare" else 1, PAD, PAD]
    rows, label_type, _ = read_label_rows(path)
    assert label_type.name == kind and len(rows) == 3
    copy = str(tmp_path / "copy.json")
    save_labels(copy, rows)
    assert json.loads(open(copy).read()) == _scalar_rows(kind)


@pytest.mark.parametrize(
    "kind, field, value, pattern",
    [
        ("scalar_rating", "score", "1.0", "row 1 field 'score'.*finite number"),
        ("scalar_rating", "score", float("nan"), "row 1 field 'score'"),
        ("scalar_compare", "difference", True, "row 1 field 'difference'"),
        ("scalar_compare", "sample1", [1, 2], "row 1 field 'sample1' has length 2"),
    ],
)
def test_load_scalar_labels_malformed_rows_name_row_and_field(tmp_path, kind, field, value, pattern):
    rows = _scalar_rows(kind)
    rows[1][field] = value
    with pytest.raises(ValueError, match=pattern):
        load_labels(_write(tmp_path / "l.json", rows), 4, 3, pad_id=PAD, num_train=1, label_type=kind)


def test_load_labels_of_another_type_names_the_flag(tmp_path):
    path = _write(tmp_path / "l.json", _scalar_rows("scalar_rating"))
    with pytest.raises(ValueError, match="holds scalar_rating labels.*--labels.type scalar_rating"):
        load_labels(path, 4, 3, pad_id=PAD, num_train=1)
    with pytest.raises(ValueError, match="holds best_of_4 labels.*--labels.type best_of_4"):
        load_labels(_write(tmp_path / "b.json", _label_rows()), 4, 3, PAD, 1, label_type="scalar_compare")


def test_load_labels_needs_num_train_rows(tmp_path):
    with pytest.raises(ValueError, match="3 rows but num_train is 4"):
        load_labels(_write(tmp_path / "l.json", _label_rows()), 4, 3, pad_id=PAD, num_train=4)


def test_load_labels_missing_local_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_labels(str(tmp_path / "missing.json"), 4, 3, pad_id=PAD, num_train=1)


def test_save_labels_round_trip_writes_oai_pad(tmp_path):
    rows = [
        {
            "query": torch.tensor([5, 6, PAD, PAD]),
            **{f"sample{s}": [s, PAD, PAD] for s in range(4)},
            "best": np.int64(2),
        },
        {"query": [7, 8, 9, PAD], **{f"sample{s}": [s + 4, s, PAD] for s in range(4)}, "best": 0},
    ]
    path = str(tmp_path / "out" / "labels.json")
    save_labels(path, rows, pad_id=PAD)
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    assert raw[0]["query"] == [5, 6, OAI_PAD_TOKEN, OAI_PAD_TOKEN] and raw[0]["best"] == 2
    assert sorted(raw[0]) == ["best", "query", "sample0", "sample1", "sample2", "sample3"]
    labels = load_labels(path, 4, 3, pad_id=PAD, num_train=2)
    assert labels.query.tolist() == [[5, 6, PAD, PAD], [7, 8, 9, PAD]]
    assert labels.samples[1, 2].tolist() == [6, 2, PAD]
    assert labels.label.tolist() == [2, 0]


def test_save_labels_rejects_malformed_rows(tmp_path):
    rows = _label_rows()
    rows[2]["sample0"] = [1]
    with pytest.raises(ValueError, match="row 2 .*'sample0'"):
        save_labels(str(tmp_path / "l.json"), rows)


def test_load_labels_oai_sized_file_is_fast(tmp_path):
    rng = np.random.RandomState(0)
    rows = [
        {
            "query": rng.randint(0, 50257, 64).tolist(),
            **{f"sample{s}": rng.randint(0, 50257, 24).tolist() for s in range(4)},
            "best": int(rng.randint(4)),
        }
        for _ in range(4992)
    ]
    path = _write(tmp_path / "big.json", rows)
    start = time.perf_counter()
    labels = load_labels(path, 64, 24, pad_id=PAD, num_train=4992)
    assert time.perf_counter() - start < 2
    assert labels.samples.shape == (4992, 4, 24)
    assert labels.query[4991].tolist() == rows[4991]["query"]


# ---------------------------------------------------------------- one clear error for a file that is not a label file


def test_json_lines_preference_pairs_name_the_expected_schema(tmp_path):
    pairs = [{"prompt": "Hi", "chosen": " there", "rejected": " go"}, {"prompt": "A", "chosen": "b", "rejected": "c"}]
    (tmp_path / "pairs.jsonl").write_text("\n".join(map(json.dumps, pairs)) + "\n")
    with pytest.raises(ValueError) as error:
        load_labels(str(tmp_path / "pairs.jsonl"), 16, 8, pad_id=50257, num_train=1)
    message = str(error.value)
    assert "JSON Lines of text preference pairs (prompt, chosen, rejected" in message and "Extra data" not in message
    assert '"sample0": [ids]' in message and "--labels.type best_of_2" in message
    # the fix: one best_of_2 row per pair, tokens padded to the lengths, loads
    row = {"query": [1] * 16, "sample0": [2] * 8, "sample1": [3] * 8, "best": 0}
    (tmp_path / "pairs.json").write_text(json.dumps([row]))
    assert len(load_labels(str(tmp_path / "pairs.json"), 16, 8, 50257, 1, "best_of_2")) == 1


@pytest.mark.parametrize(
    "content, words",
    [("", "invalid JSON"), ('[{"query": [1, 2', "invalid JSON"), ("[]", "0 rows but num_train is 1")],
)
def test_label_file_empty_or_truncated_names_the_file(tmp_path, content, words):
    (tmp_path / "l.json").write_text(content)
    with pytest.raises(ValueError, match=words):
        load_labels(str(tmp_path / "l.json"), 4, 3, pad_id=50257, num_train=1)


# ---------------------------------------------------------------- writing is atomic


def test_disk_full_while_writing_labels_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "labels.json"
    rows = [{"query": [1, 2], "sample0": [3], "sample1": [4], "best": 0}]
    save_labels(str(path), rows)
    before = tree(tmp_path)

    def full_disk(obj, f, *a, **k):
        f.write("[{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(validation.OutputError, match="disk full"):
        save_labels(str(path), [{**rows[0], "best": 1}])
    assert tree(tmp_path) == before
