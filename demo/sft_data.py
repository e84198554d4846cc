"""Supervised data and prompts of the successor recipe from the demo world's passages (demo/world.py's files).

    python demo/sft_data.py --world_dir runs/demo/world

A passage's first sentence is a prompt; its second sentence is the completion a demonstrator would write, one whole
sentence that ends (train_sft.py ends it with the tokenizer's EOS). Writes, beside the world's files:
- sft.jsonl: {"prompt", "completion"} rows from pretrain.txt (train_sft.py --dataset)
- sft_messages.jsonl: the same rows as chats, {"messages": [user: prompt, assistant: completion]}, for a tokenizer
  with a chat template
- prompts.jsonl: {"prompt"} rows, the first sentences of queries.txt (label generation, reward and policy training)
- heldout_prompts.jsonl: {"prompt"} rows, the first sentences of heldout.txt (the before/after evaluation)
"""

import json
import os
import re
from dataclasses import dataclass

import tyro

SENTENCE = re.compile(r"[^.]+\.")
"""one sentence of the world: every sentence ends with its only '.'"""


@dataclass
class Args:
    world_dir: str = "runs/demo/world"
    """demo/world.py's --output_dir: pretrain.txt, queries.txt and heldout.txt are read, the JSONL files written"""
    num_sft: int = 4000
    """supervised examples, from the first passages of pretrain.txt"""


def sentences(passage: str) -> list[str]:
    """The sentences of a passage, without the spaces between them."""
    return [s.strip() for s in SENTENCE.findall(passage)]


def sft_row(passage: str) -> dict[str, str]:
    """A passage's first sentence as the prompt, its second as the completion (with the space that joins them)."""
    first, second = sentences(passage)[:2]
    return {"prompt": first, "completion": " " + second}


def chat_row(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """A prompt/completion row as a chat: the prompt is the user's turn, the completion the assistant's."""
    return {
        "messages": [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"].strip()},
        ]
    }


def read_passages(path: str) -> list[str]:
    """The passages of one of the world's files, one per line, those with at least two sentences."""
    with open(path, encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if len(sentences(line)) >= 2]


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Rows as JSON Lines, written to a temporary file first and renamed into place."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(temporary, path)


def main(args: Args) -> dict[str, str]:
    """Write the four JSONL files; returns their paths by name."""
    pretrain = read_passages(os.path.join(args.world_dir, "pretrain.txt"))
    if len(pretrain) < args.num_sft:
        raise ValueError(f"--num_sft {args.num_sft}: pretrain.txt of '{args.world_dir}' has {len(pretrain)} passages")
    sft = [sft_row(passage) for passage in pretrain[: args.num_sft]]
    queries, heldout = (read_passages(os.path.join(args.world_dir, name)) for name in ("queries.txt", "heldout.txt"))
    rows = {
        "sft": sft,
        "sft_messages": [chat_row(row) for row in sft],
        "prompts": [{"prompt": sft_row(passage)["prompt"]} for passage in queries],
        "heldout_prompts": [{"prompt": sft_row(passage)["prompt"]} for passage in heldout],
    }
    paths = {}
    for name, data in rows.items():
        paths[name] = os.path.join(args.world_dir, f"{name}.jsonl")
        write_jsonl(paths[name], data)
        print(f"wrote {len(data)} rows to {paths[name]}")
    return paths


if __name__ == "__main__":
    main(tyro.cli(Args))
