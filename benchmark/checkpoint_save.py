"""How long an --fsdp training-state save blocks training and takes to reach the disk, with the files' digests taken
by the main process alone (`main`, as before) or by each process for the files it wrote (`own`, now).

    python benchmark/checkpoint_save.py --model gpt2-124m --processes 2 --saves 3

Each of --processes gloo processes (CPU) shards a random-weight GPT-2 policy with its value head by FSDP2, takes one
TF-style Adam step (moments for every parameter), then saves the training state as train_policy.py does under
--fsdp: its shards of the weights and Adam moments through torch.distributed.checkpoint (synchronously), its RNG file,
the digests on each process's background thread (`checkpoint.BackgroundSaves`). Reported per save: the seconds the
slowest process's training loop is blocked, and the seconds until the checkpoint is published. On a GPU the
device-to-host copies of DCP's save add to the blocked time; this CPU benchmark does not see them.
"""

import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.multiprocessing as mp
from transformers import GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark.shapes import gpt2_config  # noqa: E402
from lm_human_preference_details import checkpoint, cli, distributed, sharded  # noqa: E402
from lm_human_preference_details.modeling import PolicyWithValueHead  # noqa: E402
from lm_human_preference_details.optim import make_optimizer  # noqa: E402


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "gpt2-124m"
    """shape of the random policy"""
    processes: int = 2
    """gloo processes on this machine"""
    saves: int = 3
    """saves per mode"""
    output_dir: str | None = None
    """where to write (a fresh temporary directory under it); None: the system's temporary directory"""


class GlooProcess:
    """The part of an Accelerator that save_training_state and data_parallel use, over the gloo group."""

    def __init__(self) -> None:
        self.process_index = torch.distributed.get_rank()
        self.num_processes = torch.distributed.get_world_size()
        self.is_main_process = self.process_index == 0

    def wait_for_everyone(self) -> None:
        torch.distributed.barrier()


def worker(rank: int, world: int, port: int, args: Args, root: str, results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    cli.quiet_transformers()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    accelerator = GlooProcess()
    torch.manual_seed(0)
    policy = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(args.model)))
    distributed.data_parallel(policy, accelerator, fsdp=True)
    optimizer = make_optimizer(list(policy.parameters()), 1e-5, True)
    for p in policy.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    own_files = checkpoint.own_files
    for mode in ("main", "own"):
        # `main`: no process hands over digests, so the main process hashes every file, as before
        checkpoint.own_files = own_files if mode == "own" else lambda directory, rank: []
        saves = checkpoint.BackgroundSaves()
        output_dir = os.path.join(root, mode)
        for step in range(1, args.saves + 1):
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            checkpoint.save_training_state(
                output_dir,
                step,
                accelerator,
                {},
                {} if accelerator.is_main_process else None,
                {"rank": rank},
                2,
                saves,
                write_shards=lambda directory: sharded.save(directory, policy, optimizer),
            )
            blocked = torch.tensor(time.perf_counter() - start)
            saves.wait()
            torch.distributed.all_reduce(blocked, torch.distributed.ReduceOp.MAX)
            accelerator.wait_for_everyone()
            if rank == 0:
                results.put((mode, step, blocked.item(), time.perf_counter() - start))
    torch.distributed.destroy_process_group()


def main(args: Args) -> None:
    size = sum(p.numel() * 4 for p in GPT2LMHeadModel(gpt2_config(args.model)).parameters()) / 1e9
    print(f"{args.model}: {size:.2f} GB of weights, {2 * size:.2f} GB of Adam moments, {args.processes} processes")
    with tempfile.TemporaryDirectory(dir=args.output_dir) as root:
        results = mp.get_context("spawn").Queue()
        mp.spawn(worker, (args.processes, free_port(), args, root, results), nprocs=args.processes)
        while not results.empty():
            mode, step, blocked, done = results.get()
            print(f"digests by {mode:4s} save {step}: training blocked {blocked:6.2f} s, published after {done:6.2f} s")


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
