"""Pretrain a tiny GPT-2 (the real GPT-2 tokenizer and vocabulary) on the demo world's passages.

    python demo/pretrain.py --corpus runs/demo/world/pretrain.txt --output_dir runs/demo/base_model

Plain next-token training on windows that start where a query starts (after a passage's first sentence), so the
model has seen every position a query and its response use. The 50257-way LM head dominates the cost on a CPU:
keep n_embd small. The model and the tokenizer are written with save_pretrained, ready for --base_model.
"""

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lm_human_preference_details import cli
from lm_human_preference_details.data import load_texts
from lm_human_preference_details.devices import set_seed
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm, sample
from lm_human_preference_details.tasks import encode_texts
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline

SETTINGS_FILE = "pretrain.json"


@dataclass
class Args:
    corpus: str = "runs/demo/world/pretrain.txt"
    """text file, one passage per line (demo/world.py's pretrain.txt)"""
    output_dir: str = "runs/demo/base_model"
    """where the model, the tokenizer and pretrain.json are written"""
    seed: int = 0
    """seed of the initialisation and of the batch order"""
    n_layer: int = 2
    """transformer blocks"""
    n_head: int = 2
    """attention heads"""
    n_embd: int = 64
    """width; the tied 50257 x n_embd LM head is most of the compute"""
    n_positions: int = 128
    """longest query + response the model can see"""
    block_size: int = 24
    """tokens per training window: a query sentence and a response sentence of the world, 12 tokens each"""
    batch_size: int = 32
    """windows per step"""
    steps: int = 250
    """optimizer steps"""
    lr: float = 3e-3
    """AdamW peak learning rate (linear warm-up, cosine decay to lr/10)"""
    warmup_steps: int = 20
    """steps of linear warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""


def windows(corpus: str, tokenizer, block_size: int) -> torch.Tensor:
    """(N, block_size) token windows, each starting after its passage's first '.' like a query."""
    period = tokenizer.encode(".")[0]
    rows = []
    for tokens in encode_texts(tokenizer, list(load_texts(corpus))):
        if period in tokens:
            tokens = tokens[tokens.index(period) + 1 :]
        if len(tokens) >= block_size:
            rows.append(tokens[:block_size])
    if not rows:
        raise ValueError(f"no passage of '{corpus}' has {block_size} tokens after its first '.'; lower --block_size.")
    return torch.tensor(rows, dtype=torch.long)


def learning_rate(args: Args, step: int) -> float:
    """Linear warm-up to args.lr, then cosine decay to args.lr / 10."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def main(args: Args) -> dict:
    """Train, save, print a few samples; returns the settings and final loss written to pretrain.json."""
    cli.quiet_transformers()
    set_seed(args.seed)
    start = time.time()
    tokenizer = gpt2_tokenizer_offline()
    data = windows(args.corpus, tokenizer, args.block_size)  # (N, T)
    config = GPT2Config(
        vocab_size=len(tokenizer) - 1,  # GPT-2's 50257 tokens; the added PAD lies outside the model's vocabulary
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # plain shifted next-token cross-entropy (named, so transformers does not warn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(data), generator=generator)
    losses = []
    for step in range(args.steps):
        start_row = (step * args.batch_size) % len(data)
        batch = data[order[start_row : start_row + args.batch_size]]
        if len(batch) < args.batch_size:
            order = torch.randperm(len(data), generator=generator)
            batch = data[order[: args.batch_size]]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            lr = learning_rate(args, step)
            print(f"step {step:4d}  loss {loss.item():.3f}  lr {lr:.2e}  {time.time() - start:.0f}s", flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    model.eval().save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    tail = losses[-20:]
    result = {
        "args": dataclasses.asdict(args),
        "final_loss": sum(tail) / len(tail),
        "windows": len(data),
        "seconds": time.time() - start,
    }
    with open(os.path.join(args.output_dir, SETTINGS_FILE), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    # a look at what the pretrained model writes after three corpus queries
    policy = PolicyWithValueHead(load_causal_lm(args.output_dir))
    contexts = data[:3, :12]
    responses, _, _ = sample(policy, contexts, 12, 0.7, tokenizer.pad_token_id, generator)
    for context, response in zip(contexts.tolist(), responses.tolist()):
        print(f"{tokenizer.decode(context)!r} -> {tokenizer.decode(response)!r}")
    print(f"pretrained in {result['seconds']:.0f}s, final loss {result['final_loss']:.3f}, saved to {args.output_dir}")
    return result


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
