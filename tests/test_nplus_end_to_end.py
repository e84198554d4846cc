"""The successor recipe end to end on the Llama- and Qwen2-like stand-ins with their chat templates: SFT on chat rows,
a reward model from the SFT model, PPO with EOS-ended responses and a critic from the reward model, a reward model of
another tokenizer family as a standard sequence classifier, evaluation, and a kill + --resume auto that equals the
uninterrupted run. Also the stand-ins' instruct tokenizers and the demo world's supervised data that the runs use."""

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from demo import sft_data
from demo import world as demo_world
from lm_human_preference_details import checkpoint
from lm_human_preference_details.labels import OAI_PAD_TOKEN
from lm_human_preference_details.tokenizer import load_tokenizer
from tests import archs
from tests.planted import run_script
from tests.test_resume import (
    max_metric_difference,
    max_weight_difference,
    saved_files,
    scalars,
    script_command,
    start_and_kill,
)

pytestmark = pytest.mark.usefixtures("single_thread")

RESPONSE_LENGTH = 8
WORDS = [" happy", " sad", " lovely", " terrible", "."]
"""what the planted base models sample, with their EOS, each about as often: most responses end within 8 tokens"""
TASK_FLAGS = [
    *("--task.query_length", "48", "--task.response_length", str(RESPONSE_LENGTH), "--task.end_at_eos"),
    *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_text", "None"),
    *("--task.truncate_after", "0"),
]
"""the successor recipe's task at tiny lengths: a chat prompt as it is, a response that ends at its first EOS"""
POLICY_FILES = ("model.safetensors", "value_head.safetensors")
"""the saved policy (its critic, a token classifier, is compared as its own directory)"""


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_instruct_tokenizer_writes_the_family_chat_and_ends_a_turn_with_eos(family):
    plain, chat = archs.family_tokenizer(family), archs.family_tokenizer(family, chat=True)
    text = "Sadly, the cat felt sad."
    # the trained vocabulary and every id of a plain encoding are kept; the chat's tokens come after them
    assert chat.encode(text) == plain.encode(text) and len(chat) == len(plain) + len(archs.INSTRUCT_TOKENS[family][0])
    assert chat.eos_token == archs.INSTRUCT_TOKENS[family][1] and chat.eos_token_id >= len(plain)
    assert plain.chat_template is None and plain.eos_token != chat.eos_token
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "Luckily, the dog was happy."}]
    written = chat.apply_chat_template(messages, tokenize=False)
    expected = {
        "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSadly, the cat felt sad.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nLuckily, the dog was happy.<|eot_id|>",
        "qwen2": "<|im_start|>user\nSadly, the cat felt sad.<|im_end|>\n<|im_start|>assistant\nLuckily, the dog was "
        "happy.<|im_end|>\n",
    }[family]
    assert written == expected
    prompt = chat.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert written.startswith(prompt) and prompt.endswith(("<|end_header_id|>\n\n", "<|im_start|>assistant\n"))
    # the assistant's turn ends with EOS, one token: a response that ends at its first EOS ends the turn
    ids = chat.encode(written, add_special_tokens=False)
    assert ids.count(chat.eos_token_id) == 2 and chat.convert_ids_to_tokens(chat.eos_token_id) == chat.eos_token
    model = archs.family_model(family, chat)
    assert model.get_input_embeddings().weight.shape[0] == len(chat)
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(chat))


def test_world_sft_data_continues_a_first_sentence_with_the_second(tmp_path):
    world_dir = tmp_path / "world"
    demo_world.main(demo_world.Args(output_dir=str(world_dir), num_pretrain=30, num_queries=12, num_heldout=6))
    paths = sft_data.main(sft_data.Args(world_dir=str(world_dir), num_sft=20))
    rows = {name: [json.loads(line) for line in open(path, encoding="utf-8")] for name, path in paths.items()}
    assert [len(rows[name]) for name in ("sft", "sft_messages", "prompts", "heldout_prompts")] == [20, 20, 12, 6]
    passages = (world_dir / "pretrain.txt").read_text().splitlines()
    for passage, row, chat in zip(passages, rows["sft"], rows["sft_messages"]):
        assert passage.startswith(row["prompt"] + row["completion"] + " ")  # two whole sentences of the passage
        assert row["prompt"].count(".") == row["completion"].count(".") == 1 and row["completion"].endswith(".")
        assert chat["messages"] == [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"][1:]},
        ]
    heldout = (world_dir / "heldout.txt").read_text().splitlines()
    assert [row["prompt"] for row in rows["heldout_prompts"]] == [p[: p.index(".") + 1] for p in heldout]
    with pytest.raises(ValueError, match="--num_sft 31: pretrain.txt"):
        sft_data.main(sft_data.Args(world_dir=str(world_dir), num_sft=31))


def save_eos_sampler(family: str, directory: str) -> str:
    """A tiny random model of the family with its instruct tokenizer that samples (nearly uniformly) only WORDS and
    its EOS, whatever the input: most of its responses end at an EOS within RESPONSE_LENGTH tokens."""
    tokenizer = archs.family_tokenizer(family, chat=True)
    model = archs.family_model(family, tokenizer)
    ids = [tokenizer.encode(word, add_special_tokens=False)[0] for word in WORDS] + [tokenizer.eos_token_id]
    # residual dim 0 is a constant about 30 times the other dims' size: after the final norm the head's dim 0 picks the
    # tokens, while the other dims still carry the text (a reward model from it scores texts apart)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1.0
        head = model.get_output_embeddings().weight
        head[:, 0] = -2.0
        head[ids, 0] = 2.0
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_sequence_classifier(family: str, directory: str) -> str:
    """A one-output HF sequence classifier of the family (random weights) with its instruct tokenizer, as a reward
    model trained by another library is published."""
    tokenizer = archs.family_tokenizer(family, chat=True)
    config = archs.family_model(family, tokenizer, seed=1).config
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def chat_world(tmp_path_factory) -> dict[str, str]:
    """The demo world's supervised chats and its prompts as chats (user turns)."""
    root = tmp_path_factory.mktemp("nplus-world")
    demo_world.main(demo_world.Args(output_dir=str(root), num_pretrain=16, num_queries=24, num_heldout=8))
    paths = sft_data.main(sft_data.Args(world_dir=str(root), num_sft=16))
    for name in ("prompts", "heldout_prompts"):
        rows = [json.loads(line) for line in open(paths[name], encoding="utf-8")]
        paths[f"chat_{name}"] = str(root / f"chat_{name}.jsonl")
        with open(paths[f"chat_{name}"], "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}]}) + "\n" for r in rows)
    return paths


def ends_at_first_eos(sample: list[int], eos: int) -> bool:
    """An EOS, and after the first one only OAI's PAD (the label file's padding)."""
    if eos not in sample:
        return False
    return all(token == OAI_PAD_TOKEN for token in sample[sample.index(eos) + 1 :])


@pytest.mark.slow
@pytest.mark.parametrize(("family", "other"), [("llama", "qwen2"), ("qwen2", "llama")])
def test_successor_recipe_on_a_chat_stand_in(tmp_path, chat_world, family, other):
    """SFT on chats, best-of-2 labels of EOS-ended samples, a reward model from the SFT model, PPO with a critic from
    it and the other family's sequence classifier as the gold judge, evaluation; on llama a kill and --resume auto."""
    base = save_eos_sampler(family, str(tmp_path / "base"))
    judge = save_sequence_classifier(other, str(tmp_path / "judge"))
    task = [*TASK_FLAGS, "--task.query_dataset", chat_world["chat_prompts"]]

    # 1. SFT on the chat rows: the saved model keeps the instruct tokenizer (template, the EOS that ends a turn)
    sft = str(tmp_path / "sft")
    run_script(
        "train_sft.py",
        *("--base_model", base, "--dataset", chat_world["sft_messages"], "--lr", "1e-3", "--batch_size", "8"),
        *("--output_dir", sft),
    )
    tokenizer = load_tokenizer(sft)
    assert tokenizer.chat_template == archs.INSTRUCT_TEMPLATES[family]
    assert tokenizer.eos_token == archs.INSTRUCT_TOKENS[family][1]
    assert max_weight_difference(*(saved_files(d, ("model.safetensors",)) for d in (sft, base))) > 0

    # 2. VADER picks the better of two samples of the SFT model per chat prompt; every sample ends at its first EOS
    labels = tmp_path / "labels.json"
    run_script(
        "label_generation.py",
        "generate",
        *("--base_model", sft, "--labeler", "vader", "--num_labels", "2", "--num_queries", "16"),
        *("--batch_size", "16", *task, "--output", str(labels)),
    )
    rows = json.loads(labels.read_text())
    assert len(rows) == 16 and all(
        ends_at_first_eos(r[f"sample{i}"], tokenizer.eos_token_id) for r in rows for i in (0, 1)
    )

    # 3. the reward model from the SFT model on those labels
    reward = str(tmp_path / "reward")
    run_script(
        "train_reward.py",
        *("--base_model", sft, "--label_dataset", str(labels), "--labels.type", "best_of_2"),
        *("--labels.num_train", "16", "--batch_size", "8", "--lr", "1e-3", "--rollout_batch_size", "8"),
        *("--normalize_samples", "8", *task, "--output_dir", reward),
    )
    reward_meta = json.loads((tmp_path / "reward" / "reward_model.json").read_text())
    assert reward_meta["task"]["end_at_eos"] and reward_meta["task"]["truncate_token"] == tokenizer.eos_token_id

    # 4. PPO: EOS-ended responses, a critic from the reward model, a fixed k1 KL, the other family's classifier judging
    policy_flags = [
        *("--base_model", sft, "--rewards.trained_model", reward, "--ppo.value_model", "reward"),
        *("--rewards.kl_estimator", "k1", "--rewards.adaptive_kl.no_enabled", "--rewards.kl_coef", "0.05"),
        *("--rewards.gold_model", f"sequence_classifier:{judge}", "--ppo.total_episodes", "16"),
        *("--ppo.batch_size", "8", "--ppo.lr", "1e-3", "--ppo.noptepochs", "1", "--ppo.whiten_group_size", "0"),
        *("--save_interval", "1", *task),
    ]
    whole = tmp_path / "policy"
    run_script("train_policy.py", *policy_flags, "--output_dir", str(whole))
    metrics = scalars(whole)
    assert len(metrics["objective/kl"]) == 2 and len(metrics["objective/gold_score"]) == 2
    assert all(math.isfinite(v) for series in metrics.values() for _, v in series)
    assert all(value == pytest.approx(0.05) for _, value in metrics["objective/kl_coef"])  # fixed
    critic = json.loads((whole / "critic" / "critic.json").read_text())
    assert critic["value_model"] == "reward" and reward in critic["initialized_from"]

    # 5. evaluation on held-out chat prompts: reward model and gold judge from the policy's args.json
    run_script(
        "evaluate.py",
        *("--policy", str(whole), "--num_queries", "8", "--batch_size", "8"),
        *("--task.query_dataset", chat_world["chat_heldout_prompts"]),
    )
    results = json.loads((whole / "eval" / "results.json").read_text())
    assert (results["reward_model"], results["gold"]) == (reward, f"sequence_classifier:{judge}")
    assert results["queries"]["num"] == 8 and results["queries"]["held_out"]
    assert all(
        math.isfinite(results["metrics"][m][side]["mean"])
        for m in ("score", "gold_score", "kl")
        for side in ("base", "trained")
    )
    assert all(
        e["trained"]["response"].endswith(tokenizer.eos_token)
        for e in results["examples"]
        if e["trained"]["filter_pass_rate"]
    )
    if family != "llama":
        return

    # 6. killed after its first checkpoint, then --resume auto: what the uninterrupted run logged and saved
    killed = tmp_path / "killed"
    flags = [*policy_flags, "--output_dir", str(killed)]
    assert start_and_kill(script_command("train_policy.py", flags), killed, kill_after=1, delay=0.0) == 1
    result = run_script("train_policy.py", *flags, "--resume", "auto")
    assert f"resuming from {checkpoint.step_dir(str(killed), 1)} after 1 of 2" in result.stdout
    assert max_metric_difference(scalars(killed), metrics, 1) <= 1e-6
    assert max_weight_difference(saved_files(killed, POLICY_FILES), saved_files(whole, POLICY_FILES)) <= 1e-6
    critic = ("critic/model.safetensors",)
    assert max_weight_difference(saved_files(killed, critic), saved_files(whole, critic)) <= 1e-6
