"""Saved policies and reward models load with plain transformers and give the project's numbers."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from lm_human_preference_details.kernels import logprobs_from_logits
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    RewardScorer,
    load_causal_lm,
    load_reward_model,
)
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests import archs

PAD, EOS = 50257, 50256
PROMPTS = ["Hello", "The old man walked slowly down the road", "She opened the window and"]
SPARE_ROWS = 40
POLICY_FAMILIES = [*archs.FAMILIES, "gpt_neox+rows", "qwen2+rows"]
"""the stand-ins, and two whose embedding has a row for the project's PAD"""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> the directory of a tiny random base model of the family with its own tokenizer (tests/archs.py),
    written on first use; FAMILY+rows: with SPARE_ROWS embedding rows beyond the tokenizer, so that the project's PAD
    has one (as in Pythia's and Qwen2's checkpoints)."""
    root, dirs = tmp_path_factory.mktemp("families"), {}

    def base_dir(name: str) -> str:
        if name not in dirs:
            family, _, rows = name.partition("+")
            tokenizer = archs.family_tokenizer(family)
            model = archs.family_model(family, tokenizer)
            if rows:
                model.resize_token_embeddings(len(tokenizer) + SPARE_ROWS, mean_resizing=False)
            model.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            dirs[name] = str(root / name)
        return dirs[name]

    return base_dir


@pytest.fixture(scope="module")
def family_policy_dirs(tmp_path_factory, family_dirs, tiny_model_dir, policy_dir):
    """family -> (base model directory, the policy saved as train_policy.py saves it): GPT-2 with its real tokenizer
    (`policy_dir`), the other families with their stand-ins."""
    saved = {"gpt2": (tiny_model_dir, policy_dir)}

    def policy_dirs(family: str) -> tuple[str, str]:
        if family not in saved:
            base, path = family_dirs(family), str(tmp_path_factory.mktemp(f"policy-{family}"))
            PolicyWithValueHead(load_causal_lm(base)).save(path, load_tokenizer(base))
            saved[family] = base, path
        return saved[family]

    return policy_dirs


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, tiny_model_dir, tokenizer):
    """A policy saved as train_policy.py saves it (project loader, random value head)."""
    policy = PolicyWithValueHead(load_causal_lm(tiny_model_dir))
    torch.manual_seed(3)
    with torch.no_grad():
        policy.value_head.weight.normal_()
        policy.value_head.bias.fill_(0.2)
    path = tmp_path_factory.mktemp("policy")
    policy.save(str(path), tokenizer)
    return str(path)


def generation_pad(base_dir: str) -> int:
    """The PAD of a saved policy's tokenizer: the project's PAD where the embedding has a row for it, else EOS."""
    tokenizer = load_tokenizer(base_dir)
    has_row = tokenizer.pad_token_id < load_causal_lm(base_dir).get_input_embeddings().num_embeddings
    return tokenizer.pad_token_id if has_row else tokenizer.eos_token_id


@pytest.mark.parametrize("family", POLICY_FAMILIES)
def test_saved_policy_generates_padded_batches_with_plain_transformers(family_policy_dirs, family):
    base_dir, policy_dir = family_policy_dirs(family)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    assert len(tok) <= model.get_input_embeddings().num_embeddings  # every token id has an embedding row
    pad = generation_pad(base_dir)
    assert (tok.pad_token_id, tok.padding_side, model.generation_config.pad_token_id) == (pad, "left", pad)
    inputs = tok(PROMPTS, padding=True, return_tensors="pt")
    assert int((inputs["attention_mask"] == 0).sum()) > 0  # the batch is padded
    first_real = inputs["input_ids"].gather(1, inputs["attention_mask"].argmax(1, keepdim=True))[:, 0]
    # a tokenizer that adds BOS (Llama) still adds it, after the left padding
    adds_bos = tok.bos_token_id is not None and bool((first_real == tok.bos_token_id).all())
    assert adds_bos == family.startswith("llama")
    kwargs = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    batched = model.generate(**inputs, **kwargs)
    # each row continues exactly as its prompt alone would: same tokens and same next-token logits
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(**tok([prompt], return_tensors="pt"), **kwargs)
        assert batched.sequences[row, -5:].tolist() == alone.sequences[0, -5:].tolist()
        for step_batched, step_alone in zip(batched.scores, alone.scores):
            torch.testing.assert_close(step_batched[row], step_alone[0], atol=1e-4, rtol=0)


def test_saved_policy_logprobs_match_project_forward(policy_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    policy = PolicyWithValueHead.load(policy_dir)
    tokens = tokenizer(["The old man walked slowly down the road", "Rain hammered on the roof all night long"])
    length = min(len(ids) for ids in tokens["input_ids"])
    tokens = torch.tensor([ids[:length] for ids in tokens["input_ids"]])  # (2, T), no PAD
    context_length, temperature = 3, 0.7
    with torch.no_grad():
        logits = model(tokens).logits[:, context_length - 1 : -1] / temperature
        project_logits, values = policy(tokens, context_length, PAD, temperature)
    # log-softmax over 50257 logits in float64 on both sides: float32 sums round differently with the thread count
    expected = torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, context_length:, None])[..., 0]
    logprobs = logprobs_from_logits(project_logits.double(), tokens[:, context_length:])
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
    assert policy.value_head.bias.item() == pytest.approx(0.2) and values.abs().sum() > 0


@pytest.mark.parametrize("family", POLICY_FAMILIES)
def test_saved_policy_tokenizer_gives_back_the_project_tokenizer(family_policy_dirs, family):
    base_dir, policy_dir = family_policy_dirs(family)
    base, reloaded = load_tokenizer(base_dir), load_tokenizer(policy_dir)
    assert (reloaded.pad_token_id, reloaded.padding_side) == (base.pad_token_id, "right")
    assert reloaded.pad_token_id not in (reloaded.eos_token_id, None)
    # reward models record the base tokenizer's fingerprint: a policy directory matches it
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(base)
    tok, pad = AutoTokenizer.from_pretrained(policy_dir), generation_pad(base_dir)
    assert (tok.pad_token_id, tok.padding_side) == (pad, "left")
    with open(os.path.join(policy_dir, "generation_config.json"), encoding="utf-8") as f:
        assert json.load(f)["pad_token_id"] == pad


# ---------------------------------------------------------------- reward model


def trained_looking_reward_model(model_dir: str) -> RewardModel:
    """A reward model with a non-trivial gain, bias and head bias, as after training and normalization."""
    torch.manual_seed(0)
    model = RewardModel.from_base(model_dir)
    with torch.no_grad():
        model.gain.fill_(1.7)
        model.bias.fill_(-0.6)
        model.head.bias.fill_(0.3)
    return model


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, tiny_model_dir, tokenizer):
    """A reward model saved as train_reward.py saves it (tokenizer beside it), and the model itself."""
    model = trained_looking_reward_model(tiny_model_dir)
    path = str(tmp_path_factory.mktemp("reward"))
    metadata = {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": PAD,
        "task": {"query_length": 6, "response_length": 4},
    }
    model.save(path, metadata)
    tokenizer.save_pretrained(path)
    return path, model


def unpadded_rewards(model: RewardModel, rows: list[list[int]], pad_id: int = PAD) -> torch.Tensor:
    """The reward of each token row on its own (no padding anywhere)."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([row]), pad_id) for row in rows])


@pytest.fixture(scope="module")
def family_reward_dirs(tmp_path_factory, family_dirs, reward_dir):
    """family -> (the reward model saved as train_reward.py saves it, the model): GPT-2 with its real tokenizer
    (`reward_dir`), the other families with their stand-ins."""
    saved = {"gpt2": reward_dir}

    def reward_dirs(family: str) -> tuple[str, RewardModel]:
        if family not in saved:
            base, path = family_dirs(family), str(tmp_path_factory.mktemp(f"reward-{family}"))
            model, tokenizer = trained_looking_reward_model(base), load_tokenizer(base)
            model.save(
                path,
                {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "pad_token_id": tokenizer.pad_token_id},
            )
            tokenizer.save_pretrained(path)
            saved[family] = path, model
        return saved[family]

    return reward_dirs


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "gpt_neox+rows"])
def test_reward_model_loads_with_standard_classifier_and_gives_project_scores(family_reward_dirs, family):
    path, model = family_reward_dirs(family)
    classifier, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]  # no random head
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id
    assert pad not in (tok.eos_token_id, None) and tok.padding_side == "right"
    texts = ["Hello world", f"The quick brown fox jumps over the dog{tok.eos_token}", "One"]  # EOS is a real token
    inputs = tok(texts, padding=True, return_tensors="pt")
    assert int((inputs["input_ids"] == pad).sum()) > 0
    with torch.no_grad():
        scores = classifier.eval()(**inputs).logits[:, 0]
    expected = unpadded_rewards(model, tok(texts)["input_ids"], pad)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    loaded, metadata = load_reward_model(path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(inputs["input_ids"], pad), expected, atol=1e-5, rtol=0)
    assert metadata["checkpoint"] == "classifier"
    assert (metadata["gain"], metadata["bias"]) == (pytest.approx(1.7), pytest.approx(-0.6))


def test_reward_scorer_scores_raw_text_with_the_task_lengths(reward_dir, tokenizer):
    path, model = reward_dir
    queries = ["Hello", "The quick brown fox jumps over the lazy dog", "Rain"]
    responses = [" world", " and runs away", " fell on the roof all night long"]
    scores = RewardScorer.from_pretrained(path)(queries, responses)
    # query cut to query_length 6, response to response_length 4, each tokenized on its own
    rows = [tokenizer.encode(q)[:6] + tokenizer.encode(r)[:4] for q, r in zip(queries, responses)]
    torch.testing.assert_close(scores, unpadded_rewards(model, rows), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="empty"):
        RewardScorer.from_pretrained(path)([""], ["text"])


@pytest.mark.parametrize("case", ["llama", "qwen2", "zero_head"])
def test_reward_model_without_classifier_export_fails_standard_loader_loudly(tmp_path, tiny_lm, family_dirs, case):
    # Llama and Qwen2 end in an RMSNorm without bias, and their classifiers' score layer has no bias either: no
    # weights of a standard classifier hold the reward's constant term
    if case == "zero_head":
        model, tokens, pad = RewardModel(tiny_lm.transformer), [[23073, 11, 339], [7091, 1807, 546, 340]], PAD
    else:
        tokenizer = load_tokenizer(family_dirs(case))
        model, pad = RewardModel.from_base(family_dirs(case)), tokenizer.pad_token_id
        tokens = tokenizer(["The cat walked home", "A dog"])["input_ids"]
    with torch.no_grad():
        model.gain.fill_(1.3)
        model.bias.fill_(0.4)
        if case == "zero_head":  # the constant cannot be folded along a zero score direction
            model.head.weight.zero_()
    model.save(str(tmp_path), {"pad_token_id": pad})
    with pytest.raises((OSError, ValueError)):
        AutoModelForSequenceClassification.from_pretrained(str(tmp_path))
    loaded, metadata = load_reward_model(str(tmp_path))
    assert metadata["checkpoint"] == "trunk"
    width = max(map(len, tokens))
    padded = torch.tensor([row + [pad] * (width - len(row)) for row in tokens])  # right-padded, as the scripts pad
    with torch.no_grad():
        assert torch.equal(loaded(padded, pad), model(padded, pad))
        torch.testing.assert_close(loaded(padded, pad), unpadded_rewards(model, tokens, pad), atol=1e-5, rtol=0)
