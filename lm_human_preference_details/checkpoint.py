"""Resumable runs: atomic checkpoint directories, every process's training state, checks of the run settings.

A training-state checkpoint is OUTPUT_DIR/training_state/step{N} (N = updates or reward steps done). It is written in
a temporary sibling directory, fsync'ed, then renamed into place, so a kill at any moment leaves the previous
checkpoints whole and never a mixed one. It holds:
- checkpoint.json: the step, the run settings (args and world size), the run name and wandb id (rank 0);
- state.pt: weights, optimizer state and the script's other counters (rank 0; identical on every process);
- rng_rank{r}.pt: process r's query-stream position and RNG states (Python, NumPy, torch, the CUDA generator of
  process r's own GPU, the sampler's generator, extra NumPy RandomStates).
The final model at the top of OUTPUT_DIR keeps its usual layout; its files are written aside and each moved into place
by a rename, under a marker file that the project's loaders refuse, so a half-replaced model is never loaded silently.
"""

import contextlib
import copy
import dataclasses
import json
import os
import random
import re
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list
from torch.overrides import TorchFunctionMode

STATE_DIR = "training_state"
"""subdirectory of OUTPUT_DIR that holds the training-state checkpoints"""
META_FILE = "checkpoint.json"
SHARED_FILE = "state.pt"
RANK_FILE = "rng_rank{rank}.pt"
SAVING_MARKER = ".saving"
"""present in a model directory while its files are being replaced; the project's loaders refuse such a directory"""
MODEL_MARKERS = ("config.json", "model.safetensors", "reward_model.json", "value_head.safetensors")
"""files that show a directory already holds a saved model"""
RESUME_IGNORED = (
    "exp_name",
    "output_dir",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "dist_timeout",
    "save_interval",
    "keep_checkpoints",
    "dry_run",
    "resume",
    "allow_resume_changes",
    "overwrite_output_dir",
    # the truncation token's name: the settings hold its resolved id, task.truncate_token, which is compared (and
    # checkpoints written before truncate_text record the id alone)
    "task.truncate_text",
)
"""settings of both scripts that may change on --resume: naming, logging, saving and waiting, not what is computed"""
_STEP_DIR = re.compile(r"^step(\d+)$")
T = TypeVar("T")


# ---------------------------------------------------------------- atomic writes


def fsync_tree(path: str) -> None:
    """fsync every file and directory under `path` (and `path` itself), so a rename after it publishes whole files."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    """fsync a directory's entries (no-op where directories cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temporary_sibling(path: str, tag: str) -> str:
    """`.NAME.TAG` beside `path`: on the same filesystem, so that a rename moves it into place atomically."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{tag}")


def publish_directory(tmp: str, path: str) -> None:
    """fsync `tmp`, then rename it to `path` (an existing `path` is moved aside first and deleted after)."""
    fsync_tree(tmp)
    old = _temporary_sibling(path, "old")
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_files(output_dir: str) -> Iterator[str]:
    """Yield a temporary directory; its entries then replace those of `output_dir` one rename each, under
    SAVING_MARKER, so no file is ever half written and a kill between two renames leaves a marked directory; on an
    error in the block the temporary directory is deleted and `output_dir` is left as it was."""
    os.makedirs(output_dir, exist_ok=True)
    tmp = os.path.join(output_dir, ".partial-save")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_tree(tmp)
    marker = os.path.join(output_dir, SAVING_MARKER)
    with open(marker, "w", encoding="utf-8") as f:
        f.write("a save of this model was interrupted; its files may come from two saves\n")
        os.fsync(f.fileno())
    _fsync_dir(output_dir)
    for name in sorted(os.listdir(tmp)):
        source, target = os.path.join(tmp, name), os.path.join(output_dir, name)
        if os.path.isdir(source):
            publish_directory(source, target)
        else:
            os.replace(source, target)
    _fsync_dir(output_dir)
    os.remove(marker)
    _fsync_dir(output_dir)
    shutil.rmtree(tmp, ignore_errors=True)


def check_complete_save(directory: str, flag: str) -> None:
    """ValueError when `directory` holds a model whose save was interrupted (SAVING_MARKER is present)."""
    if os.path.exists(os.path.join(directory, SAVING_MARKER)):
        raise ValueError(
            f"'{directory}' ({flag}) holds a model whose save was interrupted, so its files may come from two saves; "
            f"rerun the training script with --resume auto to write it again, or use a checkpoint of "
            f"{os.path.join(directory, STATE_DIR)}."
        )


# ---------------------------------------------------------------- RNG states


def _numpy_state(state: tuple) -> tuple:
    """A NumPy legacy RNG state with its key array as a tensor (loadable with torch.load(weights_only=True))."""
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _numpy_state_back(state: Sequence) -> tuple:
    """Inverse of `_numpy_state`."""
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def rng_states(generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()) -> dict[str, Any]:
    """This process's RNG states: Python, NumPy global, torch CPU, its own GPU's (the current device; None without
    CUDA), the sampling generator, `numpy_rngs`."""
    # only this process's GPU: a run saved with 8 GPUs visible to each process resumes where each sees 1 (a scheduler)
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "generator": generator.get_state(),
        "numpy_rngs": [_numpy_state(rng.get_state()) for rng in numpy_rngs],
    }


def restore_rng_states(
    states: dict[str, Any], generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()
) -> None:
    """Set every RNG back to `states` (from `rng_states`); the number of `numpy_rngs` must match."""
    if len(states["numpy_rngs"]) != len(numpy_rngs):
        raise ValueError(
            f"the checkpoint holds {len(states['numpy_rngs'])} NumPy RNG streams, this run has {len(numpy_rngs)}; "
            "resume with the checkpoint's batch sizes and number of processes."
        )
    random.setstate(states["python"])
    np.random.set_state(_numpy_state_back(states["numpy"]))
    torch.set_rng_state(states["torch"])
    if isinstance(states["cuda"], torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])  # onto the current device, whichever index it has now
    generator.set_state(states["generator"])
    for rng, state in zip(numpy_rngs, states["numpy_rngs"]):
        rng.set_state(_numpy_state_back(state))


# ---------------------------------------------------------------- training-state checkpoints


def state_dir(output_dir: str) -> str:
    """OUTPUT_DIR/training_state."""
    return os.path.join(output_dir, STATE_DIR)


def step_dir(output_dir: str, step: int) -> str:
    """The checkpoint directory of `step` completed updates/steps."""
    return os.path.join(state_dir(output_dir), f"step{step}")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in OUTPUT_DIR/training_state, oldest first."""
    root = state_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest checkpoint directory in OUTPUT_DIR/training_state, None when there is none."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def prune_checkpoints(output_dir: str, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (keep 0: delete none)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def to_host(obj: Any) -> Any:
    """`obj` (nested dicts, lists, tuples) with every tensor replaced by a copy in host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: to_host(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_host(value) for value in obj)
    return obj


def _host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of `tensor`'s shape and dtype, pinned when CUDA is there (faster copies from the GPU)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=torch.cuda.is_available())


class _NoTensorCopies(TorchFunctionMode):
    """Inside `copy.deepcopy`: a tensor not in the memo becomes an empty meta tensor of its shape (no memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__:
            return torch.empty(args[0].shape, dtype=args[0].dtype, device="meta")
        return func(*args, **(kwargs or {}))


def _host_twin(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` whose parameters and buffers are empty host tensors (ties kept, no gradients) and whose
    other tensors, wherever the module keeps them, are empty meta tensors."""
    memo: dict[int, Any] = {id(t): _host_tensor(t) for t in module.buffers()}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(_host_tensor(p), False)
    with _NoTensorCopies():
        return copy.deepcopy(module, memo)


class BackgroundSaves:
    """The main process's checkpoint writes, on a background thread from copies in host memory, so that training goes
    on while weights and Adam state reach the disk. One write at a time: a new save first waits for the previous
    one. A write's error is raised again in the training thread (`raise_error`, the next save, `wait`)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._host_modules: dict[int, torch.nn.Module] = {}

    def host_copy(self, module: torch.nn.Module) -> torch.nn.Module:
        """A twin of `module` in host memory holding its current parameters and buffers (made at the first call, then
        refilled); call it after `wait`, as the previous write may still read the twin.

        The twin holds the parameters and buffers only: a tensor the module keeps beside them (the sampler's KV cache
        in its `__dict__`, say) becomes an empty meta tensor in the twin, never a second copy on its device. With
        CUDA, the twin's tensors are pinned and the copies into them asynchronous, with one wait at the end."""
        twin = self._host_modules.get(id(module))
        if twin is None:
            twin = self._host_modules[id(module)] = _host_twin(module)
        copied = list(zip(twin.state_dict(keep_vars=True).values(), module.state_dict().values()))
        with torch.no_grad():
            for target, source in copied:
                target.copy_(source, non_blocking=True)
        if any(source.is_cuda for _, source in copied):
            torch.cuda.current_stream().synchronize()  # the copies are in host memory before the write reads them
        return twin

    def start(self, write: Callable[[], None]) -> None:
        """Wait for the previous write, then run `write` on the background thread."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(write,), name="checkpoint-writer")
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as e:  # handed to the training thread
            self._error = e

    def raise_error(self) -> None:
        """Raise the error of a write that failed (without waiting for one that is running)."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def wait(self) -> None:
        """Wait until the running write is on disk; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_error()


def save_training_state(
    output_dir: str,
    step: int,
    accelerator: Any,
    meta: dict[str, Any],
    shared: dict[str, Any] | None,
    local: dict[str, Any],
    keep: int,
    saves: BackgroundSaves | None = None,
    then: Callable[[], None] | None = None,
) -> str:
    """Write checkpoint `step` atomically: `meta` and `shared` from the main process, `local` from every process;
    then keep the newest `keep` and run `then` (the main process's other saves). Every process must call it.

    With `saves`, the main process writes `shared` (which must then be host copies, see `to_host`), publishes and
    runs `then` on the background thread, and the call returns once every process's `local` is written; without,
    it returns when everything is on disk. -> the checkpoint directory."""
    path = step_dir(output_dir, step)
    tmp = _temporary_sibling(path, "partial")
    if accelerator.is_main_process:
        if saves is not None:
            saves.wait()  # the previous checkpoint is whole before this one starts
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    os.makedirs(tmp, exist_ok=True)
    torch.save(local, os.path.join(tmp, RANK_FILE.format(rank=accelerator.process_index)))
    accelerator.wait_for_everyone()  # every process's file is in tmp
    if accelerator.is_main_process:
        meta = {**meta, "step": step, "world_size": accelerator.num_processes}

        def write() -> None:
            torch.save(shared, os.path.join(tmp, SHARED_FILE))
            with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
            publish_directory(tmp, path)
            prune_checkpoints(output_dir, keep)
            if then is not None:
                then()

        if saves is None:
            write()
        else:
            saves.start(write)
    if saves is None:
        accelerator.wait_for_everyone()
    return path


@dataclass
class Resumed:
    """A checkpoint loaded to continue a run."""

    path: str
    """its directory"""
    step: int
    """updates (policy) or reward steps done"""
    meta: dict[str, Any]
    """checkpoint.json: settings, run name, wandb id"""
    shared: dict[str, Any]
    """state.pt: weights, optimizer, counters"""
    local: dict[str, Any]
    """this process's rng_rank{r}.pt: query stream and RNG states"""


def load_training_state(path: str, rank: int) -> Resumed:
    """Read checkpoint `path` for process `rank`; FileNotFoundError naming what is missing."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"--resume '{path}' is not a checkpoint ('{META_FILE}' is missing); pass a directory of "
            f"OUTPUT_DIR/{STATE_DIR}/ or --resume auto."
        )
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    rank_path = os.path.join(path, RANK_FILE.format(rank=rank))
    if not os.path.isfile(rank_path):
        raise FileNotFoundError(
            f"checkpoint '{path}' has no state for process {rank} ('{os.path.basename(rank_path)}'): it was written by "
            f"{meta.get('world_size')} processes; resume with as many."
        )
    shared = torch.load(os.path.join(path, SHARED_FILE), map_location="cpu", weights_only=True)
    local = torch.load(rank_path, map_location="cpu", weights_only=True)
    return Resumed(path, int(meta["step"]), meta, shared, local)


# ---------------------------------------------------------------- run settings and the output directory


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as {"group.field": value}."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def setting_differences(
    saved: dict[str, Any], current: dict[str, Any], ignored: Sequence[str], defaults: dict[str, Any] | None = None
) -> dict[str, tuple]:
    """{name: (saved, current)} of every setting that differs, except those in `ignored` (dotted names) and those the
    saved settings predate (absent there) that `current` leaves at their value in `defaults`."""
    saved, current, defaults = _flatten(saved), _flatten(current), _flatten(defaults or {})
    missing = object()
    names = [k for k in dict.fromkeys([*saved, *current]) if k not in ignored]
    names = [k for k in names if k in saved or current.get(k) != defaults.get(k, missing)]
    # JSON turns tuples into lists: compare through it
    return {k: (saved.get(k), current.get(k)) for k in names if json.loads(json.dumps(saved.get(k))) != current.get(k)}


def check_resume_settings(
    resumed: Resumed,
    current: dict[str, Any],
    ignored: Sequence[str],
    allow: bool,
    defaults: dict[str, Any] | None = None,
) -> str | None:
    """ValueError listing the settings that differ from the checkpoint's, unless `allow`; -> the list (None: none).
    A setting newer than the checkpoint passes when the run leaves it at its value in `defaults` (what the code that
    wrote the checkpoint did)."""
    current, defaults = json.loads(json.dumps(current)), json.loads(json.dumps(defaults or {}))
    differences = setting_differences(resumed.meta["settings"], current, ignored, defaults)
    if not differences:
        return None
    listed = "; ".join(f"{name}: checkpoint {old!r}, now {new!r}" for name, (old, new) in differences.items())
    if not allow:
        raise ValueError(
            f"checkpoint '{resumed.path}' was written with other settings, so the run would not continue as it "
            f"started: {listed}. Pass the checkpoint's settings (see {os.path.join(resumed.path, META_FILE)}), or "
            "--allow_resume_changes to continue anyway."
        )
    return listed


def previous_run(output_dir: str) -> list[str]:
    """What in `output_dir` shows an earlier run: checkpoints, a saved model, TensorBoard logs."""
    found = [STATE_DIR] if list_checkpoints(output_dir) else []
    found += [name for name in (*MODEL_MARKERS, "tb") if os.path.exists(os.path.join(output_dir, name))]
    return found


def resolve_resume(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """The checkpoint directory to continue (--resume PATH, or `auto`: the newest in output_dir), None for a fresh
    start; ValueError when a fresh run would overwrite another run's output_dir without `overwrite`."""
    if resume == "auto":
        resume = latest_checkpoint(output_dir)
        if resume is None and set(previous_run(output_dir)) - {"tb"}:
            raise ValueError(
                f"--resume auto: '{output_dir}' holds a run ({', '.join(previous_run(output_dir))}) but no checkpoint "
                f"in {STATE_DIR}/; pass --overwrite_output_dir to start again there, or choose another --output_dir."
            )
    if resume is not None:
        if not os.path.isfile(os.path.join(resume, META_FILE)):
            raise FileNotFoundError(
                f"--resume '{resume}' is not a checkpoint ('{META_FILE}' is missing); pass a directory of "
                f"OUTPUT_DIR/{STATE_DIR}/ or --resume auto."
            )
        return resume
    found = previous_run(output_dir)
    if found and not overwrite:
        raise ValueError(
            f"--output_dir '{output_dir}' already holds another run ({', '.join(found)}); pass --resume auto to "
            "continue it, --overwrite_output_dir to replace it, or choose another --output_dir."
        )
    return None


def _distributed(accelerator: Any) -> bool:
    """Whether several processes share a process group (one process, or a test's pretended world: no)."""
    return accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()


def _decided_by_main_process(accelerator: Any, decide: Callable[[], T]) -> T:
    """`decide()` on process 0 only, its result given to every process; its ValueError or OSError is raised again
    on every process, so that all stop with the same line."""
    if not _distributed(accelerator):
        return decide()
    outcome: list[Any] = [None]
    if accelerator.is_main_process:
        try:
            outcome = [(True, decide())]
        except (ValueError, OSError) as e:
            outcome = [(False, str(e))]
    broadcast_object_list(outcome)
    decided, value = outcome[0]
    if not decided:
        raise ValueError(value)
    return value


def _load_on_every_process(path: str, accelerator: Any) -> Resumed:
    """Every process reads checkpoint `path` (chosen by process 0); when any cannot, every process raises one
    ValueError, so no process goes on alone (its collectives would wait for the others until --dist_timeout)."""
    rank = accelerator.process_index
    resumed, error = None, None
    if not os.path.isfile(os.path.join(path, META_FILE)):
        error = "unseen"
    else:
        try:
            resumed = load_training_state(path, rank)
        except (ValueError, OSError) as e:
            error = str(e)
    errors = [error]
    if _distributed(accelerator):
        errors = [None] * accelerator.num_processes
        dist.all_gather_object(errors, error)
    unseen = [r for r, e in enumerate(errors) if e == "unseen"]
    if unseen:
        raise ValueError(
            f"process {', '.join(map(str, unseen))} of {accelerator.num_processes} cannot see checkpoint '{path}', "
            "which process 0 resumes from: --output_dir must be on a filesystem that every node sees (the same path "
            "on a shared or network filesystem); rerun with such an --output_dir."
        )
    if failed := next((e for e in errors if e is not None), None):
        raise ValueError(failed)
    return resumed


def start_or_resume(
    args: Any, settings: dict[str, Any], ignored: Sequence[str], accelerator: Any, total: str
) -> Resumed | None:
    """The checkpoint that --resume names, its settings checked against `settings` (printed when
    --allow_resume_changes lets differences pass), or None for a fresh start; `total`: how far the run goes.

    Process 0 chooses (every process then resumes the same step, or none does); each process then reads it."""
    path = _decided_by_main_process(
        accelerator, lambda: resolve_resume(args.output_dir, args.resume, args.overwrite_output_dir)
    )
    if path is None:
        if args.resume == "auto":
            accelerator.print(
                f"warning: --resume auto found no checkpoint in '{state_dir(args.output_dir)}': the run starts fresh "
                "(check --output_dir if you meant to continue a run)"
            )
        return None
    resumed = _load_on_every_process(path, accelerator)
    defaults = dataclasses.asdict(type(args)()) if dataclasses.is_dataclass(args) else None
    changes = check_resume_settings(resumed, settings, ignored, args.allow_resume_changes, defaults)
    if changes:
        accelerator.print(f"warning: --allow_resume_changes: the checkpoint's settings differ: {changes}")
    accelerator.print(f"resuming from {resumed.path} after {resumed.step} of {total}")
    return resumed


def clear_previous_run(output_dir: str) -> None:
    """Delete an earlier run's checkpoints, policy snapshots and TensorBoard logs (for --overwrite_output_dir)."""
    for name in (STATE_DIR, "checkpoints", "tb"):
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
