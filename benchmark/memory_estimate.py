"""GPU memory per process of a train_policy.py run, estimated for a GPT-2 or Pythia shape, process count and flag set,
and whether it fits a GPU; with the largest --rollout_micro_batch_size that fits when the whole batch does not.

    python benchmark/memory_estimate.py                   # GPT-2 124M .. 1.5B, Pythia 6.9B, OAI's sentiment run, 8 GPUs
    python benchmark/memory_estimate.py --shapes gpt2-1.5b --compile_sampler --gpu_gib 80
    python benchmark/memory_estimate.py --shapes gpt2-1.5b --bf16 --gradient_checkpointing --lora_rank 8
    python benchmark/memory_estimate.py --value_model reward                # a separate critic (docs/nplus.md)
    python benchmark/memory_estimate.py --task nplus_tldr --shapes pythia-1b pythia-6.9b --fsdp
    python benchmark/memory_estimate.py --summary                           # the markdown table of README.md

Parameter counts come from the real modules (built as train_policy.py builds them, on the meta device: nothing is
downloaded or allocated, see benchmark/lora_memory.py); the rest is arithmetic on the shapes, float32 unless --bf16:
- held through the run: policy, reference copy (none under LoRA), reward model, with --value_model (or a preset's
  critic, --task nplus_tldr) a critic (a trunk of the policy's shape and a head), Adam's two moments, with
  --compile_sampler the decoding step's KV cache (reused by every rollout, so it stays allocated while PPO trains), and
  on several processes without --fsdp the gradients: torch's DistributedDataParallel (gradient_as_bucket_view) keeps
  them in its all-reduce buckets, allocated when the model is wrapped, and the all-reduce runs in them: no second
  gradient-sized copy, and none freed between updates;
- rollout: the KV cache of --rollout_micro_batch_size episodes (2 x layers x rows x tokens x width), one step's
  sampling buffers (logits, their exponentials and a float64 CDF: 20 bytes x rows x vocab), and the reference
  forward's (rows, L, V) logits with their softmax;
- PPO: gradients, the micro-batch's stored activations (~16 floats per token, layer and width unit in float32, half of
  them in bfloat16; with --gradient_checkpointing the blocks' inputs plus one block recomputed; a critic's trunk stores
  as many again), with --bf16 autocast's bfloat16 copies of the blocks' weights (cached until the forward ends), its
  (b, L, V) logits, softmax and logit gradient; then the optimizer step's temporaries (TF-style Adam: one
  STEP_BUCKET_BYTES bucket or the largest parameter; torch's Adam/AdamW of --task nplus_tldr: sqrt(v) + eps of every
  trained parameter at once, its foreach kernels).
--fsdp (FSDP2, one shard per transformer block and one for the rest): the policy's (and critic's) weights, gradients
and Adam moments are divided by --processes, and so are the reference policy and the reward model, whose forwards
gather one block at a time. The rollout gathers the policy's weights whole once ("gathered policy", freed after it);
the PPO forward and backward gather at most two blocks at a time, weights and gradients, plus the root shard
(embeddings, LM head, heads: FSDP2 keeps the root unsharded from the forward to the end of the backward) ("gathered
blocks"). Every micro-batch's gradients are reduce-scattered into the shards, so gradient accumulation holds no whole
copy. On one process --fsdp changes nothing (no sharding).
Activations are a rule of thumb (no attention matrix: SDPA; NeoX's MLP is 4x as GPT-2's); allocator fragmentation
and the CUDA context are covered by --headroom_gib. docs/multiprocess.md#memory compares the figures with measured
ones; measure a real run with benchmark/policy_throughput.py (peak memory line).
"""

import functools
import os
import sys
from dataclasses import dataclass, replace

import torch
import tyro
from rich.console import Console
from rich.table import Table
from transformers import AutoModel, AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_policy  # noqa: E402
from benchmark.lora_memory import count, footprint  # noqa: E402
from benchmark.shapes import PYTHIA_SHAPES, SHAPES, model_config  # noqa: E402
from lm_human_preference_details import cli, lora, optim, sizes  # noqa: E402

GIB = 2**30
FLOAT = 4
BF16 = 2
GATHERED_BLOCKS = 2
"""FSDP2's transformer blocks unsharded at once: the one computing and the next, prefetched"""

FLAG_SETS = {
    "float32 (default)": {},
    "`--bf16 --gradient_checkpointing`": dict(bf16=True, gradient_checkpointing=True),
    "`--fsdp`": dict(fsdp=True),
    "`--fsdp --bf16 --gradient_checkpointing`": dict(fsdp=True, bf16=True, gradient_checkpointing=True),
    "`--lora.rank 8 --bf16 --gradient_checkpointing`": dict(lora_rank=8, bf16=True, gradient_checkpointing=True),
}
"""the columns of --summary, in train_policy.py's flags: flags on top of the command line's"""


@dataclass
class Args:
    shapes: tuple[str, ...] = ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", "pythia-6.9b")
    """shapes of the policy and reward model (benchmark/shapes.py): tiny, gpt2-124m .. gpt2-1.5b, pythia-1b,
    pythia-2.8b, pythia-6.9b"""
    task: str = "sentiment"
    """task preset: its query and response lengths, batch size, critic and optimizer (sentiment, descriptiveness,
    tldr, cnndm, nplus_tldr)"""
    batch_size: int | None = None
    """--ppo.batch_size, episodes per update over all processes; None: the preset's (512 books and nplus_tldr, 32
    tldr/cnndm)"""
    processes: int = 8
    """processes (GPUs)"""
    gradient_accumulation_steps: int = 1
    """--ppo.gradient_accumulation_steps (the PPO micro-batch is the process's minibatch / this)"""
    nminibatches: int = 1
    """--ppo.nminibatches"""
    bf16: bool = False
    """--bf16: the PPO forward under bfloat16 autocast"""
    gradient_checkpointing: bool = False
    """--gradient_checkpointing"""
    compile_sampler: bool = False
    """--compile_sampler: the decoding step's KV cache stays allocated through the run"""
    lora_rank: int = 0
    """--lora.rank (0: full fine-tuning with a reference copy)"""
    rollout_micro_batch_size: int | None = None
    """--rollout_micro_batch_size (None: the process's whole batch decodes at once)"""
    value_model: str | None = None
    """--ppo.value_model: any value (reward, policy, DIR) adds a separate critic of the policy's shape, trained with
    it (weights, gradients, Adam moments, activations); None: the preset's (nplus_tldr: reward; OAI's: none, the value
    head on the policy's trunk)"""
    fsdp: bool = False
    """--fsdp: the policy and critic, the reference policy and the reward model sharded over the processes (FSDP2)"""
    gpu_gib: float = 80.0
    """memory of one GPU, GiB (H100/A100 80 GB: 80)"""
    headroom_gib: float = 3.0
    """GiB kept free for the CUDA context, cuBLAS workspaces and allocator fragmentation"""
    summary: bool = False
    """print, instead of the parts, the markdown table of the peak per process of each shape under each of FLAG_SETS
    (README.md, docs/multiprocess.md)"""


@functools.cache
def presets() -> dict[str, train_policy.Args]:
    """train_policy.py's --task presets: OAI's and the successor recipe's."""
    return train_policy.task_presets()


def activation_floats_per_token(width: int, layers: int, bf16: bool, checkpointing: bool) -> float:
    """Floats (4-byte units) a training forward stores per token for the backward, all layers."""
    per_layer = 16 * width * (0.5 if bf16 else 1.0)  # layer norms, q/k/v, attention output, 4x MLP in and out
    if checkpointing:
        return layers * width + per_layer  # each block's input, and one block recomputed in the backward
    return layers * per_layer


def block_and_root_floats(model: torch.nn.Module) -> tuple[int, int, int]:
    """(largest transformer block, all blocks, the rest) of `model`'s parameters, in floats: FSDP2's shards when each
    block and then the model are wrapped (the rest, the root: embeddings, final norm, LM head)."""
    blocks = [count(m.parameters()) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return max(blocks), sum(blocks), count(model.parameters()) - sum(blocks)


@functools.cache
def module_floats(shape: str, lora_rank: int) -> dict[str, int]:
    """Parameter counts of the modules train_policy.py builds for `shape`, on the meta device: `footprint`'s (policy,
    reference, trainable), the trunk alone (a reward model's or critic's), the largest parameter and, for FSDP2's
    shards, the largest block, all blocks and the rest of the language model."""
    config = model_config(shape)
    floats = footprint(shape, lora.LoraHParams(rank=lora_rank) if lora_rank else None)
    with torch.device("meta"):
        lm, trunk = AutoModelForCausalLM.from_config(config), AutoModel.from_config(config)
    block, blocks, root = block_and_root_floats(lm)
    largest = max(p.numel() for p in lm.parameters())
    return {
        **floats,
        "trunk": count(trunk.parameters()),
        "largest": largest,
        "block": block,
        "blocks": blocks,
        "root": root,
    }


def check_args(args: Args) -> None:
    """ValueError in one line naming the flag, for what train_policy.py refuses or the planner does not know."""
    if args.task not in presets():
        raise ValueError(f"unknown --task '{args.task}'; the tasks are {', '.join(presets())}.")
    if args.lora_rank and (args.value_model or presets()[args.task].ppo.value_model):
        raise ValueError("--value_model with --lora_rank: train_policy.py refuses a separate critic with LoRA.")
    if args.lora_rank and args.fsdp:
        raise ValueError("--fsdp with --lora_rank: train_policy.py refuses LoRA with --fsdp.")


def estimate(args: Args, shape: str, rollout_rows: int | None) -> dict[str, float]:
    """Bytes per process of each part and phase of a train_policy.py update."""
    config = model_config(shape)
    layers, width, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    preset = presets()[args.task]
    task = preset.task
    ppo = replace(
        preset.ppo,
        batch_size=args.batch_size or preset.ppo.batch_size,
        nminibatches=args.nminibatches,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    )
    # the per-process episodes and PPO micro-batch, as train_policy.py derives them (its error when one does not divide)
    derived = sizes.derive_sizes(replace(preset, ppo=ppo), args.processes)
    batch, micro = derived.batch, derived.micro
    rows = min(rollout_rows or batch, batch)
    length, tokens = task.response_length, task.query_length + task.response_length
    value_model = args.value_model or preset.ppo.value_model
    floats = module_floats(shape, args.lora_rank)
    largest = floats["largest"] * FLOAT
    head = width + 1  # a value head, a critic's head
    # a critic: a trunk and a head, every weight trained; the policy's value head is then frozen
    critic = floats["trunk"] + head if value_model else 0
    trained = floats["trainable"] + (critic - head if value_model else 0)
    trunks_trained = 2 if value_model else 1  # the critic's training forward stores activations of its own
    block, blocks = floats["block"], floats["blocks"]
    root = floats["root"] + head + (floats["trunk"] - blocks + head if value_model else 0)  # the learner's root shard
    fsdp = args.fsdp and args.processes > 1  # one process trains the module itself, as without --fsdp
    shards = args.processes if fsdp else 1
    ddp = args.processes > 1 and not fsdp
    kv_cache = 2 * layers * rows * tokens * width * FLOAT
    gathered_blocks = 2 * (GATHERED_BLOCKS * block + root) * FLOAT  # weights and their gradients, unsharded
    parts = {
        "policy": floats["policy"] * FLOAT / shards,
        "reference": floats["reference"] * FLOAT / shards,
        "reward model": (floats["trunk"] + width + 3) * FLOAT / shards,
        "critic": critic * FLOAT / shards,
        "Adam moments": 2 * trained * FLOAT / shards,
        "KV cache": kv_cache,
        "gradients": trained * FLOAT / shards,
        "gathered policy": floats["policy"] * FLOAT if fsdp else 0,
        "gathered blocks": gathered_blocks if fsdp else 0,
        "activations": trunks_trained
        * micro
        * (tokens - 1)
        * activation_floats_per_token(width, layers, args.bf16, args.gradient_checkpointing)
        * FLOAT,
        "bf16 weight copies": trunks_trained * blocks * BF16 if args.bf16 else 0,
        "logits": 3 * micro * length * vocab * FLOAT,
        "step temporaries": (
            max(optim.STEP_BUCKET_BYTES, largest / shards)
            if preset.use_tensorflow_adam
            else trained * FLOAT / shards  # torch's foreach Adam: sqrt(v) + eps of every parameter at once
        ),
    }
    held = parts["policy"] + parts["reference"] + parts["reward model"] + parts["critic"] + parts["Adam moments"]
    held += (kv_cache if args.compile_sampler else 0) + (parts["gradients"] if ddp else 0)
    gradients = 0 if ddp else parts["gradients"]
    sampling = (0 if args.compile_sampler else kv_cache) + 20 * rows * vocab
    reference = 2 * rows * length * vocab * FLOAT
    if fsdp:  # the reference's and the reward model's forwards gather one block at a time, and their root
        reference += (GATHERED_BLOCKS * block + floats["root"]) * FLOAT
    critic_values = gathered_blocks / 2 if fsdp and value_model else 0  # the critic's rollout forward
    ppo = ("gathered blocks", "activations", "bf16 weight copies", "logits")
    phases = {
        "rollout": held + parts["gathered policy"] + critic_values + max(sampling, reference),
        "PPO": held + gradients + sum(parts[name] for name in ppo),
        "step": held + gradients + parts["step temporaries"],
    }
    return {**parts, **phases, "peak": max(phases.values()), "batch": batch, "rows": rows}


def fits(args: Args, peak: float) -> bool:
    """True when `peak` bytes leave --headroom_gib of --gpu_gib free."""
    return peak <= (args.gpu_gib - args.headroom_gib) * GIB


def rollout_rows_that_fit(args: Args, shape: str, batch: int) -> int | None:
    """The largest divisor of the process's batch as --rollout_micro_batch_size that fits; None when none does."""
    for rows in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
        if fits(args, estimate(args, shape, rows)["peak"]):
            return rows
    return None


def verdict(args: Args, shape: str, result: dict[str, float]) -> str:
    """yes, no, or no with the largest --rollout_micro_batch_size that fits."""
    if fits(args, result["peak"]):
        return "yes"
    rows = rollout_rows_that_fit(args, shape, result["batch"])
    return "no" + (f" (--rollout_micro_batch_size {rows})" if rows and rows < result["rows"] else "")


def summary_table(args: Args) -> str:
    """The markdown table of --summary: the peak GiB per process of each shape under each of FLAG_SETS, and whether it
    fits (or with which --rollout_micro_batch_size); "refused" where train_policy.py refuses the flags (LoRA with a
    critic)."""
    lines = ["| model | " + " | ".join(FLAG_SETS) + " |", "|---" * (len(FLAG_SETS) + 1) + "|"]
    for shape in args.shapes:
        cells = []
        for flags in FLAG_SETS.values():
            flagged = replace(args, **flags)
            try:
                check_args(flagged)
            except ValueError:
                cells.append("refused")
                continue
            result = estimate(flagged, shape, args.rollout_micro_batch_size)
            fit = verdict(flagged, shape, result).replace("no (", "fits with `").replace(")", "`")
            cells.append(f"{result['peak'] / GIB:.1f} " + {"yes": "fits", "no": "too big"}.get(fit, fit))
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(args: Args) -> None:
    cli.quiet_transformers()
    check_args(args)
    known = [*SHAPES, *PYTHIA_SHAPES]
    for shape in args.shapes:
        if shape not in known:
            raise ValueError(f"unknown shape '{shape}' (--shapes); the shapes are {', '.join(known)}.")
    if args.summary:
        print(summary_table(args))
        return
    value_model = args.value_model or presets()[args.task].ppo.value_model
    names = ("bf16", "gradient_checkpointing", "compile_sampler", "fsdp")
    flags = [f"--{name}" for name in names if getattr(args, name)]
    flags += [f"--lora.rank {args.lora_rank}"] if args.lora_rank else []
    flags += [f"--rollout_micro_batch_size {args.rollout_micro_batch_size}"] if args.rollout_micro_batch_size else []
    flags += [f"--ppo.value_model {value_model}"] if value_model else []
    title = (
        f"GPU memory per process, GiB: {args.task}, {args.processes} processes, "
        f"{' '.join(flags) or 'float32, no flags'}; fits: within {args.gpu_gib:g} GiB less {args.headroom_gib:g}"
    )
    table = Table(title=title)
    columns = ["model", "policy", "reference", "reward model", *(["critic"] if value_model else [])]
    columns += ["Adam moments", "KV cache", "gradients"]
    columns += ["gathered policy", "gathered blocks"] if args.fsdp else []
    columns += ["activations", *(["bf16 weight copies"] if args.bf16 else []), "logits", "step temporaries"]
    columns += ["rollout", "PPO", "step", "peak", "fits"]
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for shape in args.shapes:
        result = estimate(args, shape, args.rollout_micro_batch_size)
        table.add_row(shape, *[f"{result[c] / GIB:.1f}" for c in columns[1:-1]], verdict(args, shape, result))
    Console(width=max(200, Console().width)).print(table)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
