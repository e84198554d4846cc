"""Training-state checkpoints: every process's state, written atomically and in the background, read back with
their digests checked; a damaged one names itself and is moved aside.

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
"""

import copy
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lm_human_preference_details.files import fsync_dir, publish_directory, temporary_sibling
from lm_human_preference_details.sharded import is_sharded_checkpoint

STATE_DIR = "training_state"
"""subdirectory of OUTPUT_DIR that holds the training-state checkpoints"""
META_FILE = "checkpoint.json"
SHARED_FILE = "state.pt"
RANK_FILE = "rng_rank{rank}.pt"
DAMAGED_SUFFIX = ".damaged"
"""a damaged checkpoint step{N} is moved aside to step{N}.damaged by --resume auto"""
_STEP_DIR = re.compile(r"^step(\d+)$")
_INTERRUPTED_SAVE = re.compile(r"^\.(step\d+)\.(partial|old)$")


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
    tmp = temporary_sibling(path, "partial")
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


# ---------------------------------------------------------------- reading one back, and damage


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
    fsync_dir(os.path.dirname(os.path.abspath(target)))
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


# ---------------------------------------------------------------- what an interrupted write left


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
