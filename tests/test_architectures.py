"""Tokenizer conventions of the supported architectures (BOS, PAD) and the architecture check, on the offline
stand-ins of tests/archs.py. The pads-invisible tests per architecture are in tests/test_modeling.py; special-token
text in data and the truncation token resolved by each tokenizer (tasks.py) in tests/test_tasks.py."""

import dataclasses
import json

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

import train_policy
import train_reward
from lm_human_preference_details.data import QueryStream
from lm_human_preference_details.labels import save_labels
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    _uses_4d_mask,
    check_model_dir,
    load_causal_lm,
    load_reward_model,
    sample,
    score_label_rows,
)
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.tasks import (
    TASKS,
    encode_context_affixes,
    encode_texts,
    format_contexts,
)
from lm_human_preference_details.tokenizer import added_bos_id, generation_tokenizer, load_tokenizer
from tests import archs
from tests.archs import BOS_TEXT


def test_added_bos_id_detects_the_post_processor_bos(family_dirs, tokenizer):
    # Llama 3 adds its BOS through a post-processor (no add_bos_token attribute); the others add none
    found = {family: added_bos_id(load_tokenizer(path)) for family, path in family_dirs.items()}
    llama = load_tokenizer(family_dirs["llama"])
    assert found == {"gpt2": None, "gpt_neox": None, "llama": llama.convert_tokens_to_ids(BOS_TEXT), "qwen2": None}
    assert added_bos_id(tokenizer) is None  # the real GPT-2 tokenizer


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_distinct_pad_for_every_family(family, family_dirs):
    # no PAD (gpt2, gpt_neox, llama) or PAD = EOS (qwen2): load_tokenizer adds "[PAD]", a new id after the vocabulary
    raw = archs.family_tokenizer(family)
    tokenizer = load_tokenizer(family_dirs[family])
    assert (raw.pad_token_id is None) == (family != "qwen2")
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == len(raw) == archs.VOCAB_SIZE
    assert tokenizer.pad_token_id != tokenizer.eos_token_id and tokenizer.eos_token_id == raw.eos_token_id
    assert tokenizer.padding_side == "right"
    assert tokenizer(["the cat", "the old man saw"], padding=True)["input_ids"][0][-1] == tokenizer.pad_token_id


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_generation_tokenizer_pad_inside_or_outside_the_embedding(family, family_dirs):
    # outside the embedding (the stand-ins' 600 rows): plain transformers pads with EOS; inside (a model whose
    # embedding has spare rows, as Qwen2's): the PAD stays, an id the model can embed
    tokenizer = load_tokenizer(family_dirs[family])
    pad_id = tokenizer.pad_token_id
    outside = generation_tokenizer(tokenizer, num_embeddings=pad_id)
    assert (outside.pad_token_id, outside.padding_side) == (tokenizer.eos_token_id, "left")
    assert "[PAD]" not in outside.get_vocab()
    inside = generation_tokenizer(tokenizer, num_embeddings=pad_id + 40)
    assert (inside.pad_token_id, inside.padding_side) == (pad_id, "left")
    assert added_bos_id(outside) == added_bos_id(inside) == added_bos_id(tokenizer)  # plain generate adds the BOS


def _llama_queries(tokenizer, task) -> torch.Tensor:
    """Two queries of the llama stand-in from texts that hold the literal BOS text."""
    texts = [f"The cat sat. {BOS_TEXT} the old man saw the river.", "A dog ran. the cat saw a dog."]
    return QueryStream(texts, tokenizer, task, 0, 1, 0).next_batch(2)


def test_policy_contexts_start_with_exactly_one_bos(family_dirs):
    tokenizer = load_tokenizer(family_dirs["llama"])
    bos = added_bos_id(tokenizer)
    task = dataclasses.replace(TASKS["sentiment"], query_length=12, query_prefix="Story: ", end_text=None)
    queries = _llama_queries(tokenizer, task)
    assert not (queries == bos).any()  # queries keep OAI's schema: no BOS inside
    prefix, suffix = encode_context_affixes(tokenizer, task)
    contexts = format_contexts(queries, prefix, suffix)
    assert (contexts[:, 0] == bos).all() and ((contexts == bos).sum(1) == 1).all()
    assert contexts[0, 1:].tolist()[: len(prefix) - 1] == encode_texts(tokenizer, ["Story: "])[0]
    policy = PolicyWithValueHead(load_causal_lm(family_dirs["llama"]))
    responses, _, _ = sample(policy, contexts, 3, 1.0, tokenizer.pad_token_id, torch.Generator().manual_seed(0))
    assert responses.shape == (2, 3)
    gpt_neox = load_tokenizer(family_dirs["gpt_neox"])
    assert encode_context_affixes(gpt_neox, task)[0] == encode_texts(gpt_neox, ["Story: "])[0]  # no BOS added


def test_reward_model_puts_one_bos_in_front(family_dirs, tmp_path):
    # the reward model's input is BOS ⊕ query ⊕ response: the forward adds it, for labels, scoring and evaluation alike
    tokenizer = load_tokenizer(family_dirs["llama"])
    bos, pad = added_bos_id(tokenizer), tokenizer.pad_token_id
    reward_model = RewardModel.from_base(family_dirs["llama"], bos_token_id=bos)
    plain = RewardModel(reward_model.trunk)
    plain.head.load_state_dict(reward_model.head.state_dict())
    queries = torch.tensor([[20, 21, pad], [22, 23, 24]])
    samples = torch.tensor([[[30, 31], [32, pad]], [[33, 34], [35, 36]]])  # (B, N, L)
    with torch.no_grad():
        rewards = score_label_rows(reward_model, queries, samples, pad)  # (B, N)
        expected = torch.stack(
            [plain(torch.cat([torch.full((2, 1), bos), queries, samples[:, i]], 1), pad) for i in range(2)], 1
        )
        twice = torch.stack(
            [reward_model(torch.cat([torch.full((2, 1), bos), queries, samples[:, i]], 1), pad) for i in range(2)], 1
        )
    torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=0)
    assert (rewards - twice).abs().min() > 1e-4  # a second BOS changes the reward
    reward_model.save(str(tmp_path), {"pad_token_id": pad})
    loaded, metadata = load_reward_model(str(tmp_path))
    assert metadata["bos_token_id"] == loaded.bos_token_id == bos
    with pytest.raises(ValueError, match=r"rows \[0\] start with the PAD"):
        reward_model(torch.tensor([[pad, 20, 21]]), pad)  # checked before the BOS goes in front


def test_reward_model_saved_without_bos_field_loads_without_bos(family_dirs, tmp_path):
    # reward models saved before BOS handling were trained without one: they are scored without one
    reward_model = RewardModel.from_base(family_dirs["gpt2"])
    reward_model.save(str(tmp_path), {"pad_token_id": archs.VOCAB_SIZE})
    metadata_path = tmp_path / "reward_model.json"
    metadata_path.write_text(metadata_path.read_text().replace('"bos_token_id": null,', ""))
    assert "bos_token_id" not in metadata_path.read_text()
    assert load_reward_model(str(tmp_path))[0].bos_token_id is None


def test_unsupported_architecture_is_refused_in_one_line(tmp_path):
    config = OPTConfig(hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2, vocab_size=64)
    config.word_embed_proj_dim = 16
    OPTForCausalLM(config).save_pretrained(tmp_path)
    match = r"'opt' model, an untested architecture; the supported model types are gpt2, gpt_neox, llama, qwen2"
    with pytest.raises(ValueError, match=match) as error:
        load_causal_lm(str(tmp_path))
    assert "--base_model" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ValueError, match=match):
        RewardModel.from_base(str(tmp_path))
    archs.family_tokenizer("gpt2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):  # the scripts' checks of their flags, before any model loads
        check_model_dir(str(tmp_path), "--base_model", tokenizer=True)


# ---------------------------------------------------------------- the truncation token, by text


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], (None, ".")),
        (["--task.truncate_token", "198"], (198, None)),  # an explicit id replaces the preset's text
        (["--task.truncate_token", "None"], (None, None)),  # no filter, as before the text form
        (["--task.truncate_text", "\n"], (None, "\n")),
        (["--task.truncate_token=13", "--task.truncate_text=."], (13, ".")),  # both: checked when resolved
    ],
)
def test_one_truncation_flag_unsets_the_others_preset_value(flags, expected):
    args = train_policy.parse(["--task", "sentiment", *flags])
    assert (args.task.truncate_token, args.task.truncate_text) == expected


def test_qwen2_sliding_window_layers_and_a_pad_inside_the_embedding(one_thread):
    # a Qwen2 with sliding-window layers takes the 2-D PAD mask (its window longer than the sequence), and its
    # embedding has spare rows (as Qwen2's checkpoints do), so the added PAD 600 is inside it: pads stay invisible,
    # PAD is never sampled, and the sampler's log-probs equal a full forward's
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2)
    window = dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=640, **sizes, **window)).eval()
    assert "sliding_attention" in lm.config.layer_types and not _uses_4d_mask(lm)
    policy = PolicyWithValueHead(lm)
    torch.nn.init.normal_(policy.value_head.weight)
    pad, ids = archs.VOCAB_SIZE, [40, 41, 42, 43, 44]
    with torch.no_grad():
        logits_pad, values_pad = policy(torch.tensor([ids[:2] + [pad, pad] + ids[2:]]), 4, pad, 0.7)
        logits_plain, values_plain = policy(torch.tensor([ids]), 2, pad, 0.7)
    torch.testing.assert_close(logits_pad, logits_plain, atol=4e-6, rtol=0)
    torch.testing.assert_close(values_pad, values_plain, atol=4e-6, rtol=0)
    assert (logits_pad[..., pad] == torch.finfo(torch.float32).min).all()
    contexts = torch.tensor([ids[:3] + [pad, pad], ids])
    responses, logprobs, _ = sample(policy, contexts, 6, 1.0, pad, torch.Generator().manual_seed(0))
    assert not (responses == pad).any()
    with torch.no_grad():
        logits, _ = policy(torch.cat([contexts, responses], 1), 5, pad, 1.0)
    expected = torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0]
    torch.testing.assert_close(logprobs, expected, atol=4e-6, rtol=0)


def test_train_reward_on_llama_records_its_bos_and_truncation_id(family_dirs, tmp_path, one_thread):
    # train_reward.py on the Llama stand-in: the reward model gets the tokenizer's BOS (recorded in reward_model.json,
    # so the policy run and evaluation score with it) and the saved task holds the resolved id of "." (15, not 13)
    base = family_dirs["llama"]
    tokenizer = load_tokenizer(base)
    corpus = tmp_path / "world.txt"
    corpus.write_text("\n".join(archs.world_text(60)))
    task = dataclasses.replace(TASKS["sentiment"], query_dataset=str(corpus), query_length=12, response_length=4)
    queries = QueryStream(archs.world_text(60), tokenizer, task, 0, 1, 0).next_batch(12).tolist()
    rng = torch.Generator().manual_seed(0)
    rows = [
        {"query": q, **{f"sample{j}": torch.randint(20, 500, (4,), generator=rng).tolist() for j in range(4)}}
        | {"best": i % 4}
        for i, q in enumerate(queries)
    ]
    labels = tmp_path / "labels.json"
    save_labels(str(labels), rows, pad_id=tokenizer.pad_token_id)  # OAI's schema: PAD written as 50259
    args = train_reward.Args(
        base_model=base,
        label_dataset=str(labels),
        task=task,
        labels=train_reward.LabelHParams(num_train=8),
        batch_size=4,
        rollout_batch_size=4,
        normalize_samples=4,
    )
    train_reward.main(with_run(args, output_dir=str(tmp_path / "reward")))
    metadata = json.loads((tmp_path / "reward" / "reward_model.json").read_text())
    assert metadata["bos_token_id"] == added_bos_id(tokenizer) == 0
    assert (metadata["task"]["truncate_text"], metadata["task"]["truncate_token"]) == (".", 15)
    saved_args = json.loads((tmp_path / "reward" / "args.json").read_text())
    assert saved_args["task"]["truncate_token"] == 15
