"""How long one checkpoint save blocks training: written in the training thread, or in the background after a copy.

    python benchmark/save_blocking.py --model gpt2-124m --saves 3

A random-weight GPT-2 policy with its value head and a full Adam state (as after the first PPO step), saved the way
train_policy.py saves every --save_interval updates: the training state (weights, Adam moments, counters) in
OUTPUT_DIR/training_state/step{N}, then the policy at the top of OUTPUT_DIR. `blocking` writes everything in the
training thread; `background` copies weights and Adam state to host memory and writes from a background thread
(`checkpoint.BackgroundSaves`). Reported per save: the seconds the training loop is blocked, and the seconds until the
files are on disk.
"""

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_policy  # noqa: E402
from benchmark.shapes import gpt2_config  # noqa: E402
from lm_human_preference_details import checkpoint, cli, devices, ppo_plumbing  # noqa: E402
from lm_human_preference_details.modeling import PolicyWithValueHead  # noqa: E402
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline  # noqa: E402


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "gpt2-124m"
    """shape of the random policy"""
    saves: int = 3
    """saves per mode (the first background save also builds the host twin of the model)"""
    output_dir: str | None = None
    """where to write (a fresh temporary directory under it); None: the system's temporary directory"""


class OneProcess:
    """The part of an Accelerator that save_training_state uses, for one process."""

    num_processes, process_index, is_main_process = 1, 0, True

    def wait_for_everyone(self) -> None:
        pass


def main(args: Args) -> None:
    cli.quiet_transformers()
    torch.manual_seed(0)
    policy = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(args.model))).eval()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-5)
    for p in policy.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # Adam moments for every parameter
    tokenizer = gpt2_tokenizer_offline()
    run_args = train_policy.Args()
    accelerator = OneProcess()
    size = sum(p.numel() * p.element_size() for p in policy.parameters()) / 1e9
    print(f"{args.model}: {size:.2f} GB of weights, {2 * size:.2f} GB of Adam moments, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(dir=args.output_dir) as root:
        local = {"rng": devices.rng_states(torch.Generator())}
        for mode in ("blocking", "background"):
            output_dir = os.path.join(root, mode)
            saves = checkpoint.BackgroundSaves() if mode == "background" else None
            for step in range(1, args.saves + 1):
                start = time.perf_counter()
                if saves is None:
                    shared = {"policy": policy.state_dict(), "optimizer": optimizer.state_dict()}
                    checkpoint.save_training_state(output_dir, step, accelerator, {}, shared, local, 2)
                    ppo_plumbing.save_policy(policy, tokenizer, run_args, output_dir)
                else:
                    saves.wait()
                    twin = saves.host_copy(policy)
                    shared = {"policy": twin.state_dict(), "optimizer": checkpoint.to_host(optimizer.state_dict())}

                    def write_policy(twin=twin, output_dir=output_dir) -> None:
                        ppo_plumbing.save_policy(twin, tokenizer, run_args, output_dir)

                    checkpoint.save_training_state(
                        output_dir, step, accelerator, {}, shared, local, 2, saves, write_policy
                    )
                blocked = time.perf_counter() - start
                if saves is not None:
                    saves.wait()
                done = time.perf_counter() - start
                print(f"{mode:10s} save {step}: training blocked {blocked:6.2f} s, files on disk after {done:6.2f} s")


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
