"""GPT-2 tokenizer with a distinct PAD: spec TV1 and reloading from a saved directory."""

import torch

from lm_human_preference_details.tokenizer import load_tokenizer

TV1_TEXTS = ["usually, he would", "she thought about it"]
TV1_IDS = [[23073, 11, 339, 561, 50257], [7091, 1807, 546, 340, 50257]]
TV1_MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]


def test_tokenizer_tv1_encodes_and_right_pads(tokenizer):
    assert tokenizer(TV1_TEXTS[0])["input_ids"] == [23073, 11, 339, 561]
    assert tokenizer(TV1_TEXTS[1])["input_ids"] == [7091, 1807, 546, 340]
    batch = tokenizer(TV1_TEXTS, padding="max_length", max_length=5, truncation=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == TV1_IDS
    assert batch["attention_mask"].tolist() == TV1_MASK


def test_tokenizer_tv1_truncates_to_query_length(tokenizer):
    batch = tokenizer(TV1_TEXTS, padding="max_length", max_length=3, truncation=True)
    assert batch["input_ids"] == [[23073, 11, 339], [7091, 1807, 546]]


def test_tokenizer_pad_is_distinct_from_eos(tokenizer):
    assert tokenizer.pad_token_id == 50257
    assert tokenizer.eos_token_id == 50256
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.padding_side == "right"


def test_load_tokenizer_reloads_saved_pad(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.pad_token_id == 50257
    assert reloaded.padding_side == "right"
    batch = reloaded(TV1_TEXTS, padding="max_length", max_length=5, return_tensors="pt")
    assert torch.equal(batch["input_ids"], torch.tensor(TV1_IDS))


def test_load_tokenizer_replaces_eos_padding(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    eos_padded = load_tokenizer(str(tmp_path))
    eos_padded.pad_token = eos_padded.eos_token
    eos_padded.save_pretrained(tmp_path)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.pad_token_id != reloaded.eos_token_id
    assert reloaded.pad_token_id == 50257
