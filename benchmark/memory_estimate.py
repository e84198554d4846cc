"""GPU memory per process of a train_policy.py run, estimated for a GPT-2 shape, process count and flag set, and
whether it fits a GPU; with the largest --rollout_micro_batch_size that fits when the whole batch does not.

    python benchmark/memory_estimate.py                                   # 124M .. 1.5B, OAI's sentiment run, 8 GPUs
    python benchmark/memory_estimate.py --shapes gpt2-1.5b --compile_sampler --gpu_gib 80
    python benchmark/memory_estimate.py --shapes gpt2-1.5b --bf16 --gradient_checkpointing --lora_rank 8
    python benchmark/memory_estimate.py --value_model reward                # a separate critic (docs/nplus.md)

Parameter counts come from the real modules (built as train_policy.py builds them, on the meta device: nothing is
downloaded or allocated, see benchmark/lora_memory.py); the rest is arithmetic on the shapes, float32 unless --bf16:
- held through the run: policy, reference copy (none under LoRA), reward model, with --value_model a critic (a trunk
  of the policy's shape and a head), Adam's two moments, and with --compile_sampler the decoding step's KV cache
  (reused by every rollout, so it stays allocated while PPO trains);
- rollout: the KV cache of --rollout_micro_batch_size episodes (2 x layers x rows x tokens x width), one step's
  sampling buffers (logits, their exponentials and a float64 CDF: 20 bytes x rows x vocab), and the reference
  forward's (rows, L, V) logits with their softmax;
- PPO: gradients, the micro-batch's stored activations (~16 floats per token, layer and width unit in float32, half of
  them in bfloat16; with --gradient_checkpointing the blocks' inputs plus one block recomputed; a critic's trunk stores
  as many again), its (b, L, V) logits,
  softmax and logit gradient; then the optimizer step's temporaries (one STEP_BUCKET_BYTES bucket or the largest
  parameter); DDP's all-reduce buckets are the gradients themselves.
Activations are a rule-of-thumb estimate (no attention matrix: SDPA); allocator fragmentation and the CUDA context
are covered by --headroom_gib. Measure a real run with benchmark/policy_throughput.py (peak memory line).
"""

import os
import sys
from dataclasses import dataclass

import torch
import tyro
from rich.console import Console
from rich.table import Table
from transformers import GPT2Model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_policy  # noqa: E402
from benchmark.lora_memory import count, footprint  # noqa: E402
from benchmark.shapes import SHAPES, gpt2_config  # noqa: E402
from lm_human_preference_details import cli, optim, sizes  # noqa: E402
from lm_human_preference_details.tasks import TASKS  # noqa: E402

GIB = 2**30
FLOAT = 4
VOCAB = 50257


@dataclass
class Args:
    shapes: tuple[str, ...] = ("gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b")
    """GPT-2 shapes of the policy and reward model (benchmark/shapes.py)"""
    task: str = "sentiment"
    """task preset: its query and response lengths (sentiment, descriptiveness, tldr, cnndm)"""
    batch_size: int | None = None
    """--ppo.batch_size, episodes per update over all processes; None: the preset's (512 books, 32 tldr/cnndm)"""
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
    it (weights, gradients, Adam moments, activations); None: OAI's value head on the policy's trunk"""
    gpu_gib: float = 80.0
    """memory of one GPU, GiB (H100/A100 80 GB: 80)"""
    headroom_gib: float = 3.0
    """GiB kept free for the CUDA context, cuBLAS workspaces and allocator fragmentation"""


def activation_floats_per_token(width: int, layers: int, bf16: bool, checkpointing: bool) -> float:
    """Floats (4-byte units) a training forward stores per token for the backward, all layers."""
    per_layer = 16 * width * (0.5 if bf16 else 1.0)  # layer norms, q/k/v, attention output, 4x MLP in and out
    if checkpointing:
        return layers * width + per_layer  # each block's input, and one block recomputed in the backward
    return layers * per_layer


def estimate(args: Args, shape: str, rollout_rows: int | None) -> dict[str, float]:
    """Bytes per process of each part and phase of a train_policy.py update."""
    config = gpt2_config(shape)
    layers, width = config.n_layer, config.n_embd
    task = TASKS[args.task]
    batch_size = args.batch_size or train_policy.oai_presets()[args.task].ppo.batch_size
    batch = sizes.exact_div(batch_size, args.processes, "--batch_size / --processes")
    minibatch = sizes.exact_div(batch, args.nminibatches, "episodes per process / --nminibatches")
    micro = sizes.exact_div(minibatch, args.gradient_accumulation_steps, "minibatch / --gradient_accumulation_steps")
    rows = min(rollout_rows or batch, batch)
    length, tokens = task.response_length, task.query_length + task.response_length
    lora_params = train_policy.LoraHParams(rank=args.lora_rank) if args.lora_rank else None
    floats = footprint(shape, lora_params)
    with torch.device("meta"):
        trunk = GPT2Model(config)
    largest = max(p.numel() for p in trunk.parameters()) * FLOAT
    # a critic: a trunk and a head, every weight trained; the policy's value head (width + 1) is then frozen
    critic = (count(trunk.parameters()) + width + 1) * FLOAT if args.value_model else 0
    trained = critic - ((width + 1) * FLOAT if args.value_model else 0)  # more trained than without a critic
    trunks_trained = 2 if args.value_model else 1  # the critic's training forward stores activations of its own
    kv_cache = 2 * layers * rows * tokens * width * FLOAT
    parts = {
        "policy": floats["policy"] * FLOAT,
        "reference": floats["reference"] * FLOAT,
        "reward model": (count(trunk.parameters()) + width + 3) * FLOAT,
        "critic": critic,
        "Adam moments": floats["adam"] * FLOAT + 2 * trained,
        "KV cache": kv_cache,
        "gradients": floats["gradients"] * FLOAT + trained,
        "activations": trunks_trained
        * micro
        * (tokens - 1)
        * activation_floats_per_token(width, layers, args.bf16, args.gradient_checkpointing)
        * FLOAT,
        "logits": 3 * micro * length * VOCAB * FLOAT,
        # several processes: DDP's all-reduce buckets are the gradients (gradient_as_bucket_view), nothing more
        "step temporaries": max(optim.STEP_BUCKET_BYTES, largest),
    }
    held = parts["policy"] + parts["reference"] + parts["reward model"] + parts["critic"] + parts["Adam moments"]
    held += kv_cache if args.compile_sampler else 0
    sampling = (0 if args.compile_sampler else kv_cache) + 20 * rows * VOCAB
    reference = 2 * rows * length * VOCAB * FLOAT
    phases = {
        "rollout": held + max(sampling, reference),
        "PPO": held + parts["gradients"] + parts["activations"] + parts["logits"],
        "step": held + parts["gradients"] + parts["step temporaries"],
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


def main(args: Args) -> None:
    cli.quiet_transformers()
    if args.value_model and args.lora_rank:
        raise ValueError("--value_model with --lora_rank: train_policy.py refuses a separate critic with LoRA.")
    flags = [f"--{name}" for name in ("bf16", "gradient_checkpointing", "compile_sampler") if getattr(args, name)]
    flags += [f"--lora.rank {args.lora_rank}"] if args.lora_rank else []
    flags += [f"--rollout_micro_batch_size {args.rollout_micro_batch_size}"] if args.rollout_micro_batch_size else []
    flags += [f"--ppo.value_model {args.value_model}"] if args.value_model else []
    title = (
        f"GPU memory per process, GiB: {args.task}, {args.processes} processes, "
        f"{' '.join(flags) or 'float32, no flags'}; fits: within {args.gpu_gib:g} GiB less {args.headroom_gib:g}"
    )
    table = Table(title=title)
    columns = ["model", "policy", "reference", "reward model", *(["critic"] if args.value_model else [])]
    columns += ["Adam moments", "KV cache", "gradients"]
    columns += ["activations", "logits", "step temporaries", "rollout", "PPO", "step", "peak", "fits"]
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for shape in args.shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape '{shape}' (--shapes); the shapes are {', '.join(SHAPES)}.")
        result = estimate(args, shape, args.rollout_micro_batch_size)
        verdict = "yes" if fits(args, result["peak"]) else "no"
        if verdict == "no":
            rows = rollout_rows_that_fit(args, shape, result["batch"])
            verdict += f" (--rollout_micro_batch_size {rows})" if rows and rows < result["rows"] else ""
        table.add_row(shape, *[f"{result[c] / GIB:.1f}" for c in columns[1:-1]], verdict)
    Console(width=max(180, Console().width)).print(table)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
