"""Time per optimizer step of a random GPT-2 under several processes: the gradient all-reduce overlapped with the
backward (distributed.GradientAverager, what the training scripts run) against one flattened all-reduce after it.

    torchrun --nproc_per_node 2 benchmark/allreduce_overlap.py --model gpt2-124m --steps 5
    torchrun --nproc_per_node 8 benchmark/allreduce_overlap.py --model gpt2-124m   # one process per GPU

One step = forward of `--rows` rows of `--tokens` tokens, the LM loss, backward, the gradients averaged over processes,
a TF-style Adam step: the shape of a PPO or reward optimizer step. `after` all-reduces every gradient in one flat
buffer once the backward has finished (the code before the overlap); `overlap` starts bucketed asynchronous all-reduces
from post-accumulate-grad hooks while the backward runs and waits for them before the Adam step. Both give identical
gradients (tests/test_allreduce.py). On CPU the processes use gloo, on GPUs NCCL.
"""

import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from transformers import GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark.shapes import gpt2_config  # noqa: E402
from lm_human_preference_details import cli, distributed  # noqa: E402
from lm_human_preference_details.optim import AdamTensorFlowStyle  # noqa: E402


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "gpt2-124m"
    """random GPT-2 shape"""
    rows: int = 4
    """rows per process and step"""
    tokens: int = 88
    """tokens per row (OAI books tasks: 64 query + 24 response)"""
    steps: int = 5
    """timed steps per mode (after 1 untimed one)"""
    modes: tuple[Literal["after", "overlap"], ...] = ("after", "overlap", "after", "overlap")
    """modes to time, in this order (alternated, so that load changes on a shared machine hit both); then one
    all-reduce of the gradients' size alone, the time the overlap can hide at most"""
    threads: int = 1
    """torch intra-op CPU threads per process"""


def flat_allreduce(params: list[torch.nn.Parameter], world_size: int) -> None:
    """The averaging before the overlap: every gradient in one flat buffer, one all-reduce after the backward."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world_size)
    torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


def time_steps(args: Args, mode: str, model, optimizer, accelerator, tokens: torch.Tensor) -> np.ndarray:
    """Seconds of each timed optimizer step in `mode`."""
    params = list(model.parameters())
    gradients = distributed.GradientAverager(params, accelerator) if mode == "overlap" else None
    seconds = []
    for step in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens).logits[:, :-1]  # next-token prediction loss
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if gradients is not None:
            gradients.launch_in_next_backward()
        loss.backward()
        if gradients is not None:
            gradients.average()
        else:
            flat_allreduce(params, accelerator.num_processes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        if step:
            seconds.append(time.perf_counter() - start)
    if gradients is not None:
        gradients.close()
    return np.array(seconds)


def time_allreduce(args: Args, model, cuda: bool) -> list[float]:
    """Seconds of one all-reduce of a flat buffer as large as all gradients: what the overlap can hide."""
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=next(model.parameters()).device)
    seconds = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    accelerator = distributed.make_accelerator()
    if accelerator.num_processes < 2:
        raise ValueError("run it under torchrun (or accelerate launch) with --nproc_per_node 2 or more")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(args.model)).to(accelerator.device)
    optimizer = AdamTensorFlowStyle(model.parameters(), lr=1e-5, eps=1e-5)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    tokens = torch.randint(0, 50257, (args.rows, args.tokens), generator=generator).to(accelerator.device)
    results: dict[str, list[float]] = {}
    for mode in args.modes:
        results.setdefault(mode, []).extend(time_steps(args, mode, model, optimizer, accelerator, tokens))
    alone = time_allreduce(args, model, tokens.is_cuda)
    if accelerator.is_main_process:
        params = sum(p.numel() for p in model.parameters())
        averager = distributed.GradientAverager(list(model.parameters()), accelerator)
        buckets = len(averager.buckets)
        averager.close()
        print(
            f"model {args.model} ({params / 1e6:.1f}M params, {params * 4 / 2**20:.0f} MiB of float32 gradients, "
            f"{buckets} buckets of <= {distributed.BUCKET_BYTES / 2**20:.0f} MiB), "
            f"{accelerator.num_processes} processes "
            f"({dist.get_backend()}), {args.rows} x {args.tokens} tokens per process, {args.threads} thread(s); "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        for mode, seconds in results.items():
            print(
                f"{mode:8s} seconds per optimizer step: min {min(seconds):.3f}, median {np.median(seconds):.3f} "
                f"({len(seconds)} steps)"
            )
        print(f"one all-reduce of all gradients alone: min {min(alone):.3f} s, median {np.median(alone):.3f} s")


if __name__ == "__main__":
    main(cli.tyro_cli(Args, use_underscores=True))
