"""Several processes as one run: the accelerator and its launch check, rank 0's weights broadcast at the start, and
PyTorch's engines for the rest: DistributedDataParallel averages the gradients over processes, or FSDP2 shards the
trained model over them (`--fsdp`)."""

import contextlib
import inspect
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

DIST_TIMEOUT = 1800.0
"""Seconds a process waits in a collective for the others before it stops with an error (torch's gloo default)."""


WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
"""Where torchrun and MPI launchers put the number of processes (accelerate reads the same variables)."""


def check_launch(environ: Mapping[str, str], script: str) -> None:
    """ValueError when `accelerate launch` was asked for several processes but started one (its CPU launcher does).

    accelerate's one-process launcher (taken with --cpu, or without --multi_gpu and GPUs) marks the process with
    ACCELERATE_USE_CPU and sets MASTER_PORT only when --num_processes or --num_machines is above 1; torchrun and MPI
    set a world size instead.
    """
    if "ACCELERATE_USE_CPU" not in environ or "MASTER_PORT" not in environ:
        return
    if any(int(environ.get(name) or 1) > 1 for name in WORLD_SIZE_VARS):
        return
    raise ValueError(
        "accelerate launch started 1 process, not the --num_processes asked for (it does so with --cpu, or without "
        f"--multi_gpu): on CPU run `torchrun --nproc_per_node N {script} ...` instead, on GPUs `accelerate launch "
        f"--multi_gpu --num_processes N {script} ...` (a one-process run needs MASTER_PORT unset)"
    )


def check_gpus_per_process(environ: Mapping[str, str]) -> None:
    """ValueError when a run on GPUs starts more processes on this machine than it has GPUs: two processes on one GPU
    otherwise stop deep in NCCL ("Duplicate GPU detected"). Runs on CPU (no GPU visible, or accelerate's --cpu) pass.

    torchrun (and accelerate launch --multi_gpu, which uses it) and MPI put the processes per machine in
    LOCAL_WORLD_SIZE and its MPI counterparts (accelerate reads the same variables).
    """
    local_sizes = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
    processes = max(int(environ.get(name) or 1) for name in local_sizes)
    on_cpu = environ.get("ACCELERATE_USE_CPU", "").lower() in ("y", "yes", "t", "true", "on", "1")
    if processes <= 1 or on_cpu or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if processes > gpus:
        raise ValueError(
            f"{processes} processes on this machine (LOCAL_WORLD_SIZE) but {gpus} GPU(s) visible "
            f"(torch.cuda.device_count()): start at most {gpus} per machine (torchrun --nproc_per_node {gpus}, "
            f"accelerate launch --num_processes {gpus}), or run on CPU with the GPUs hidden (CUDA_VISIBLE_DEVICES=)"
        )


def make_accelerator(timeout: float = DIST_TIMEOUT) -> Accelerator:
    """An Accelerator that also runs several CPU processes (gloo) when torchrun/accelerate start them without GPUs.

    A collective (all-reduce, broadcast, barrier) that waits more than `timeout` seconds for another process raises
    instead of hanging: this bounds the wait when a process or node stalls without exiting (one that exits is
    noticed at once: torchrun stops the others, gloo reports the closed connection).
    """
    check_launch(os.environ, os.path.basename(sys.argv[0]))
    check_gpus_per_process(os.environ)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--dist_timeout must be a positive number of seconds (got {timeout})")
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handler = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))
    # accelerate passes on only the fields that differ from its defaults (600 s): pass the timeout whatever its value
    handler.to_kwargs = lambda: {"timeout": handler.timeout}
    return Accelerator(cpu=multi_process and not torch.cuda.is_available(), kwargs_handlers=[handler])


def _coalesced(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Run `collective` in place on one flat buffer per dtype, then copy the results back into `tensors`."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        collective(flat)
        chunks = flat.split([t.numel() for t in group])
        torch._foreach_copy_(group, [chunk.view_as(t) for chunk, t in zip(chunks, group)])


_DDP_ARGUMENTS = inspect.signature(DistributedDataParallel).parameters


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks inside `module` (of every Hugging Face model in it): the classes its models name in
    `_no_split_modules` (GPT2Block, LlamaDecoderLayer, GPTNeoXLayer, ...), the unit FSDP2 shards and gathers."""
    names = {name for m in module.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    return [m for m in module.modules() if type(m).__name__ in names]


def data_parallel(module: torch.nn.Module, accelerator: Any, fsdp: bool = False) -> torch.nn.Module:
    """The module that training forwards run through, so that each optimizer step sees the mean of every process's
    gradients (spec O4): `module` itself in one process; else torch's DistributedDataParallel around it, or with
    `fsdp` the module itself sharded in place by FSDP2, each transformer block its own unit (`fully_shard`: its
    parameters become DTensors, each process holding 1/N of every weight, gradient and optimizer moment).

    Every process must hold rank 0's weights already (`broadcast_parameters`): DDP skips its own initial broadcast.
    Its gradients are views of its all-reduce buckets (clear them with `clear_gradients`, not `set_to_none`)."""
    if accelerator.num_processes == 1:
        return module
    if fsdp:
        _shard_in_place(module)
        return module
    device = accelerator.device
    # no trained buffers, nothing to broadcast at each forward (torch 2.13 renamed the argument)
    sync_buffers = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGUMENTS else "broadcast_buffers"
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        init_sync=False,
        gradient_as_bucket_view=True,  # the gradients are the buckets: no second gradient-sized copy
        **{sync_buffers: False},
    )


def _shard_in_place(module: torch.nn.Module) -> None:
    """FSDP2 on each transformer block of `module`, then on `module` (the root: its other weights)."""
    for block in transformer_blocks(module):
        fully_shard(block)
    # FSDP2 shards along dim 0: a 0-dim parameter (a reward model's gain and bias) stays whole on every process,
    # its gradient averaged by `averaging_gradients`
    fully_shard(module, ignored_params=set(replicated_parameters(module)) or None)
    # FSDP2 takes the first unit to run as its root; the rollout runs blocks without the root's forward
    fully_shard.state(module)._lazy_init()


def shard_frozen(module: torch.nn.Module, accelerator: Any) -> None:
    """`--fsdp` for a model that only scores (the reference policy, a reward model): sharded in place like the trained
    one, each process holding 1/N of its weights; each forward gathers one block at a time (`gathered` for many
    forwards, as sampling runs). One process: nothing."""
    if accelerator.num_processes > 1:
        _shard_in_place(module)
        # FSDP2 keeps a root's weights gathered after its forward, for the backward; a frozen model has none
        module.set_reshard_after_forward(True, recurse=False)


@contextlib.contextmanager
def averaging_gradients(trained: torch.nn.Module, average: bool) -> Iterator[None]:
    """Around a micro-batch's forward and backward through `trained` (from `data_parallel`): with `average` (the
    step's last micro-batch) its backward averages the accumulated gradients over processes, overlapped with it in
    DDP's buckets; without, DDP's gradients only accumulate in this process. FSDP2 reduce-scatters every micro-batch's
    gradients into the shards (their sum is the average of the accumulated ones): skipping it would accumulate whole,
    unsharded gradients, the memory that --fsdp is there to save."""
    if isinstance(trained, DistributedDataParallel) and not average:
        with trained.no_sync():
            yield
        return
    yield
    if isinstance(trained, FSDPModule) and average:
        grads = [p.grad for p in replicated_parameters(trained) if p.grad is not None]
        if grads:
            _coalesced(grads, lambda flat: dist.all_reduce(flat.div_(dist.get_world_size())))


def replicated_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 0-dim parameters of `module` (a reward model's gain and bias): FSDP2 cannot shard them, so `data_parallel`
    leaves them whole on every process, and `averaging_gradients` averages their gradients by an all-reduce."""
    return [p for p in module.parameters() if p.dim() == 0]


def clear_gradients(optimizer: torch.optim.Optimizer, trained: torch.nn.Module) -> None:
    """`optimizer.zero_grad()` after its step: the gradients freed (None), except DDP's, views of its all-reduce
    buckets, which are zeroed in place so that they stay the buckets (0 + g is g: the next step is the same)."""
    optimizer.zero_grad(set_to_none=not isinstance(trained, DistributedDataParallel))


def _fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units inside `module` (its transformer blocks and itself when sharded), in module order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp_hooks_detached(units: list[torch.nn.Module]) -> Iterator[None]:
    """Inside, the forward hooks that FSDP2 registered on `units` are detached (the units' other hooks stay): a forward
    runs the module's own code only. FSDP2's pre-forward hook would otherwise gather the unit again and, as no root
    forward ran, act as the iteration's root and make its all-gather streams wait on the current stream, which inside
    a CUDA graph capture forks them into the capture without a join (cudaErrorStreamCaptureUnjoined)."""
    detached = []
    for unit in units:
        state = fully_shard.state(unit)
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(unit, name)
            kept = type(hooks)(
                (key, hook) for key, hook in hooks.items() if getattr(hook, "__self__", None) is not state
            )
            setattr(unit, name, kept)
            detached.append((unit, name, hooks))
    try:
        yield
    finally:
        for unit, name, hooks in detached:
            setattr(unit, name, hooks)


@contextlib.contextmanager
def gathered(module: torch.nn.Module) -> Iterator[None]:
    """Inside, an FSDP2-sharded `module` holds every weight whole and runs as a plain module: each unit all-gathered
    once, not again at every forward (a rollout's decoding steps call the trunk once per token), with FSDP2's forward
    hooks detached, so that no FSDP2 code runs in its forwards (nor in a decoding step captured as a CUDA graph); then
    sharded again. Forwards inside record no gradients (the shards would not receive them). Unsharded: `no_grad`."""
    units = _fsdp_units(module)
    for unit in units:
        unit.unshard()
    try:
        with torch.no_grad(), _fsdp_hooks_detached(units):
            yield
    finally:
        for unit in units:
            unit.reshard()


def hold_gathered_weights(trained: torch.nn.Module, module: torch.nn.Module) -> int:
    """Keep the gathered (whole) weights of `module`'s parameters, sharded inside `trained` by FSDP2, allocated for
    the rest of the run; -> their bytes. FSDP2 frees a unit's gathered weights whenever it shards it again and
    allocates them anew at its next gather, elsewhere in memory: a decoding step captured as a CUDA graph on them
    (--compile_sampler) would then be captured again at every update (a new KV cache, warm-up steps, a capture and a
    device sync each). Held, every gather writes the same addresses and the graph replays on the new weights. The
    cost: 4 bytes per parameter of `module` (float32), held while the run trains rather than during the rollout and,
    in the PPO passes, a unit at a time."""
    wanted = {id(p) for p in module.parameters()}
    held = 0
    for unit in _fsdp_units(trained):
        for group in fully_shard.state(unit)._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if id(fsdp_param.sharded_param) in wanted:
                    # FSDP2 frees the gathered storage through this method only (to_sharded, to_sharded_post_forward)
                    fsdp_param.free_unsharded_param = _keep_gathered_storage
                    held += fsdp_param.sharded_param.numel() * fsdp_param.sharded_param.element_size()  # whole
    return held


def _keep_gathered_storage() -> None:
    """`hold_gathered_weights`'s stand-in for an FSDP2 parameter's `free_unsharded_param`: the storage stays."""


def broadcast_parameters(module: torch.nn.Module, accelerator: Any) -> None:
    """Overwrite every rank's parameters with rank 0's, so all ranks start from identical weights."""
    # OAI loads checkpoints on rank 0, then broadcasts all variables to the other ranks
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L482-L485
    params = list(module.parameters())
    if accelerator.num_processes == 1 or not params:
        return
    with torch.no_grad():
        _coalesced(params, lambda flat: dist.broadcast(flat, src=0))
