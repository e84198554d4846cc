"""The successor recipe end to end on the Llama- and Qwen2-like stand-ins with their chat templates: SFT on chat rows,
a reward model from the SFT model, PPO with EOS-ended responses and a critic from the reward model, a reward model of
another tokenizer family as a standard sequence classifier, evaluation, and a kill + --resume auto that equals the
uninterrupted run. Also the stand-ins' instruct tokenizers and the demo world's supervised data that the runs use."""

import json

import pytest
import torch

from demo import sft_data
from demo import world as demo_world
from tests import archs

pytestmark = pytest.mark.usefixtures("single_thread")


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
