"""Text preference pairs (prompt/chosen/rejected): best_of_2 labels for train_reward.py, and convert to OAI's schema
and back."""

import json
import time

import pytest
import torch

import label_generation
import train_reward
from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.labels import OAI_PAD_TOKEN, read_label_rows
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.text_prefs import load_labels_or_pairs, read_text_pairs, tokenize_pairs
from tests.planted import books_task, write_query_file

QUERY_LENGTH, RESPONSE_LENGTH = 16, 8
HAPPY = [" I am happy.", " So happy and glad.", " A happy day."]
SAD = [" I am sad.", " So sad and down.", " A sad day."]


def write_pairs(path, n: int, corpus_lines: list[str]) -> list[dict]:
    """`n` pairs on the corpus's first sentences: the chosen response says ' happy', the rejected one ' sad'."""
    pairs = [
        {
            "prompt": corpus_lines[i % len(corpus_lines)].split(".")[0] + ".",
            "chosen": HAPPY[i % 3],
            "rejected": SAD[(i + 1) % 3],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return pairs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = write_query_file(tmp_path_factory.mktemp("text-prefs") / "queries.txt", n=64)
    return path


def test_pairs_tokenize_like_oai_label_rows_chosen_first(tokenizer):
    pad = tokenizer.pad_token_id
    long_prompt = " one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen x"
    pairs = [
        {"prompt": "Hello world", "chosen": " good", "rejected": " bad bad bad bad bad bad bad bad bad bad"},
        {"prompt": long_prompt, "chosen": " <|endoftext|>", "rejected": ""},
    ]
    rows, truncated = tokenize_pairs(pairs, tokenizer, QUERY_LENGTH, RESPONSE_LENGTH, pad)
    hello = tokenizer.encode("Hello world")
    assert rows[0]["query"] == hello + [pad] * (QUERY_LENGTH - len(hello))  # right-padded (G3)
    assert rows[1]["query"] == tokenizer.encode(long_prompt)[:QUERY_LENGTH]  # first tokens kept
    assert rows[0]["sample0"] == tokenizer.encode(" good") + [pad] * (RESPONSE_LENGTH - 1)  # chosen is sample0
    assert rows[0]["sample1"] == tokenizer.encode(" bad" * 10)[:RESPONSE_LENGTH]
    assert rows[1]["sample0"][:3] != [tokenizer.eos_token_id] + [pad] * 2  # special-token text is plain text (G1)
    assert rows[1]["sample1"] == [pad] * RESPONSE_LENGTH and all(row["best"] == 0 for row in rows)
    assert truncated == {"truncated_queries": 1, "truncated_samples": 1}


def test_pairs_of_responses_that_end_at_eos_end_with_the_eos_token(tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    pairs = [{"prompt": "Hello world", "chosen": " good", "rejected": " bad bad bad bad bad bad bad bad bad bad"}]
    rows, truncated = tokenize_pairs(pairs, tokenizer, QUERY_LENGTH, RESPONSE_LENGTH, pad, eos_id=eos)
    assert rows[0]["sample0"] == tokenizer.encode(" good") + [eos] + [pad] * (RESPONSE_LENGTH - 2)  # nplus N3
    assert rows[0]["sample1"] == tokenizer.encode(" bad" * 10)[: RESPONSE_LENGTH - 1] + [eos]  # cut, EOS kept
    assert truncated["truncated_samples"] == 1


def test_load_labels_reads_pairs_as_best_of_2_and_refuses_other_types(tmp_path, tokenizer, corpus):
    pairs = write_pairs(tmp_path / "prefs.jsonl", 6, corpus.read_text().splitlines())
    source = str(tmp_path / "prefs.jsonl")
    labels = load_labels_or_pairs(source, QUERY_LENGTH, RESPONSE_LENGTH, -1, 4, "best_of_2", tokenizer)
    assert labels.samples.shape == (6, 2, RESPONSE_LENGTH) and labels.label.tolist() == [0] * 6
    assert tokenizer.decode([t for t in labels.samples[1, 0].tolist() if t != -1]) == pairs[1]["chosen"]
    assert tokenizer.decode([t for t in labels.samples[1, 1].tolist() if t != -1]) == pairs[1]["rejected"]
    assert labels.query[0, -1] == -1  # the query is padded with the run's PAD
    with pytest.raises(ValueError, match=r"holds text preference pairs.*not best_of_4; pass --labels.type best_of_2"):
        load_labels_or_pairs(source, QUERY_LENGTH, RESPONSE_LENGTH, -1, 4, "best_of_4", tokenizer)
    with pytest.raises(ValueError, match="has 6 rows but num_train is 7"):
        load_labels_or_pairs(source, QUERY_LENGTH, RESPONSE_LENGTH, -1, 7, "best_of_2", tokenizer)


def test_dataset_directories_read_like_jsonl(tmp_path, corpus):
    import datasets

    pairs = write_pairs(tmp_path / "prefs.jsonl", 5, corpus.read_text().splitlines())
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "hub" / "data").mkdir(parents=True)  # a hub dataset as `hf download --local-dir` leaves it
    datasets.Dataset.from_list(pairs).to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    assert read_text_pairs(str(tmp_path / "ds")) == read_text_pairs(str(tmp_path / "prefs.jsonl")) == pairs
    assert read_text_pairs(str(tmp_path / "hub")) == pairs
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="'.*empty' is a directory without a dataset .*; expected a save_to_disk"):
        read_text_pairs(str(tmp_path / "empty"))


def test_a_hub_dataset_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(HubUnavailableError, match="could not fetch dataset 'someone/prefs'.*pass --label_dataset DIR"):
        read_text_pairs("someone/prefs")
    assert time.time() - start < 5


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_file_in_neither_schema_names_both_and_its_fields(tmp_path, suffix):
    path = tmp_path / f"other{suffix}"
    path.write_text(2 * (json.dumps({"question": "q", "answer": "a"}) + "\n"))
    with pytest.raises(ValueError) as error:
        load_labels_or_pairs(str(path), QUERY_LENGTH, RESPONSE_LENGTH, 0, 1, "best_of_2", object())
    message = str(error.value)
    assert "neither schema" in message and "['answer', 'question']" in message
    assert "prompt, chosen" in message and "OAI's label schema" in message and "\n" not in message
    path.write_text(json.dumps([{"question": [1], "answer": 0}]))  # a JSON list of other rows
    with pytest.raises(ValueError, match=r"OAI's label schemas.*text preference pairs.*\['answer', 'question'\]"):
        read_label_rows(str(path))


def test_text_pairs_convert_to_oai_schema_and_back_without_loss(tmp_path, tiny_model_dir, tokenizer, corpus):
    pairs = write_pairs(tmp_path / "prefs.jsonl", 8, corpus.read_text().splitlines())
    pairs[3]["prompt"] = 'Café "quoted" <|endoftext|> text'  # non-ASCII and special-token text survive
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    lengths = ["--task.query_length", str(QUERY_LENGTH), "--task.response_length", str(RESPONSE_LENGTH)]
    common = ["--base_model", tiny_model_dir, "--source_tokenizer", tiny_model_dir, *lengths]
    to_oai = ["convert", "--input", str(tmp_path / "prefs.jsonl"), "--output", str(tmp_path / "oai.json"), *common]
    meta = label_generation.main(label_generation.parse(to_oai))
    assert meta["label_type"] == "best_of_2" and meta["pad_id"] == OAI_PAD_TOKEN and meta["counts"]["rows"] == 8
    rows, label_type, file_pad = read_label_rows(str(tmp_path / "oai.json"))
    assert label_type.name == "best_of_2" and file_pad == OAI_PAD_TOKEN
    assert rows[0]["query"][-1] == OAI_PAD_TOKEN and all(row["best"] == 0 for row in rows)
    back = ["convert", "--input", str(tmp_path / "oai.json"), "--output", str(tmp_path / "back.jsonl"), *common]
    label_generation.main(label_generation.parse(back))
    lines = (tmp_path / "back.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == pairs


def test_a_text_preference_file_trains_a_reward_model(tmp_path, tiny_model_dir, corpus, one_thread):
    write_pairs(tmp_path / "prefs.jsonl", 48, corpus.read_text().splitlines())
    task = books_task(query_dataset=str(corpus), query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH)
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(tmp_path / "prefs.jsonl"),
        task=task,
        labels=train_reward.LabelHParams(type="best_of_2", num_train=32),
        batch_size=8,
        lr=3e-3,
        rollout_batch_size=16,
        normalize_samples=16,
        normalize_after=False,
    )
    args = with_run(args, output_dir=str(tmp_path / "rm"))
    result = train_reward.main(args)
    before, after = result["eval_before"], result["eval_after"]
    assert after["rows"] == 16 and after["loss"] < before["loss"] and after["accuracy"] > before["accuracy"]
    saved = json.loads((tmp_path / "rm" / "args.json").read_text())
    assert saved["label_dataset"].endswith("prefs.jsonl")
    assert torch.isfinite(torch.tensor(result["gain"]))
