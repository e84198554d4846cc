"""Reward-training throughput (labels/second) of train_reward.py's step at OAI's shapes, on a random GPT-2.

    python benchmark/reward_throughput.py --model tiny
    python benchmark/reward_throughput.py --model gpt2-124m --per_process_batch 4 --steps 5

One step = one batched reward-model forward of batch*4 (query ⊕ sample) rows, best-of-4 cross-entropy, backward and a
TF-style Adam step: exactly what train_reward.py does per optimizer step on one process. Random weights change nothing
about the cost, so no download is needed. Printed per step: the seconds of forward, backward and Adam, labels and
tokens per second, host syncs and peak memory (CUDA's max allocated on a GPU, the process's max RSS on CPU).
"""

import contextlib
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_reward  # noqa: E402
from benchmark.shapes import gpt2_config  # noqa: E402
from lm_human_preference_details import cli  # noqa: E402
from lm_human_preference_details.instruments.host_syncs import HostSyncCounter  # noqa: E402
from lm_human_preference_details.labels import get_label_type  # noqa: E402
from lm_human_preference_details.modeling import RewardModel, score_label_rows  # noqa: E402
from lm_human_preference_details.optim import AdamTensorFlowStyle  # noqa: E402
from lm_human_preference_details.ppo_plumbing import PhaseTimer  # noqa: E402


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "tiny"
    """random GPT-2 shape to time"""
    per_process_batch: int = 4
    """label rows per step on this process (OAI: 32 labels over 8 processes = 4)"""
    query_length: int = 64
    """query tokens (OAI books tasks: 64)"""
    response_length: int = 24
    """response tokens (OAI books tasks: 24)"""
    steps: int = 20
    """timed steps (after 2 warm-up steps)"""
    count_syncs: bool = True
    """count each step's host syncs (a Python hook on every torch call, which adds host time per op)"""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)"""


PHASES = ("forward", "backward", "adam")


def peak_memory_gib(cuda: bool) -> float:
    """Peak device memory allocated since the last reset (GPU) or peak RSS of this process (CPU), in GiB."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    torch.manual_seed(0)
    reward_model = RewardModel(GPT2Model(gpt2_config(args.model)).eval()).to(device)
    optimizer = AdamTensorFlowStyle(reward_model.parameters(), lr=1e-5, eps=1e-5)
    pad = 50257
    query = torch.randint(0, 50257, (args.per_process_batch, args.query_length), device=device)
    samples = torch.randint(0, 50257, (args.per_process_batch, 4, args.response_length), device=device)
    best = torch.randint(0, 4, (args.per_process_batch,), device=device)
    best_of_4 = get_label_type("best_of_4")

    def step(timer: PhaseTimer) -> None:
        timer.mark()
        loss = train_reward.label_loss(best_of_4, score_label_rows(reward_model, query, samples, pad), best)["loss"]
        timer.mark()
        loss.backward()
        timer.mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark()

    rows = []
    for index in range(2 + args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timer = PhaseTimer(torch.device("cuda" if cuda else "cpu"))
        with HostSyncCounter() if args.count_syncs else contextlib.nullcontext() as syncs:
            start = time.perf_counter()
            step(timer)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        rows.append((index, timer, wall, syncs.count if syncs else None, peak_memory_gib(cuda)))
    console = Console(width=120)
    params = sum(p.numel() for p in reward_model.parameters())
    tokens = args.per_process_batch * 4 * (args.query_length + args.response_length)
    console.print(
        f"model {args.model} ({params / 1e6:.1f}M params) on {device} with {torch.get_num_threads()} threads, "
        f"batch {args.per_process_batch}x4 rows of {args.query_length}+{args.response_length} tokens; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    table = Table(title="per reward-training step")
    for column in ("step", *(f"{phase} s" for phase in PHASES), "wall s", "labels/s", "tokens/s", "syncs", "peak GiB"):
        table.add_column(column, justify="right")
    for index, timer, wall, syncs, memory in rows:
        table.add_row(
            f"{index}{' (warm-up)' if index < 2 else ''}",
            *(f"{seconds:.3f}" for seconds in timer.seconds()),
            f"{wall:.3f}",
            f"{args.per_process_batch / wall:.3g}",
            f"{tokens / wall:.0f}",
            "-" if syncs is None else str(syncs),
            f"{memory:.2f}",
        )
    console.print(table)
    seconds = np.median([wall for _, _, wall, _, _ in rows[2:]])
    console.print(f"median {seconds * 1000:.1f} ms/step, {args.per_process_batch / seconds:.3g} labels/s")


if __name__ == "__main__":
    main(cli.tyro_cli(Args, use_underscores=True))
