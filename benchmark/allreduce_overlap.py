"""Time per optimizer step of a random GPT-2 under several processes: PyTorch's DistributedDataParallel (what the
training scripts run: `distributed.data_parallel`) against one flattened all-reduce after the backward, and against a
hand-written bucketed all-reduce overlapped with the backward (the project's averager before DDP, kept here only to be
compared).

    torchrun --nproc_per_node 2 benchmark/allreduce_overlap.py --model gpt2-124m --steps 5
    torchrun --nproc_per_node 8 benchmark/allreduce_overlap.py --model gpt2-124m   # one process per GPU

One step = forward of `--rows` rows of `--tokens` tokens, the LM loss, backward, the gradients averaged over processes,
a TF-style Adam step: the shape of a PPO or reward optimizer step. `ddp`: the forward through DDP, whose buckets of
25 MiB (the first 1 MiB) start their asynchronous all-reduces while the backward runs, the gradients views of the
buckets, zeroed in place after the step (`distributed.clear_gradients`); `after`: every gradient in one flat buffer,
all-reduced once the backward has finished; `hand`: buckets of 25 MiB started from post-accumulate-grad hooks and waited
for before the step. All give the mean of the processes' gradients (tests/test_allreduce.py,
tests/test_distributed.py). On CPU the processes use gloo, on GPUs NCCL.
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

HAND_BUCKET_BYTES = 25 * 2**20
"""the hand-written averager's bucket size (DDP's default bucket_cap_mb)"""


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "gpt2-124m"
    """random GPT-2 shape"""
    rows: int = 4
    """rows per process and step"""
    tokens: int = 88
    """tokens per row (OAI books tasks: 64 query + 24 response)"""
    steps: int = 5
    """timed steps per mode (after 2 untimed ones)"""
    modes: tuple[Literal["ddp", "after", "hand"], ...] = ("ddp", "after", "hand", "ddp", "after", "hand")
    """modes to time, in this order (alternated, so that load changes on a shared machine hit all); then one
    all-reduce of the gradients' size alone, the time an overlap can hide at most"""
    threads: int = 1
    """torch intra-op CPU threads per process"""


def flat_allreduce(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Every gradient in one flat buffer, one all-reduce after the backward."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world_size)
    torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


class HandAverager:
    """Bucketed all-reduces overlapped with the backward, by hand: the gradients in buckets of HAND_BUCKET_BYTES in
    reverse parameter order; post-accumulate-grad hooks start a bucket's asynchronous all-reduce once all its
    gradients are complete (buckets in order on every process); `average` waits for them and divides in place."""

    def __init__(self, params: list[torch.nn.Parameter], world_size: int):
        self.world_size = world_size
        self.buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):
            if self.buckets[-1] and size + p.numel() * p.element_size() > HAND_BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in params]
        self.missing = [len(bucket) for bucket in self.buckets]
        self.in_flight: list[tuple[torch.Tensor, dist.Work]] = []

    def _ready(self, param: torch.nn.Parameter) -> None:
        self.missing[self.bucket_of[id(param)]] -= 1
        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
            bucket = self.buckets[len(self.in_flight)]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            for p, chunk in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad = chunk.view_as(p)  # the gradients become views of the bucket: no second copy
            self.in_flight.append((flat, dist.all_reduce(flat, async_op=True)))

    @torch.no_grad()
    def average(self) -> None:
        for flat, work in self.in_flight:
            work.wait()
            flat.div_(self.world_size)
        self.missing = [len(bucket) for bucket in self.buckets]
        self.in_flight = []

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The next-token prediction loss."""
    logits = model(tokens).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def time_steps(args: Args, mode: str, model, trained, optimizer, world_size: int, tokens: torch.Tensor) -> np.ndarray:
    """Seconds of each timed optimizer step in `mode` (`trained`: DDP around `model`)."""
    params = list(model.parameters())
    hand = HandAverager(params, world_size) if mode == "hand" else None
    seconds = []
    for step in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        if mode == "ddp":
            with distributed.averaging_gradients(trained, True):
                lm_loss(trained, tokens).backward()
        else:
            lm_loss(model, tokens).backward()
            hand.average() if hand is not None else flat_allreduce(params, world_size)
        optimizer.step()
        if mode == "ddp":
            distributed.clear_gradients(optimizer, trained)
        else:
            optimizer.zero_grad(set_to_none=True)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        if step >= 2:  # DDP rebuilds its buckets at its second forward
            seconds.append(time.perf_counter() - start)
    if hand is not None:
        hand.close()
    return np.array(seconds)


def time_allreduce(args: Args, model, cuda: bool) -> list[float]:
    """Seconds of one all-reduce of a flat buffer as large as all gradients: what an overlap can hide."""
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
    trained = distributed.data_parallel(model, accelerator)
    optimizer = AdamTensorFlowStyle(model.parameters(), lr=1e-5, eps=1e-5)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    tokens = torch.randint(0, 50257, (args.rows, args.tokens), generator=generator).to(accelerator.device)
    results: dict[str, list[float]] = {}
    for mode in args.modes:
        seconds = time_steps(args, mode, model, trained, optimizer, accelerator.num_processes, tokens)
        results.setdefault(mode, []).extend(seconds)
    alone = time_allreduce(args, model, tokens.is_cuda)
    if accelerator.is_main_process:
        params = sum(p.numel() for p in model.parameters())
        ddp_buckets = trained._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")
        ddp_mib = ", ".join(f"{int(size) / 2**20:.1f}" for size in ddp_buckets.split(", ") if size)
        hand_buckets = HandAverager(list(model.parameters()), accelerator.num_processes)
        hand_buckets.close()
        print(
            f"model {args.model} ({params / 1e6:.1f}M params, {params * 4 / 2**20:.0f} MiB of float32 gradients; "
            f"DDP buckets of {ddp_mib} MiB, {len(hand_buckets.buckets)} hand buckets of <= "
            f"{HAND_BUCKET_BYTES / 2**20:.0f} MiB), {accelerator.num_processes} processes "
            f"({dist.get_backend()}), {args.rows} x {args.tokens} tokens per process, {args.threads} thread(s); "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        for mode, seconds in results.items():
            print(
                f"{mode:8s} seconds per optimizer step: min {min(seconds):.3f}, median {np.median(seconds):.3f} "
                f"({len(seconds)} steps)"
            )
        print(f"one all-reduce of all gradients alone: min {min(alone):.3f} s, median {np.median(alone):.3f} s")
    cli.end_process_group()  # a process that exits with its group up can abort in its teardown


if __name__ == "__main__":
    main(cli.tyro_cli(Args, use_underscores=True))
