"""Memory of the policy's weights and Adam state: full fine-tuning with a separate reference copy vs LoRA with the
reference as the policy with its adapters disabled.

    python benchmark/lora_memory.py                 # GPT-2 124M and 355M shapes, LoRA rank 8
    python benchmark/lora_memory.py --rank 16 --target_modules c_attn c_proj

The policies are built as train_policy.py builds them (PolicyWithValueHead, lora.apply_lora, lora.ReferencePolicy,
make_optimizer) from the shapes of benchmark/shapes.py on the meta device: nothing is downloaded or allocated, the
counts are those of the real modules. Counted per process, float32 (4 bytes): the parameters held (policy, value
head, reference copy), the gradients of the trainable ones, and Adam's state (2 floats per parameter in the
optimizer: exp_avg, exp_avg_sq).
Activations, the reward model and the KV cache are not counted; they do not depend on LoRA.
"""

import os
import sys
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmark.shapes import model_config  # noqa: E402
from lm_human_preference_details import cli, lora  # noqa: E402
from lm_human_preference_details.modeling import PolicyWithValueHead  # noqa: E402
from lm_human_preference_details.optim import make_optimizer  # noqa: E402

MODELS = {"gpt2 (124M)": "gpt2-124m", "gpt2-medium (355M)": "gpt2-355m"}
"""the table's rows: OAI's 124M policy and gpt2-medium (benchmark/shapes.py)"""
BYTES = 4  # float32


@dataclass
class Args:
    rank: int = 8
    """LoRA rank (--lora.rank)"""
    alpha: float = 16.0
    """LoRA alpha (--lora.alpha; does not change the memory)"""
    target_modules: tuple[str, ...] = ()
    """layers that get adapters (--lora.target_modules); empty: peft's default for GPT-2 (c_attn)"""


def count(params) -> int:
    """Elements of distinct parameters (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in params}.values())


def footprint(shape: str, lora_params: lora.LoraHParams | None) -> dict[str, int]:
    """Floats held by the policy, its reference, its gradients and Adam's state, built as train_policy.py does, for a
    GPT-2 or Pythia shape (benchmark/shapes.py)."""
    with torch.device("meta"):
        policy = PolicyWithValueHead(AutoModelForCausalLM.from_config(model_config(shape))).eval()
        if lora_params is not None:
            lora.apply_lora(policy, lora_params, shape)
        reference = lora.ReferencePolicy(policy)
    optimizer = make_optimizer(list(policy.parameters()), 1e-5, True)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "policy": count(policy.parameters()),
        "reference": count(reference.copy.parameters()) if reference.copy is not None else 0,
        "trainable": count(trained),
        "gradients": count(trained),
        "adam": 2 * count(trained),
    }


def main(args: Args) -> None:
    cli.quiet_transformers()
    lora_params = lora.LoraHParams(rank=args.rank, alpha=args.alpha, target_modules=args.target_modules)
    lora.check_lora_args(lora_params)
    table = Table(title=f"policy memory, float32: full fine-tuning vs LoRA rank {args.rank} (per process)")
    for column in ("model", "setup", "trainable", "params held", "gradients", "Adam state", "total"):
        table.add_column(column, justify="left" if column in ("model", "setup") else "right")

    def millions(n: int) -> str:
        return f"{n / 1e6:,.1f} M"

    def gib(n: int) -> str:
        size = n * BYTES
        return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"

    for name, shape in MODELS.items():
        full, adapted = footprint(shape, None), footprint(shape, lora_params)
        totals = {}
        for setup, f in (("full + reference copy", full), ("LoRA + adapters off", adapted)):
            held = f["policy"] + f["reference"]
            totals[setup] = held + f["gradients"] + f["adam"]
            table.add_row(
                name,
                setup,
                f"{f['trainable']:,}",
                f"{millions(held)} ({gib(held)})",
                gib(f["gradients"]),
                gib(f["adam"]),
                gib(totals[setup]),
            )
        saved = 1 - totals["LoRA + adapters off"] / totals["full + reference copy"]
        table.add_row(name, "saved by LoRA", "", "", "", "", f"{saved:.0%}", end_section=True)
    Console(width=max(120, Console().width)).print(table)


if __name__ == "__main__":
    main(cli.tyro_cli(Args, description=__doc__))
