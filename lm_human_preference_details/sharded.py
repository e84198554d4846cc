"""Checkpoints of a model sharded by FSDP2 (`--fsdp`), on torch.distributed.checkpoint: every process writes its own
shards of the weights and optimizer moments into one directory, and a run with any number of processes reads them
back (DCP reshards on load); the whole weights, gathered onto process 0, for a Hugging Face directory."""

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

SHARDED_DIR = "sharded"
"""subdirectory of a training-state checkpoint with the sharded weights and optimizer state (DCP's files)"""


def is_sharded(module: torch.nn.Module | None) -> bool:
    """Whether `module` was sharded by FSDP2 (`distributed.data_parallel(..., fsdp=True)` with several processes)."""
    return isinstance(module, FSDPModule)


def _state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The sharded weights and optimizer state of `module` (DTensors: this process's shards), under stable names."""
    return {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}


def save(directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write `module`'s weights and `optimizer`'s state into `directory`/sharded, each process its own shards; every
    process must call it (`directory` on a filesystem that every process sees)."""
    dcp.save(_state(module, optimizer), checkpoint_id=os.path.join(directory, SHARDED_DIR))


def load(directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read back what `save` wrote, whatever the number of processes that wrote it; every process must call it."""
    state = _state(module, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(directory, SHARDED_DIR))
    set_model_state_dict(module, state["model"])
    set_optimizer_state_dict(module, optimizer, state["optimizer"])


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s whole weights in host memory on process 0 (an empty dict elsewhere), under the names of the
    unsharded module's state_dict; every process must call it (each unit is gathered in turn)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded_checkpoint(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint (its checkpoint.json) holds its weights as an --fsdp run's shards, which a run with any
    number of processes reads back."""
    return any(name.startswith(SHARDED_DIR + "/") for name in meta.get("files") or {})
