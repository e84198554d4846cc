"""Small numerics and plumbing shared by the training scripts: sizes, whitening, seeding, sync, logging."""

import dataclasses
import errno
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import wandb
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from torch.utils.tensorboard import SummaryWriter

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


def make_accelerator(timeout: float = DIST_TIMEOUT) -> Accelerator:
    """An Accelerator that also runs several CPU processes (gloo) when torchrun/accelerate start them without GPUs.

    A collective (all-reduce, broadcast, barrier) that waits more than `timeout` seconds for another process raises
    instead of hanging: this bounds the wait when a process or node stalls without exiting (one that exits is
    noticed at once: torchrun stops the others, gloo reports the closed connection).
    """
    check_launch(os.environ, os.path.basename(sys.argv[0]))
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"--dist_timeout must be a positive number of seconds (got {timeout})")
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handler = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout))
    # accelerate passes on only the fields that differ from its defaults (600 s): pass the timeout whatever its value
    handler.to_kwargs = lambda: {"timeout": handler.timeout}
    return Accelerator(cpu=multi_process and not torch.cuda.is_available(), kwargs_handlers=[handler])


def tf32_matmuls() -> bool:
    """Whether torch runs float32 matmuls (cuBLAS) in TF32: the per-backend precision that the kernels read. Every way
    of setting TF32 updates it (the legacy `allow_tf32` flag, `set_float32_matmul_precision`, the per-backend API)
    and reading it never raises; the legacy getters raise once both APIs have been used (torch >= 2.9)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def use_tf32(enabled: bool) -> str:
    """--tf32: float32 matmuls (cuBLAS) and convolutions (cuDNN) in TF32 when `enabled`; off: torch's settings are
    left as they are, and ValueError when torch's matmuls are in TF32 all the same (accelerate turns TF32 on for a
    config with a dynamo backend and no mixed precision). -> the start-up table's entry: what torch will do."""
    if enabled:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    elif tf32_matmuls():
        # refused rather than warned: the run would record tf32=false in args.json and its checkpoints, and say
        # "full float32" in its table, while computing in TF32
        raise ValueError(
            "float32 matmuls run in TF32 (torch.backends.cuda.matmul.fp32_precision is 'tf32') although --tf32 is "
            "not given: something set it before the run, such as accelerate for a config with a dynamo_backend and "
            "no mixed precision. Pass --tf32 to train in TF32, or set dynamo_backend: 'NO' in the accelerate config "
            "(ACCELERATE_DYNAMO_BACKEND=NO) to train in full float32 as OAI did."
        )
    return "on (matmuls in TF32: relative errors up to ~1e-3)" if tf32_matmuls() else "off (full float32, as OAI)"


CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""CUBLAS_WORKSPACE_CONFIG values under which cuBLAS is deterministic (its workspace is not shared between streams)"""


def use_deterministic(enabled: bool) -> None:
    """--deterministic: torch's deterministic algorithms (an operator without one raises), a deterministic cuBLAS
    workspace (set before the first cuBLAS call, i.e. before the models run) and no cuDNN benchmarking; off: torch's
    settings are left as they are."""
    if enabled:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def describe_deterministic() -> str:
    """The start-up table's entry for --deterministic: whether torch will use deterministic algorithms."""
    if torch.are_deterministic_algorithms_enabled():
        return "on (deterministic GPU kernels: a resumed run equals the uninterrupted one on the same GPU model)"
    return "off (GPU kernels may sum in another order from run to run: close, not bit for bit)"


def exact_div(a: int, b: int, what: str) -> int:
    """a // b, raising ValueError when b does not divide a (OAI derives every per-rank size this way)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L116-L124
    if b == 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}; choose sizes so that {a} is a multiple of {b}.")
    return a // b


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L127-L128
    return -(-a // b)


def run_name(accelerator: Accelerator, *parts: Any) -> str:
    """`part1__part2__...__<unix time>`, from rank 0's clock on every process (one name for one run)."""
    name = "__".join([*map(str, parts), str(int(time.time()))])
    return broadcast_object_list([name])[0] if accelerator.num_processes > 1 else name


class OutputError(OSError):
    """An output cannot be written (no permission, read-only, disk full); nothing partial was left behind."""


def write_atomic(path: str, write: Callable[[Any], None], flag: str = "the output") -> None:
    """`write(file)` into `path` through a temporary file and a rename, so readers never see a half-written file; on
    failure (e.g. disk full) the temporary file is removed, `path` is unchanged, and OutputError says why."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = "disk full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise OutputError(f"could not write '{path}' ({flag}): {reason}; it is unchanged. Free space or fix it.") from e


def write_json_atomic(path: str, obj: Any) -> None:
    """json.dump to `path` through a temporary file and a rename, so readers never see a half-written file."""
    write_atomic(path, lambda f: json.dump(obj, f, indent=2))


def save_args(args: Any, output_dir: str) -> None:
    """The run's settings (a dataclass) as `output_dir/args.json`."""
    write_json_atomic(os.path.join(output_dir, "args.json"), dataclasses.asdict(args))


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's legacy global RNG and torch (CPU and all GPUs)."""
    # OAI seeds NumPy's global RNG with seed + rank * 100003 (the caller adds the rank offset)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table, which TensorBoard's text plugin renders."""
    lines = ["|" + "|".join(str(c) for c in columns) + "|", "|" + "|".join("-" for _ in columns) + "|"]
    lines += ["|" + "|".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + "|" for row in rows]
    return "\n".join(lines)


EVENT_FILE_PREFIX = "events.out.tfevents."
"""TensorBoard event files are named events.out.tfevents.SECOND.HOST.PID.N, SECOND being when the file was opened"""


def wait_past_earlier_event_files(log_dir: str) -> None:
    """Sleep until the clock is past the second in which the newest event file of `log_dir` was opened.

    TensorBoard reads a directory's event files in name order, and the first field of a name is that second: a resumed
    run's file opened within the same second as the killed run's could sort first (by host or pid), and the killed
    run's points would then purge the resumed run's instead of the reverse.
    """
    if not os.path.isdir(log_dir):
        return
    names = [name for name in os.listdir(log_dir) if name.startswith(EVENT_FILE_PREFIX)]
    fields = [name[len(EVENT_FILE_PREFIX) :].split(".", 1)[0] for name in names]
    seconds = [int(field) for field in fields if field.isdigit()]
    if seconds and (wait := max(seconds) + 1 - time.time()) > 0:
        time.sleep(wait)


class Tracker:
    """TensorBoard logging under output_dir/tb, plus Weights & Biases when `track`; a no-op on non-main processes."""

    def __init__(
        self,
        output_dir: str,
        track: bool,
        project: str,
        entity: str | None,
        run_name: str,
        config: dict[str, Any],
        is_main: bool,
        purge_step: int = 0,
        wandb_id: str | None = None,
    ) -> None:
        """`purge_step`: the first step this run logs; TensorBoard hides the points an earlier (killed) run logged from
        there on. `wandb_id`: the wandb run to continue (resume="allow"), else a new one."""
        self.writer: SummaryWriter | None = None
        self.run: Any = None
        self.wandb_id = wandb_id
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        if track:
            self.run = wandb.init(
                project=project,
                entity=entity,
                name=run_name,
                config=config,
                dir=output_dir,
                sync_tensorboard=False,
                id=wandb_id,
                resume="allow",
            )
            self.wandb_id = self.run.id
        wait_past_earlier_event_files(os.path.join(output_dir, "tb"))  # this run's points sort after a killed run's
        self.writer = SummaryWriter(os.path.join(output_dir, "tb"), purge_step=purge_step)
        if purge_step == 0:
            self.writer.add_text("hyperparameters", _markdown_table(["param", "value"], sorted(config.items())))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalars at `step`."""
        if self.writer is None:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Log a table: a wandb.Table, and a markdown text entry in TensorBoard."""
        if self.writer is None:
            return
        self.writer.add_text(key, _markdown_table(columns, rows), step)
        if self.run is not None:
            self.run.log({key: wandb.Table(columns=columns, rows=rows)}, step=step)

    def flush(self) -> None:
        """Write the logged points to disk (before a checkpoint, so a kill loses none logged before it)."""
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        """Flush and close the writers."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.run is not None:
            self.run.finish()
            self.run = None
