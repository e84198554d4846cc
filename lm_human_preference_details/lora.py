"""LoRA for the policy through the peft library: low-rank adapters on the trunk, whose base weights stay frozen; the
frozen reference policy is the same model with its adapters disabled; saves hold the adapters (peft's format) and the
merged model that plain transformers loads.

Not part of OAI's recipe, which fine-tunes every weight (`--lora.rank 0`, the default, keeps that path unchanged).
Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (arXiv:2106.09685).
"""

import copy
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.pytorch_utils import Conv1D

ADAPTER_DIR = "adapter"
"""subdirectory of a LoRA run's policy directory holding the adapters in peft's format (and the value head and
tokenizer), beside the merged model at the top"""
ADAPTER_CONFIG = "adapter_config.json"
MERGED_ONLY_FILES = ("config.json", "generation_config.json", "model.safetensors")
"""files of the merged model that the adapter directory does not repeat"""


def is_adapter_dir(directory: str) -> bool:
    """True for a directory of peft adapters (its adapter_config.json) rather than a full model."""
    return os.path.isfile(os.path.join(os.path.expanduser(directory), ADAPTER_CONFIG))


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft reads transformers' deprecated `is_gradient_checkpointing` while it wraps a model: that FutureWarning is
    peft's affair, not this project's call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


# ---------------------------------------------------------------- flags


@dataclass
class LoraHParams:
    """train_policy.py's --lora.* group: LoRA adapters instead of full fine-tuning (docs/lora.md)."""

    rank: int = 0
    """rank R of the LoRA adapters (peft) on the policy's trunk: the trunk's base weights stay frozen and the
    reference policy is the policy with its adapters disabled (no second copy); 0: every weight trains, as OAI"""
    alpha: float = 16.0
    """LoRA scaling: an adapter adds (alpha / rank) B A to its layer's weight (peft's lora_alpha)"""
    dropout: float = 0.0
    """dropout on the adapters' input in the PPO loss's forward passes (never in sampling or scoring)"""
    target_modules: tuple[str, ...] = ()
    """names of the layers that get adapters, e.g. c_attn c_proj; empty: peft's default for the architecture
    (gpt2: c_attn, gpt_neox: query_key_value, llama and qwen2: q_proj v_proj)"""


def check_lora_args(lora: LoraHParams) -> None:
    """ValueError for a --lora.* value that cannot work (before any model loads)."""
    if lora.rank < 0:
        raise ValueError(f"--lora.rank must be >= 0, got {lora.rank}; pass e.g. --lora.rank 8, or 0 for no LoRA.")
    if not lora.alpha > 0:
        raise ValueError(f"--lora.alpha must be > 0, got {lora.alpha}; pass e.g. --lora.alpha 16 (scale alpha/rank).")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"--lora.dropout must be in [0, 1), got {lora.dropout}; pass e.g. --lora.dropout 0.05.")
    if lora.target_modules and not lora.rank:
        raise ValueError("--lora.target_modules needs LoRA on: pass --lora.rank R (e.g. 8) too, or drop it.")


def describe(lora: LoraHParams) -> str:
    """The --lora.* settings in one line for the start-up table."""
    targets = " ".join(lora.target_modules) or "peft's default for the architecture"
    return f"rank {lora.rank}, alpha {lora.alpha:g}, dropout {lora.dropout:g}, on {targets}"


def target_modules(lm: PreTrainedModel, names: tuple[str, ...] | list[str]) -> list[str]:
    """The module names LoRA adapts in `lm`: `names`, or peft's default for the model type; ValueError naming
    --lora.target_modules when a name matches no module or peft has no default."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    linear = [n for n, m in lm.named_modules() if isinstance(m, (nn.Linear, Conv1D))]
    layer_names = sorted({n.rsplit(".", 1)[-1] for n in linear})
    model_type = lm.config.model_type
    if not names:
        names = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type) or ()
        if not names:
            raise ValueError(
                f"peft has no default LoRA target modules for model type '{model_type}'; pass --lora.target_modules "
                f"with some of its linear layers: {' '.join(layer_names)}."
            )
    missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        raise ValueError(
            f"--lora.target_modules {' '.join(missing)}: no such linear layer in the base model ({model_type}); pass "
            f"some of its linear layers: {' '.join(layer_names)}, or leave the flag out for peft's default."
        )
    embedding = lm.get_input_embeddings().weight
    tied = [
        n for n, m in lm.named_modules() if getattr(m, "weight", None) is embedding and n.rsplit(".", 1)[-1] in names
    ]
    if tied:
        raise ValueError(
            f"--lora.target_modules {tied[0]}: that layer shares its weight with the token embeddings, so merging an "
            "adapter into it would change the embeddings too; pass other layers (e.g. the attention projections)."
        )
    return list(names)


# ---------------------------------------------------------------- the adapted policy


class GradientDropout(nn.Dropout):
    """Dropout only in forwards that record gradients (the PPO loss): sampling, scoring and the reference see none,
    as the project keeps every model in eval mode (spec G7)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, training=torch.is_grad_enabled())


def apply_lora(policy: nn.Module, lora: LoraHParams, base_model: str) -> None:
    """Wrap `policy.lm` with peft LoRA adapters in place (B = 0: the policy is unchanged); only the adapters and the
    value head keep requires_grad. `base_model` (the --base_model) is recorded in the saved adapter config."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ValueError(
            "--lora.rank needs the peft library: pip install 'lm-human-preference-details[lora]' (or peft)."
        ) from e

    lm = policy.lm
    targets = target_modules(lm, lora.target_modules)
    conv1d = any(isinstance(m, Conv1D) for n, m in lm.named_modules() if n.rsplit(".", 1)[-1] in targets)
    local = os.path.isdir(os.path.expanduser(base_model))
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        fan_in_fan_out=conv1d,  # GPT-2's Conv1D stores its weight transposed
        bias="none",
        task_type="CAUSAL_LM",
    )
    with _quiet_peft():
        peft_model = get_peft_model(lm, config)  # injects the adapters into `lm` and freezes its base weights
    base = os.path.abspath(os.path.expanduser(base_model)) if local else base_model
    peft_model.peft_config["default"].base_model_name_or_path = base  # what the saved adapters load onto
    for module in lm.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if isinstance(dropouts, nn.ModuleDict):
            for name, dropout in dropouts.items():
                if isinstance(dropout, nn.Dropout):
                    dropouts[name] = GradientDropout(dropout.p)
    # the wrapper, outside the module tree (its modules are `lm`'s): for disabling the adapters, saving, merging
    policy.__dict__["peft_model"] = peft_model


def peft_model_of(policy: nn.Module):
    """The peft wrapper of a policy with LoRA adapters, None for a fully fine-tuned one."""
    return policy.__dict__.get("peft_model")


@contextmanager
def adapters_disabled(policy: nn.Module) -> Iterator[nn.Module]:
    """Within this block `policy` computes with its base weights only (peft's `disable_adapter`)."""
    with peft_model_of(policy).disable_adapter():
        yield policy


class ReferencePolicy:
    """The frozen reference policy: a copy of the initial policy, or under LoRA the policy itself with its adapters
    disabled (the base weights are frozen, so that is the initial policy without a second copy)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        self.copy = None if peft_model_of(policy) else copy.deepcopy(policy).requires_grad_(False)

    @contextmanager
    def __call__(self) -> Iterator[nn.Module]:
        """The reference policy, for the duration of the block."""
        if self.copy is not None:
            yield self.copy
        else:
            with adapters_disabled(self.policy) as policy:
                yield policy


# ---------------------------------------------------------------- saving and loading


def merged_lm(policy: nn.Module) -> PreTrainedModel:
    """A copy of the policy's LM with the adapters merged into the base weights: a plain transformers model."""
    with _quiet_peft():
        return copy.deepcopy(peft_model_of(policy)).merge_and_unload()


def save_policy(policy: nn.Module, tokenizer: PreTrainedTokenizerBase | None, output_dir: str) -> None:
    """The merged model as `PolicyWithValueHead.save` writes a policy (plain transformers loads it), and in
    OUTPUT_DIR/adapter the adapters in peft's format with the value head and tokenizer."""
    merged = type(policy)(merged_lm(policy))  # a PolicyWithValueHead (whose module imports this one)
    merged.value_head.load_state_dict(policy.value_head.state_dict())
    merged.save(output_dir, tokenizer)
    adapter_dir = os.path.join(output_dir, ADAPTER_DIR)
    peft_model_of(policy).save_pretrained(adapter_dir)
    os.remove(os.path.join(adapter_dir, "README.md"))  # peft's model card template
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path) and name not in MERGED_ONLY_FILES:
            shutil.copy2(path, os.path.join(adapter_dir, name))


def adapter_base_model(directory: str, flag: str) -> str:
    """The base model that a peft adapter directory adapts (its adapter_config.json); ValueError when it names none."""
    with open(os.path.join(directory, ADAPTER_CONFIG), encoding="utf-8") as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"adapter directory '{directory}' ({flag}) names no base model (base_model_name_or_path in "
            f"{ADAPTER_CONFIG}); set it there, or pass the directory of a merged model."
        )
    return base


def merge_adapters(base: PreTrainedModel, directory: str) -> PreTrainedModel:
    """`base` with the peft adapters of `directory` merged into its weights: a plain transformers model."""
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(base, directory).merge_and_unload().eval()
