"""Resumable runs: atomic checkpoint directories, every process's training state, checks of the run settings.

A training-state checkpoint is OUTPUT_DIR/training_state/step{N} (N = updates or reward steps done). It is written in
a temporary sibling directory, fsync'ed, then renamed into place, so a kill at any moment leaves the previous
checkpoints whole and never a mixed one. It holds:
- checkpoint.json: the step, the run settings (args and world size), the run name and wandb id (rank 0);
- state.pt: weights, optimizer state and the script's other counters (rank 0; identical on every process);
- sharded/ (--fsdp runs, instead of the weights and optimizer state in state.pt): torch.distributed.checkpoint's files,
  every process's shards, written synchronously (not DCP's async_save), readable by any number of processes;
- rng_rank{r}.pt: process r's query-stream position and RNG states (Python, NumPy, torch, the CUDA generator of
  process r's own GPU, the sampler's generator, extra NumPy RandomStates).
checkpoint.json also lists the size and SHA-256 of every other file, so that --resume finds a truncated or altered file
before it loads it; a damaged checkpoint names itself, and --resume auto moves it aside and takes the newest intact one.
One run at a time writes an OUTPUT_DIR: process 0 holds an advisory lock on OUTPUT_DIR/.lock for the whole run.
The final model at the top of OUTPUT_DIR keeps its usual layout; its files are written aside and each moved into place
by a rename, under a marker file that the project's loaders refuse, so a half-replaced model is never loaded silently.
"""

import contextlib
import copy
import datetime
import errno
import functools
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from accelerate.utils import broadcast_object_list
from torch.overrides import TorchFunctionMode

from lm_human_preference_details import cli, devices
from lm_human_preference_details.settings import RunSettings, recorded
from lm_human_preference_details.sharded import SHARDED_DIR
from lm_human_preference_details.tracking import Tracker, run_name

try:
    import fcntl
except ImportError:  # Windows: no advisory lock on the output directory
    fcntl = None

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
LOCK_FILE = ".lock"
"""in OUTPUT_DIR while a run writes there: process 0 holds an advisory lock on it and records who it is"""
DAMAGED_SUFFIX = ".damaged"
"""a damaged checkpoint step{N} is moved aside to step{N}.damaged by --resume auto"""
_STEP_DIR = re.compile(r"^step(\d+)$")
_INTERRUPTED_SAVE = re.compile(r"^\.(step\d+)\.(partial|old)$")
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


def reseed_rngs(
    seed: int, rank: int, step: int, generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()
) -> None:
    """Seed Python's, NumPy's and torch's global RNGs, `generator` and `numpy_rngs` from (seed, rank, step): for a
    process that continues a checkpoint of another number of processes, whose RNG states cannot be divided among it."""
    seeds = np.random.SeedSequence([seed, rank, step]).generate_state(3 + len(numpy_rngs))
    devices.set_seed(int(seeds[0]))
    generator.manual_seed(int(seeds[1]) << 32 | int(seeds[2]))
    for rng, rng_seed in zip(numpy_rngs, seeds[3:]):
        rng.seed(int(rng_seed))


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

    def host_copy(self, module: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
        """A twin of `module` in host memory holding its current parameters and buffers (made at the first call, then
        refilled); call it after `wait`, as the previous write may still read the twin. `state`: the tensors to copy
        instead of the module's own, under its state_dict's names (the whole weights of a module sharded by FSDP2,
        whose twin was made before it was sharded).

        The twin holds the parameters and buffers only: a tensor the module keeps beside them (the sampler's KV cache
        in its `__dict__`, say) becomes an empty meta tensor in the twin, never a second copy on its device. With
        CUDA, the twin's tensors are pinned and the copies into them asynchronous, with one wait at the end."""
        twin = self._host_modules.get(id(module))
        if twin is None:
            twin = self._host_modules[id(module)] = _host_twin(module)
        sources = module.state_dict() if state is None else state
        copied = [(target, sources[name]) for name, target in twin.state_dict(keep_vars=True).items()]
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
    write_shards: Callable[[str], None] | None = None,
) -> str:
    """Write checkpoint `step` atomically: `meta` and `shared` from the main process, `local` from every process;
    then keep the newest `keep` and run `then` (the main process's other saves). Every process must call it.
    `write_shards(directory)`: what every process writes into the checkpoint besides (an --fsdp run's shards of
    the weights and optimizer state), synchronously, before the files' digests are taken.

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
    if write_shards is not None:
        write_shards(tmp)
    accelerator.wait_for_everyone()  # every process's file is in tmp
    if accelerator.is_main_process:
        meta = {**meta, "step": step, "world_size": accelerator.num_processes}

        def write() -> None:
            torch.save(shared, os.path.join(tmp, SHARED_FILE))
            with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
                json.dump({**meta, "files": file_digests(tmp)}, f, indent=2)
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


def _sha256(path: str) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks (hashlib releases the GIL: training goes on meanwhile)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def file_digests(directory: str) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "sha256"}} of every file in a checkpoint directory but checkpoint.json, which records them;
    a file in a subdirectory (the sharded weights of an --fsdp run) is named by its relative path."""
    paths = {
        os.path.relpath(os.path.join(root, name), directory): os.path.join(root, name)
        for root, _, names in os.walk(directory)
        for name in names
    }
    paths.pop(META_FILE, None)
    return {name: {"bytes": os.path.getsize(paths[name]), "sha256": _sha256(paths[name])} for name in sorted(paths)}


@dataclass
class Resumed:
    """A checkpoint loaded to continue a run."""

    path: str
    """its directory"""
    step: int
    """updates (policy) or reward steps done"""
    meta: dict[str, Any]
    """checkpoint.json: settings, run name, wandb id, the other files' sizes and digests"""
    shared: dict[str, Any]
    """state.pt: weights, optimizer, counters"""
    local: dict[str, Any] | None
    """this process's rng_rank{r}.pt: query stream and RNG states (None: a sharded checkpoint that fewer processes
    wrote, resumed on more)"""


class CheckpointDamaged(ValueError):
    """A checkpoint file that cannot be read whole: truncated, altered since it was saved, unparsable, non-finite."""

    def __init__(self, path: str, name: str, problem: str):
        self.path, self.name, self.problem = path, name, problem
        super().__init__(f"checkpoint '{path}' is damaged ({name}: {problem})")

    @property
    def detail(self) -> str:
        """`FILE: PROBLEM`."""
        return f"{self.name}: {self.problem}"


def _read_error(error: BaseException) -> str:
    """What went wrong reading a file, in a few words: the exception's first sentence."""
    text = str(error).split(". ")[0].strip().rstrip(".") if str(error).strip() else "ends early"
    return f"unreadable, truncated or not this kind of file ({type(error).__name__}: {text})"


def read_meta(path: str) -> dict[str, Any]:
    """checkpoint.json of checkpoint `path`; CheckpointDamaged when it is not whole JSON with the step in it."""
    try:
        with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
        int(meta["step"])
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"not valid JSON ({e})" if isinstance(e, json.JSONDecodeError) else _read_error(e)
        if isinstance(e, (KeyError, TypeError)):
            problem = "holds no step"
        raise CheckpointDamaged(path, META_FILE, problem) from e
    return meta


def _check_digest(path: str, name: str, meta: dict[str, Any], hashed: bool = True) -> None:
    """CheckpointDamaged when file `name` differs from the size and SHA-256 that checkpoint.json recorded for it
    (checkpoints written before the record existed pass); with `hashed` False, the size only."""
    saved = (meta.get("files") or {}).get(name)
    if saved is None:
        return
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointDamaged(path, name, "missing")
    size = os.path.getsize(file)
    if size != saved["bytes"]:
        raise CheckpointDamaged(path, name, f"truncated or overwritten: {size} bytes, {saved['bytes']} were saved")
    if hashed and _sha256(file) != saved["sha256"]:
        raise CheckpointDamaged(path, name, "its bytes differ from those saved (SHA-256 mismatch: a flipped bit?)")


def _load_torch_file(path: str, name: str, meta: dict[str, Any], hashed: bool) -> Any:
    """torch.load of file `name` of checkpoint `path`, checked against checkpoint.json's record first;
    CheckpointDamaged naming the file when it cannot be read whole."""
    _check_digest(path, name, meta, hashed)
    try:
        return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointDamaged(path, name, "missing") from None
    except Exception as e:  # torch.load raises RuntimeError, EOFError, UnpicklingError, OSError ... on a damaged file
        raise CheckpointDamaged(path, name, _read_error(e)) from e


def _nonfinite_names(state: Any, prefix: str = "") -> list[str]:
    """Dotted names of the floating-point tensors in nested dicts/lists that hold a NaN or an infinity."""
    if isinstance(state, torch.Tensor):
        # one sum per tensor first (cheap), then the exact test on the few whose sum is not finite
        suspect = state.is_floating_point() and not torch.isfinite(state.sum())
        return [prefix.rstrip(".")] if suspect and not torch.isfinite(state).all() else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else []
    return [name for key, value in items for name in _nonfinite_names(value, f"{prefix}{key}.")]


def _check_finite_state(path: str, shared: dict[str, Any]) -> None:
    """CheckpointDamaged when state.pt holds non-finite weights or optimizer moments: a run stops before it saves
    such a state, so they come from the file (a bit flipped on disk or in memory), not from training."""
    bad = _nonfinite_names(shared)
    if bad:
        raise CheckpointDamaged(
            path, SHARED_FILE, f"non-finite (NaN or infinite) values in {bad[:3]}, which training never saves"
        )


def load_training_state(path: str, rank: int, hashed: bool = True) -> Resumed:
    """Read checkpoint `path` for process `rank`: FileNotFoundError when it is not a checkpoint or lacks this
    process's file; CheckpointDamaged naming the file that is truncated, altered, unparsable or non-finite (with
    `hashed` False, files are checked against the recorded sizes only: the main process verified the digests)."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(
            f"--resume '{path}' is not a checkpoint ('{META_FILE}' is missing); pass a directory of "
            f"OUTPUT_DIR/{STATE_DIR}/ or --resume auto."
        )
    meta = read_meta(path)
    rank_name = RANK_FILE.format(rank=rank)
    own_file = os.path.isfile(os.path.join(path, rank_name)) or rank_name in meta.get("files", {})
    if not own_file and not is_sharded_checkpoint(meta):
        raise FileNotFoundError(
            f"checkpoint '{path}' has no state for process {rank} ('{rank_name}'): it was written by "
            f"{meta.get('world_size')} processes; resume with as many."
        )
    shared = _load_torch_file(path, SHARED_FILE, meta, hashed)
    _check_finite_state(path, shared)
    local = _load_torch_file(path, rank_name, meta, hashed) if own_file else None
    return Resumed(path, int(meta["step"]), meta, shared, local)


def is_sharded_checkpoint(meta: dict[str, Any]) -> bool:
    """Whether a checkpoint (its checkpoint.json) holds its weights as an --fsdp run's shards, which a run with any
    number of processes reads back."""
    return any(name.startswith(SHARDED_DIR + "/") for name in meta.get("files") or {})


def load_process_state(resumed: Resumed, rank: int) -> dict[str, Any]:
    """rng_rank{rank}.pt of a loaded checkpoint: another process's query-stream position and RNG states."""
    return _load_torch_file(resumed.path, RANK_FILE.format(rank=rank), resumed.meta, hashed=False)


def find_damage(path: str) -> CheckpointDamaged | None:
    """Why checkpoint `path` cannot be resumed from as saved, None when it is intact: checkpoint.json must parse, and
    every file it records must have the recorded size and SHA-256; a checkpoint without that record (written before
    it existed) is read whole instead (every file loaded, the weights checked finite)."""
    try:
        meta = read_meta(path)
        if "files" not in meta:
            names = [SHARED_FILE, *(RANK_FILE.format(rank=r) for r in range(int(meta.get("world_size", 1))))]
            for name in names:
                state = _load_torch_file(path, name, meta, hashed=False)
                if name == SHARED_FILE:
                    _check_finite_state(path, state)
            return None
        for name in meta["files"]:
            _check_digest(path, name, meta)
    except CheckpointDamaged as e:
        return e
    except FileNotFoundError:
        return CheckpointDamaged(path, META_FILE, "missing")
    return None


def _intact_before(path: str) -> str | None:
    """The newest checkpoint older than `path` beside it that `find_damage` finds intact, None when none is."""
    parent, name = os.path.split(os.path.abspath(path))
    match = _STEP_DIR.match(name)
    if match is None or not os.path.isdir(parent):
        return None
    older = sorted(
        (int(m.group(1)), os.path.join(os.path.dirname(path), other))
        for other in os.listdir(parent)
        if (m := _STEP_DIR.match(other)) and int(m.group(1)) < int(match.group(1))
    )
    return next((older_path for _, older_path in reversed(older) if find_damage(older_path) is None), None)


def damaged_message(damage: CheckpointDamaged) -> str:
    """One line for a damaged checkpoint that --resume PATH names: the file, and the newest intact one before it."""
    intact = _intact_before(damage.path)
    if intact is None:
        return f"{damage}; no checkpoint before it is intact: pass --resume auto to take the newest intact one."
    return (
        f"{damage}; the newest intact checkpoint before it is '{intact}': pass --resume {intact}, or --resume auto, "
        "which moves the damaged one aside."
    )


def set_aside(damage: CheckpointDamaged) -> str:
    """Move a damaged checkpoint step{N} to step{N}.damaged (never deleted: it holds the run's data); -> the
    sentence that says where it is now (or that it stayed, when it cannot be moved)."""
    target = damage.path.rstrip(os.sep) + DAMAGED_SUFFIX
    for n in range(2, 1000):
        if not os.path.exists(target):
            break
        target = f"{damage.path.rstrip(os.sep)}{DAMAGED_SUFFIX}{n}"
    try:
        os.replace(damage.path, target)
    except OSError as e:
        return f"it stays where it is ({e.strerror})"
    _fsync_dir(os.path.dirname(os.path.abspath(target)))
    return f"moved it aside to '{os.path.basename(target)}'"


def newest_intact_checkpoint(output_dir: str, damage: CheckpointDamaged | None = None) -> str | None:
    """The newest checkpoint in OUTPUT_DIR/training_state that `find_damage` finds intact; each damaged one newer than
    it (and `damage`, one that failed to load) is moved aside with one printed line. ValueError when every
    checkpoint is damaged."""
    found = []
    if damage is not None:
        found.append(damage)
        print(f"warning: {damage}; {set_aside(damage)}", flush=True)
    for _, path in reversed(list_checkpoints(output_dir)):
        problem = find_damage(path)
        if problem is None:
            return path
        found.append(problem)
        print(f"warning: {problem}; {set_aside(problem)}", flush=True)
    if found:
        raise ValueError(
            f"--resume auto: every checkpoint in '{state_dir(output_dir)}' is damaged "
            f"({'; '.join(f'{os.path.basename(d.path)}: {d.detail}' for d in found)}), each kept as "
            f"step{{N}}{DAMAGED_SUFFIX}; pass --overwrite_output_dir to start again there, or choose another "
            "--output_dir."
        )
    return None


# ---------------------------------------------------------------- one run per output directory


@dataclass
class _HeldLock:
    """This process's lock on an output directory."""

    path: str
    """OUTPUT_DIR/.lock"""
    fd: int
    created: str | None
    """OUTPUT_DIR when the lock created it (removed again at release when the run left it empty)"""


_held_locks: dict[str, _HeldLock] = {}
"""the output directories this process holds, by real path"""
_unlocked_dirs: set[str] = set()
"""output directories on filesystems without file locks, already warned about"""
_NO_LOCK_ERRNOS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
"""what flock raises on a filesystem without (cluster) file locks: Lustre mounted without -o flock, some FUSE ones"""


def _holder(fd: int) -> str:
    """Who holds the lock, from the lock file's record (waits a moment for a holder that is still writing it)."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            return f"{record['script']}, pid {record['pid']} on host {record['host']}, started {record['started']}"
        except (ValueError, KeyError, OSError):
            time.sleep(0.05)
    return "its process did not say who it is"


def lock_output_dir(output_dir: str) -> bool:
    """Take the advisory lock on OUTPUT_DIR/.lock for this process (held until `release_output_dir_locks` or the
    process ends: the OS releases the lock of a killed process, so a crash never leaves it stuck). ValueError
    naming the holder when another run holds it; a warning, once, where the filesystem has no file locks.
    -> whether this process holds the lock (False without file locks)."""
    key = os.path.realpath(output_dir)
    if key in _held_locks:
        return True
    if fcntl is None:
        return False
    created = None if os.path.isdir(output_dir) else output_dir
    path = os.path.join(output_dir, LOCK_FILE)
    while True:
        os.makedirs(output_dir, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the directory was removed by a run releasing it: create it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ValueError(
                f"another run ({holder}) holds --output_dir '{output_dir}' (its {LOCK_FILE} is locked); wait for it "
                "to end, or choose another --output_dir."
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCK_ERRNOS:
                raise
            if key not in _unlocked_dirs:
                _unlocked_dirs.add(key)
                _warn_no_locks(output_dir, e)
            return False
        # a run releasing the lock unlinks the file: holding an unlinked file's lock excludes nobody, so try again
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        os.close(fd)
    record = {
        "script": os.path.basename(sys.argv[0]) or "python",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
    _held_locks[key] = _HeldLock(path, fd, created)
    return True


def _warn_no_locks(output_dir: str, error: OSError) -> None:
    """Say that nothing keeps a second run out of `output_dir`."""
    print(
        f"warning: --output_dir '{output_dir}' is on a filesystem without file locks ({error.strerror}), so nothing "
        "stops a second run from writing there at the same time; give each run its own --output_dir (see "
        "docs/reliability.md)",
        file=sys.stderr,
        flush=True,
    )


def release_output_dir_locks() -> None:
    """Release every output-directory lock this process holds: the lock file is unlinked, then unlocked, and an
    output directory that the lock created and the run left empty is removed."""
    for key in list(_held_locks):
        held = _held_locks.pop(key)
        with contextlib.suppress(OSError):
            os.unlink(held.path)
        os.close(held.fd)
        if held.created is not None:
            with contextlib.suppress(OSError):
                os.rmdir(held.created)


def one_run_per_output_dir(main: Callable[..., T]) -> Callable[..., T]:
    """Decorate a script's `main`: the output-directory lock that `start_or_resume` takes is released when `main`
    returns or raises (a process that calls `main` again, a test or a notebook, can then take it again)."""

    @functools.wraps(main)
    def locked_main(*args, **kwargs) -> T:
        try:
            return main(*args, **kwargs)
        finally:
            release_output_dir_locks()

    return locked_main


def clean_interrupted_saves(output_dir: str) -> str | None:
    """Tidy what a run stopped in the middle of a checkpoint write left in OUTPUT_DIR/training_state (call it under
    the lock, so no live run is writing): `.step{N}.partial` (an unfinished write) is removed, `.step{N}.old` is
    removed beside a `step{N}` and renamed back to `step{N}` without one (a replace cut between its two renames).
    -> one line saying what was done, None when nothing was left."""
    root = state_dir(output_dir)
    if not os.path.isdir(root):
        return None
    removed, restored, size = [], [], 0
    for name in sorted(os.listdir(root)):
        match = _INTERRUPTED_SAVE.match(name)
        if match is None:
            continue
        path, final = os.path.join(root, name), os.path.join(root, match.group(1))
        if match.group(2) == "old" and not os.path.exists(final):
            os.replace(path, final)
            restored.append(match.group(1))
            continue
        size += sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        shutil.rmtree(path)
        removed.append(name)
    if not removed and not restored:
        return None
    done = [f"removed {', '.join(removed)} ({size / 1e6:.1f} MB)"] if removed else []
    if restored:
        done.append(f"restored {', '.join(restored)} from its .old copy")
    return f"{root}: {'; '.join(done)}, left by a run stopped while it saved a checkpoint"


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
    """The checkpoint directory to continue (--resume PATH, or `auto`: the newest intact one in output_dir, damaged
    newer ones moved aside), None for a fresh start; ValueError when a fresh run would overwrite another run's
    output_dir without `overwrite`, or when --resume PATH names a damaged checkpoint."""
    if resume == "auto":
        resume = newest_intact_checkpoint(output_dir)
        if resume is None and set(previous_run(output_dir)) - {"tb"}:
            raise ValueError(
                f"--resume auto: '{output_dir}' holds a run ({', '.join(previous_run(output_dir))}) but no checkpoint "
                f"in {STATE_DIR}/; pass --overwrite_output_dir to start again there, or choose another --output_dir."
            )
        return resume
    if resume is not None:
        if not os.path.isfile(os.path.join(resume, META_FILE)):
            raise FileNotFoundError(
                f"--resume '{resume}' is not a checkpoint ('{META_FILE}' is missing); pass a directory of "
                f"OUTPUT_DIR/{STATE_DIR}/ or --resume auto."
            )
        if (damage := find_damage(resume)) is not None:
            raise ValueError(damaged_message(damage))
        return resume
    found = previous_run(output_dir)
    if found and not overwrite:
        raise ValueError(
            f"--output_dir '{output_dir}' already holds another run ({', '.join(found)}); pass --resume auto to "
            "continue it, --overwrite_output_dir to replace it, or choose another --output_dir."
        )
    return None


def claim_output_dir(output_dir: str, resume: str | None, overwrite: bool) -> str | None:
    """Process 0's start in `output_dir`: take its lock (one run at a time), tidy what an interrupted checkpoint write
    left (only under the lock: without one, a live run may be writing it), then `resolve_resume`."""
    if lock_output_dir(output_dir) and (tidied := clean_interrupted_saves(output_dir)):
        print(tidied, flush=True)
    return resolve_resume(output_dir, resume, overwrite)


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
    """Every process reads checkpoint `path` (chosen, and its files' digests verified, by process 0); when any cannot,
    every process raises one error (CheckpointDamaged when a file is damaged), so no process goes on alone (its
    collectives would wait for the others until --dist_timeout)."""
    rank = accelerator.process_index
    resumed, error = None, None
    if not os.path.isfile(os.path.join(path, META_FILE)):
        error = ("unseen",)
    else:
        try:
            resumed = load_training_state(path, rank, hashed=False)
        except CheckpointDamaged as e:
            error = ("damaged", e.path, e.name, e.problem)
        except (ValueError, OSError) as e:
            error = ("error", str(e))
    errors = [error]
    if _distributed(accelerator):
        errors = [None] * accelerator.num_processes
        dist.all_gather_object(errors, error)
    unseen = [r for r, e in enumerate(errors) if e is not None and e[0] == "unseen"]
    if unseen:
        raise ValueError(
            f"process {', '.join(map(str, unseen))} of {accelerator.num_processes} cannot see checkpoint '{path}', "
            "which process 0 resumes from: --output_dir must be on a filesystem that every node sees (the same path "
            "on a shared or network filesystem); rerun with such an --output_dir."
        )
    if failed := next((e for e in errors if e is not None), None):
        raise CheckpointDamaged(*failed[1:]) if failed[0] == "damaged" else ValueError(failed[1])
    return resumed


def start_or_resume(
    run: RunSettings,
    settings: dict[str, Any],
    defaults: dict[str, Any],
    ignored: Sequence[str],
    accelerator: Any,
    total: str,
) -> Resumed | None:
    """Take --output_dir for this run (its lock, held until `main` ends: see `one_run_per_output_dir`), then the
    checkpoint that --resume names, its settings checked against `settings` (printed when --allow_resume_changes
    lets differences pass; a setting the checkpoint predates passes at its value in `defaults`), or None for a fresh
    start; `total`: how far the run goes.

    Process 0 chooses (every process then resumes the same step, or none does); each process then reads it. A
    checkpoint that turns out damaged while it loads stops the run (--resume PATH), or is moved aside for the newest
    intact one (--resume auto)."""
    path = _decided_by_main_process(
        accelerator, lambda: claim_output_dir(run.output_dir, run.resume, run.overwrite_output_dir)
    )
    if path is None:
        if run.resume == "auto":
            accelerator.print(
                f"warning: --resume auto found no checkpoint in '{state_dir(run.output_dir)}': the run starts fresh "
                "(check --output_dir if you meant to continue a run)"
            )
        return None
    while True:
        try:
            resumed = _load_on_every_process(path, accelerator)
            break
        except CheckpointDamaged as damage:
            if run.resume != "auto":
                raise ValueError(_decided_by_main_process(accelerator, lambda d=damage: damaged_message(d))) from None
            path = _decided_by_main_process(accelerator, lambda d=damage: newest_intact_checkpoint(run.output_dir, d))
    changes = check_resume_settings(resumed, settings, ignored, run.allow_resume_changes, defaults)
    if changes:
        accelerator.print(f"warning: --allow_resume_changes: the checkpoint's settings differ: {changes}")
    accelerator.print(f"resuming from {resumed.path} after {resumed.step} of {total}")
    return resumed


def resume_ignored(run: RunSettings, ignored: Sequence[str]) -> tuple[str, ...]:
    """The settings that may change on --resume: `ignored`, and under --fsdp the number of processes (sharded
    checkpoints load on any number)."""
    return (*ignored, "world_size") if getattr(run, "fsdp", False) else tuple(ignored)


class CheckpointedLoop:
    """The protocol around a training loop of `total` steps (a policy's updates, a reward model's steps) that both
    scripts share: start where a killed run's checkpoint left off (--resume), write a checkpoint in the background
    every --save_interval steps and after the last one, and on Ctrl-C or SIGTERM stop after the checkpoint of the
    step in progress.

        loop = CheckpointedLoop(args, world, ignored, accelerator, "update", total)  # loop.resumed: None or ...
        with loop.saving(save, tracker.close):  # save(steps): the checkpoint after `steps` steps, into loop.saves
            for step in range(loop.first_step, total):
                ...  # the step reduces loop.stop.flag(device) with its statistics: `stopping`, the same everywhere
                loop.step_done(step + 1, stopping)
        loop.finish()
    """

    def __init__(self, args: Any, world: int, ignored: Sequence[str], accelerator: Any, unit: str, total: int):
        """`args`: a training script's settings (its run settings in `args.run`), run by `world` processes; `ignored`:
        the settings that may change on --resume (dotted names)."""
        run: RunSettings = args.run
        self.output_dir, self.save_interval = run.output_dir, run.save_interval
        self.accelerator, self.unit, self.total = accelerator, unit, total
        # what the checkpoints record of the run's settings, and check on --resume
        self.settings = {**recorded(args), "world_size": world}
        ignored = resume_ignored(run, ignored)
        # the checkpoint this run continues from (None: a fresh start) and the first step it takes
        defaults = recorded(type(args)())
        self.resumed = start_or_resume(run, self.settings, defaults, ignored, accelerator, f"{total} {unit}s")
        self.first_step = self.resumed.step if self.resumed is not None else 0
        self.saves = BackgroundSaves()
        self.stop = cli.StopSignal(unit, run.output_dir, accelerator.is_main_process, run.dist_timeout)
        self._save: Callable[[int], None] = lambda steps: None
        self._close: tuple[Callable[[], None], ...] = ()

    @contextlib.contextmanager
    def saving(self, save: Callable[[int], None], *close: Callable[[], None]) -> Iterator["CheckpointedLoop"]:
        """Catch Ctrl-C and SIGTERM while the loop runs; `save(steps)` writes the checkpoint after `steps` steps
        (through `saves`), `close` ends what the run opened (tracker, hooks) when it stops or finishes."""
        self._save, self._close = save, close
        with self.stop:
            yield self

    def step_done(self, steps: int, stopping: bool) -> None:
        """After `steps` steps: raise a failed background save's error, write the checkpoint when it is due (every
        --save_interval steps, after the last step, on a stop); on a stop, cli.Stopped once that checkpoint is on
        disk and the run's trackers are closed."""
        self.saves.raise_error()  # a failed background save stops the run at the next step
        last = steps == self.total
        if last or stopping or (self.save_interval and steps % self.save_interval == 0):
            self._save(steps)
        if stopping and not last:
            self.saves.wait()  # the checkpoint the message names is on disk before the run stops
            for close in self._close:
                close()
            done = f"{self.unit} {steps} of {self.total}"
            raise self.stop.stopped(done, step_dir(self.output_dir, steps), self.accelerator.is_main_process)

    def wait(self) -> None:
        """Until the last checkpoint is on disk (its write's error raised)."""
        self.saves.wait()

    def finish(self) -> None:
        """The last checkpoint on disk, every process past it, then what the run opened closed."""
        self.saves.wait()
        self.accelerator.wait_for_everyone()
        for close in self._close:
            close()


def clear_previous_run(output_dir: str) -> None:
    """Delete an earlier run's checkpoints, policy snapshots and TensorBoard logs (for --overwrite_output_dir)."""
    for name in (STATE_DIR, "checkpoints", "tb"):
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def start_tracker(
    run: RunSettings, seed: int, accelerator, resumed: "Resumed | None", kind: str, config: dict
) -> tuple[Tracker, str]:
    """TensorBoard (and wandb) for a run, continuing a resumed run's (its name, wandb id and step); a fresh run with
    --overwrite_output_dir first clears the previous run's outputs. `kind` names the run (its task, or `sft`),
    `config` is what the tracker records; -> the tracker and the run's name."""
    name = resumed.meta["run_name"] if resumed else run_name(accelerator, kind, run.exp_name, seed)
    if resumed is None and run.overwrite_output_dir and accelerator.is_main_process:
        clear_previous_run(run.output_dir)  # every input has loaded: the old run's outputs can go
    tracker = Tracker(
        run.output_dir,
        run.track,
        run.wandb_project_name,
        run.wandb_entity,
        name,
        config,
        accelerator.is_main_process,
        purge_step=resumed.step if resumed else 0,
        wandb_id=resumed.meta["wandb_id"] if resumed else None,
    )
    return tracker, name
