"""Several processes as one run: the accelerator and its launch check, gradients averaged over processes
(all-reduces overlapped with the backward), rank 0's weights broadcast at the start."""

import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

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


BUCKET_BYTES = 25 * 2**20
"""Gradient bytes per all-reduce bucket (DDP's default): large enough for full bandwidth, small enough to overlap."""


class GradientAverager:
    """Averages `.grad` over all processes (spec O4), the all-reduces overlapped with the backward that completes them.

    Gradients are grouped into buckets of about BUCKET_BYTES (one dtype each, in reverse parameter order, the order in
    which the backward produces them). During a backward armed by `launch_in_next_backward` (the last micro-batch's),
    post-accumulate-grad hooks start each bucket's asynchronous all-reduce as soon as all its gradients are complete;
    buckets start in bucket order on every process, so the collectives line up. `average` starts the buckets the
    backward did not complete (gradients that never arrived count as zeros and stay None), waits for all of them and
    divides the sums in place: each `.grad` is then a view of its bucket's buffer, which holds the mean. A single
    process registers no hook and does nothing.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], accelerator: Any, bucket_bytes: int | None = None):
        """`bucket_bytes`: the size of a bucket (None: BUCKET_BYTES)."""
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        self.world_size = accelerator.num_processes
        self.buckets: list[list[torch.nn.Parameter]] = []
        self.hooks: list[Any] = []
        if self.world_size == 1:
            return
        trainable = [p for p in reversed(list(params)) if p.requires_grad]
        for dtype in dict.fromkeys(p.dtype for p in trainable):
            bucket, size = [], 0
            for p in (p for p in trainable if p.dtype == dtype):
                if bucket and size + p.numel() * p.element_size() > bucket_bytes:
                    self.buckets.append(bucket)
                    bucket, size = [], 0
                bucket.append(p)
                size += p.numel() * p.element_size()
            self.buckets.append(bucket)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.hooks = [p.register_post_accumulate_grad_hook(self._gradient_ready) for b in self.buckets for p in b]
        self._reset()

    def _reset(self) -> None:
        """Disarmed, nothing in flight."""
        self.armed = False
        self.missing = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self.in_flight: list[tuple[torch.Tensor, Any]] = []  # (flat bucket, all-reduce work), in bucket order

    def launch_in_next_backward(self) -> None:
        """Start the all-reduces during the next backward (the last one before `average`)."""
        self.armed = self.world_size > 1

    def _gradient_ready(self, param: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: count `param` in; start every complete bucket whose predecessors have started."""
        if not self.armed:
            return
        self.missing[self.bucket_of[id(param)]] -= 1
        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
            self._launch(len(self.in_flight))

    def _launch(self, index: int) -> None:
        """Start the asynchronous sum of bucket `index` over processes, in place in one flat buffer: the bucket's
        gradients are copied into it and then are views of it, so the old ones are freed and no second copy of the
        gradients builds up while the all-reduces run."""
        bucket = self.buckets[index]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        for p, chunk in zip(bucket, flat.split([p.numel() for p in bucket])):
            if p.grad is not None:
                p.grad = chunk.view_as(p)
        self.in_flight.append((flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))

    @torch.no_grad()
    def average(self) -> None:
        """Start the buckets not started yet, wait for every all-reduce, write the means into `.grad`."""
        # OAI averages gradients over MPI ranks (allreduce-sum, then times 1 / size) before the Adam update
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L485-L489
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L626
        if self.world_size == 1:
            return
        for index in range(len(self.in_flight), len(self.buckets)):
            self._launch(index)
        for flat, work in self.in_flight:
            work.wait()  # on GPUs: the current stream waits for the all-reduce, the host does not
            flat.div_(self.world_size)  # the bucket's gradients are views of `flat`
        self._reset()

    def close(self) -> None:
        """Remove the hooks."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


def broadcast_parameters(module: torch.nn.Module, accelerator: Any) -> None:
    """Overwrite every rank's parameters with rank 0's, so all ranks start from identical weights."""
    # OAI loads checkpoints on rank 0, then broadcasts all variables to the other ranks
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L482-L485
    params = list(module.parameters())
    if accelerator.num_processes == 1 or not params:
        return
    with torch.no_grad():
        _coalesced(params, lambda flat: dist.broadcast(flat, src=0))
