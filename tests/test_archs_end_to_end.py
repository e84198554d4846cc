"""Each supported base-model family end to end, with its own tokenizer: label generation, reward and policy training
and evaluation with the public commands and the sentiment preset, then the saved artifacts in plain transformers.

GPT-2 runs through the same commands in test_pipeline.py, test_train_both.py and test_label_generation.py.
"""

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import label_generation
from demo import world as demo_world
from lm_human_preference_details.labels import OAI_PAD_TOKEN
from lm_human_preference_details.modeling import PolicyWithValueHead, load_reward_model, sample
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests import archs
from tests.planted import run_script
from tests.test_resume import scalars

pytestmark = pytest.mark.usefixtures("single_thread")

QUERY_LENGTH, RESPONSE_LENGTH, TRUNCATE_AFTER = 16, 8, 2
WORDS = [" happy", " sad", " lovely", " terrible", "."]
"""what the planted models sample, each about as often: one token in five is '.', the preset's truncation text"""
TASK_FLAGS = [
    *("--task", "sentiment", "--task.query_length", str(QUERY_LENGTH)),
    *("--task.response_length", str(RESPONSE_LENGTH), "--task.truncate_after", str(TRUNCATE_AFTER)),
]
"""the sentiment preset at tiny lengths: its start, end and truncation texts are resolved by each family's tokenizer"""
REWARD_CHECKPOINT = {"gpt_neox": "classifier", "llama": "trunk", "qwen2": "trunk"}
"""how each family's reward model is saved: a standard classifier where a final-norm bias can hold the reward's
constant term (GPT-NeoX's LayerNorm), else the trunk and the head (Llama's and Qwen2's RMSNorm have no bias)"""


def word_ids(tokenizer, words: list[str]) -> list[int]:
    """The single token id of each word (without special tokens)."""
    ids = [tokenizer.encode(word, add_special_tokens=False) for word in words]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def save_word_sampler(family: str, directory: str) -> str:
    """A tiny random model of the family that samples (nearly uniformly) only WORDS, whatever the input, and its
    tokenizer, written to `directory`: a --base_model whose responses pass the truncation filter and carry
    sentiment."""
    tokenizer = archs.family_tokenizer(family)
    model = archs.family_model(family, tokenizer)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        # residual dim 0 is a large constant, so after the final norm it is a constant > 0 (LayerNorm and RMSNorm
        # alike); the LM head's dim 0 is +2 for the words, -2 for every other token
        model.get_input_embeddings().weight[:, 0] = 100.0
        head = model.get_output_embeddings().weight
        head[:, 0] = -2.0
        head[word_ids(tokenizer, WORDS), 0] = 2.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def passes_filter_and_is_truncated(sample: list[int], truncate_id: int) -> bool:
    """`truncate_id` at index >= TRUNCATE_AFTER, only OAI's PAD after its first such occurrence, no PAD before."""
    cuts = [i for i, token in enumerate(sample) if token == truncate_id and i >= TRUNCATE_AFTER]
    if not cuts:
        return False
    return all(t == OAI_PAD_TOKEN for t in sample[cuts[0] + 1 :]) and OAI_PAD_TOKEN not in sample[: cuts[0] + 1]


def read_json(path) -> dict | list:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def all_finite(tree) -> bool:
    """True when every number in a JSON tree is finite."""
    if isinstance(tree, dict):
        return all(all_finite(v) for v in tree.values())
    if isinstance(tree, list):
        return all(all_finite(v) for v in tree)
    return not isinstance(tree, float) or math.isfinite(tree)


@pytest.fixture(scope="module")
def queries(tmp_path_factory) -> str:
    """The demo world's query file."""
    root = tmp_path_factory.mktemp("world")
    return demo_world.main(demo_world.Args(output_dir=str(root), num_pretrain=1, num_heldout=1))["queries"]


def added_bos(family: str, tokenizer) -> int | None:
    """The BOS id that the family's tokenizer adds in front of every text (Llama's), else None."""
    return tokenizer.bos_token_id if family == "llama" else None


def check_label_rows(rows: list[dict], meta: dict, tokenizer) -> None:
    """Rows in OAI's schema written with the family's tokenizer: QUERY_LENGTH queries (a BOS is no part of them) and
    responses cut after the family's own '.'."""
    period = word_ids(tokenizer, ["."])[0]
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert (meta["task"]["truncate_text"], meta["task"]["truncate_token"]) == (".", period)  # the preset's, resolved
    assert all(len(row["query"]) == QUERY_LENGTH and row["query"][0] != tokenizer.bos_token_id for row in rows)
    assert all(passes_filter_and_is_truncated(row[f"sample{i}"], period) for row in rows for i in range(4))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_neox", "llama", "qwen2"])
def test_family_runs_label_generation_training_and_evaluation(tmp_path, queries, family, monkeypatch):
    base = save_word_sampler(family, str(tmp_path / "base"))
    tokenizer = load_tokenizer(base)
    assert tokenizer.pad_token_id not in (tokenizer.eos_token_id, None)

    # 1. best-of-4 labels of the base model's samples, picked by VADER
    labels = tmp_path / "labels.json"
    run_script(
        "label_generation.py",
        "generate",
        *("--base_model", base, "--task.query_dataset", queries, *TASK_FLAGS, "--labeler", "vader"),
        *("--num_queries", "16", "--batch_size", "16", "--output", str(labels)),
    )
    check_label_rows(read_json(labels), read_json(f"{labels}.meta.json"), tokenizer)

    # 2. the reward model on them, then 2 PPO updates against it
    run = tmp_path / "run"
    run_script(
        "train_both.py",
        *("--base_model", base, "--task.query_dataset", queries, *TASK_FLAGS, "--label_dataset", str(labels)),
        *("--labels.num_train", "16", "--batch_size", "8", "--lr", "1e-3"),
        *("--rollout_batch_size", "8", "--normalize_samples", "8"),
        *("--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--ppo.lr", "1e-3", "--ppo.noptepochs", "1"),
        *("--ppo.whiten_group_size", "0", "--output_dir", str(run)),
    )
    reward_dir, policy_dir = str(run / "reward_model"), str(run / "policy")
    reward_meta = read_json(os.path.join(reward_dir, "reward_model.json"))
    assert reward_meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert reward_meta["pad_token_id"] == tokenizer.pad_token_id and all_finite(reward_meta)
    assert reward_meta["checkpoint"] == REWARD_CHECKPOINT[family]
    assert reward_meta["task"]["truncate_token"] == word_ids(tokenizer, ["."])[0]
    assert reward_meta["bos_token_id"] == added_bos(family, tokenizer)  # the reward model reads BOS ⊕ query ⊕ response
    policy_metrics = scalars(policy_dir)
    assert len(policy_metrics["objective/kl"]) == 2 and all_finite([v for s in policy_metrics.values() for _, v in s])

    # 3. evaluation of the policy against its base model, by its reward model and VADER
    run_script("evaluate.py", "--policy", policy_dir, "--gold", "vader", "--num_queries", "8", "--batch_size", "8")
    results = read_json(os.path.join(policy_dir, "eval", "results.json"))
    assert (results["base_model"], results["reward_model"]) == (base, reward_dir)
    assert set(results["metrics"]) >= {"score", "gold_score", "kl"} and all_finite(results["metrics"])

    # 4. label generation samples the saved policy, from contexts that start with the family's BOS where its tokenizer
    # adds one, and labels with the saved reward model (generate), or leaves the rows unlabelled (sample)
    contexts = []

    def recording_sample(policy, batch_contexts, *args, **kwargs):
        contexts.append(batch_contexts)
        return sample(policy, batch_contexts, *args, **kwargs)

    monkeypatch.setattr(label_generation, "sample", recording_sample)
    more = tmp_path / "more.json"
    label_generation.main(
        label_generation.parse(
            ["generate", "--base_model", policy_dir, "--task.query_dataset", queries, *TASK_FLAGS]
            + ["--labeler", f"reward_model:{reward_dir}", "--num_queries", "4", "--batch_size", "4"]
            + ["--output", str(more)]
        )
    )
    check_label_rows(read_json(more), read_json(f"{more}.meta.json"), tokenizer)
    candidates = label_generation.main(
        label_generation.parse(
            ["sample", "--base_model", policy_dir, "--task.query_dataset", queries, *TASK_FLAGS]
            + ["--num_queries", "2", "--batch_size", "2", "--output", str(tmp_path / "candidates.json")]
        )
    )  # the unlabelled rows that people label in their browsers
    assert candidates["counts"]["rows"] == 2 and candidates["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    first_tokens = set(torch.cat(contexts)[:, 0].tolist())
    if family == "llama":
        assert first_tokens == {tokenizer.bos_token_id}
    else:
        assert tokenizer.bos_token_id not in first_tokens

    # 5. the saved artifacts in plain transformers
    check_plain_transformers(policy_dir, reward_dir, family)


def check_plain_transformers(policy_dir: str, reward_dir: str, family: str) -> None:
    """The policy batch-generates with AutoModelForCausalLM; the reward model is a standard classifier giving the
    project's reward where the family allows it, else the standard loader refuses it."""
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    inputs = tok(["Sadly, the cat", "Luckily, the old man and the dog were"], padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and int((inputs["attention_mask"] == 0).sum()) > 0
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape == (2, inputs["input_ids"].shape[1] + 3)
    PolicyWithValueHead.load(policy_dir)  # and with the project's loader, value head included
    project, _ = load_reward_model(reward_dir)
    if REWARD_CHECKPOINT[family] == "trunk":
        with pytest.raises((OSError, ValueError)):
            AutoModelForSequenceClassification.from_pretrained(reward_dir)
        return
    classifier, info = AutoModelForSequenceClassification.from_pretrained(reward_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(reward_dir)
    inputs = tok(["Sadly, the cat felt sad.", "Luckily, the dog"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = project(inputs["input_ids"], tok.pad_token_id)
        # the same sums in another order: float32 rounding of the folded constant (the planted trunk's states are large)
        torch.testing.assert_close(classifier.eval()(**inputs).logits[:, 0], expected, atol=1e-4, rtol=1e-4)
