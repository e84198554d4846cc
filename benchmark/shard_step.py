"""The host cost of an --fsdp run's elementwise steps: TF-style Adam and the non-finite checks on FSDP2's DTensor
shards, run on each process's local shards as plain tensors (`optim.local_tensors`, now), through DTensor's operators
(its sharding propagation per operator and tensor, before), and on the unsharded module's plain tensors.

    python benchmark/shard_step.py --model gpt2-124m --repeats 5

One gloo process (CPU) shards a random-weight GPT-2 policy with its value head into one shard per tensor, with the
DTensors of a run on several processes. Reported: the median seconds of one Adam step and of the two non-finite
checks (gradients, weights) per variant. On a GPU the kernels are asynchronous and this host time is what the device
waits for when it is the longer; this CPU benchmark also counts the arithmetic.
"""

import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark.shapes import gpt2_config  # noqa: E402
from lm_human_preference_details import cli, distributed, optim, validation  # noqa: E402
from lm_human_preference_details.modeling import PolicyWithValueHead  # noqa: E402


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "tiny"
    """shape of the random policy"""
    repeats: int = 5
    """timed steps per variant (after one untimed)"""


class SeveralProcesses:
    """The accelerator of a run on 2 processes, as `distributed.data_parallel` reads it (the group has one)."""

    num_processes = 2


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def checks(params: list[torch.Tensor]) -> None:
    validation.nonfinite_tensors([p.grad for p in params]).item()
    validation.nonfinite_tensors(params).item()


def main(args: Args) -> None:
    cli.quiet_transformers()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        sharded = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(args.model)))
        plain = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(args.model)))
        distributed.data_parallel(sharded, SeveralProcesses(), fsdp=True)
        rows = []
        for name, module in (("shards as plain tensors", sharded), ("plain tensors (unsharded)", plain)):
            params = list(module.parameters())
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            optimizer = optim.make_optimizer(params, 1e-5, True)
            rows.append(
                (
                    name,
                    len(params),
                    median_seconds(optimizer.step, args.repeats),
                    median_seconds(lambda params=params: checks(params), args.repeats),
                )
            )
        # before: the same operators dispatched on the DTensors themselves
        params = list(sharded.parameters())
        local_tensors = optim.local_tensors
        optim.local_tensors = validation.local_tensors = lambda tensors: list(tensors)
        try:
            optimizer = optim.make_optimizer(params, 1e-5, True)
            step = median_seconds(optimizer.step, args.repeats)
            check = median_seconds(lambda: checks(params), args.repeats)
        finally:
            optim.local_tensors = validation.local_tensors = local_tensors
        rows.append(("DTensor operators (before)", len(params), step, check))
    finally:
        torch.distributed.destroy_process_group()
    print(f"{args.model}, torch {torch.__version__}, median of {args.repeats}")
    print(f"{'variant':28s} {'tensors':>8s} {'Adam step s':>12s} {'checks s':>10s}")
    for name, count, step, check in rows:
        print(f"{name:28s} {count:8d} {step:12.4f} {check:10.4f}")


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
