"""The protocol around a training loop that the three training scripts share (`CheckpointedLoop`): a run starts
where a killed run's checkpoint left off (--resume, its settings checked against the run's), writes its checkpoints in
the background, stops on Ctrl-C or SIGTERM after the checkpoint of the step in progress, and closes what it opened;
its tracker continues the resumed run's."""

import contextlib
import functools
import json
import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from accelerate.utils import broadcast_object_list

from lm_human_preference_details import cli
from lm_human_preference_details.checkpoint import (
    META_FILE,
    BackgroundSaves,
    CheckpointDamaged,
    Resumed,
    damaged_message,
    list_checkpoints,
    load_training_state,
    newest_intact_checkpoint,
    state_dir,
    step_dir,
)
from lm_human_preference_details.files import SAVING_MARKER, write_json_atomic
from lm_human_preference_details.output_claim import (
    MODEL_MARKERS,
    claim_output_dir,
    clear_previous_run,
    release_output_dir_locks,
)
from lm_human_preference_details.settings import RunSettings, recorded
from lm_human_preference_details.tracking import Tracker, run_name

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
"""settings of the training scripts that may change on --resume: naming, logging, saving and waiting, not what is
computed"""
HELD_BY_THE_CHECKPOINT = (
    "base_model",
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "ppo.value_model",
    "world_size",
)
"""settings that the checkpoint's weights and states were made for (the model and its reference, the LoRA adapters,
a critic, one RNG state per process): no --allow_resume_changes lets one of them change (an --fsdp checkpoint, whose
shards load on any number of processes, lets world_size change)"""
SUMMARY_FILE = "summary.json"
"""OUTPUT_DIR/summary.json: a finished run's result, what its closing table showed, written after its last save; its
run_name ties it to the run's checkpoints"""
T = TypeVar("T")


# ---------------------------------------------------------------- the settings check of --resume


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
    total: int | None = None,
) -> str | None:
    """ValueError listing the settings that differ from the checkpoint's, unless `allow`; -> the list (None: none).
    A setting newer than the checkpoint passes when the run leaves it at its value in `defaults` (what the code that
    wrote the checkpoint did). `allow` never lets through a setting HELD_BY_THE_CHECKPOINT, nor any change to a
    checkpoint of the run's last step (`total`: a finished run is a result, kept as it is)."""
    current, defaults = json.loads(json.dumps(current)), json.loads(json.dumps(defaults or {}))
    differences = setting_differences(resumed.meta["settings"], current, ignored, defaults)
    if not differences:
        return None
    listed = "; ".join(f"{name}: checkpoint {old!r}, now {new!r}" for name, (old, new) in differences.items())
    new_run = "or another --output_dir for a new run with these settings"
    if resumed.step == total:
        raise ValueError(
            f"the run of checkpoint '{resumed.path}' finished its {total} steps with other settings: {listed}. A "
            "finished run is kept as it is, --allow_resume_changes or not: pass its settings to see its result, "
            f"{new_run} (or --overwrite_output_dir to replace it)."
        )
    held = [name for name in differences if name in HELD_BY_THE_CHECKPOINT]
    if held:
        raise ValueError(
            f"checkpoint '{resumed.path}' holds weights and states made for other settings: {listed}. "
            f"{', '.join(map(flag_of, held))} cannot change on --resume, --allow_resume_changes or not: pass the "
            f"checkpoint's settings (see {os.path.join(resumed.path, META_FILE)}), {new_run}."
        )
    if not allow:
        raise ValueError(
            f"checkpoint '{resumed.path}' was written with other settings, so the run would not continue as it "
            f"started: {listed}. Pass the checkpoint's settings (see {os.path.join(resumed.path, META_FILE)}), "
            f"--allow_resume_changes to continue anyway, {new_run}."
        )
    return listed


def flag_of(setting: str) -> str:
    """How a user sets `setting`: its flag, or for world_size the number of processes."""
    return "the number of processes" if setting == "world_size" else f"--{setting}"


def resume_ignored(run: RunSettings, ignored: Sequence[str]) -> tuple[str, ...]:
    """The settings that may change on --resume: `ignored`, and under --fsdp the number of processes (sharded
    checkpoints load on any number)."""
    return (*ignored, "world_size") if getattr(run, "fsdp", False) else tuple(ignored)


# ---------------------------------------------------------------- process 0 decides, every process loads


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
    total: int,
    unit: str = "step",
) -> Resumed | None:
    """Take --output_dir for this run (its lock, held until `main` ends: see `one_run_per_output_dir`), then the
    checkpoint that --resume names, its settings checked against `settings` (printed when --allow_resume_changes
    lets differences pass; a setting the checkpoint predates passes at its value in `defaults`), or None for a fresh
    start; `total`: how many `unit`s the run goes.

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
    changes = check_resume_settings(resumed, settings, ignored, run.allow_resume_changes, defaults, total)
    if changes:
        accelerator.print(f"warning: --allow_resume_changes: the checkpoint's settings differ: {changes}")
    check_not_behind_a_finished_run(run.output_dir, resumed, total, unit)
    accelerator.print(f"resuming from {resumed.path} after {resumed.step} of {total} {unit}s")
    return resumed


# ---------------------------------------------------------------- a finished run is a result


def write_summary(output_dir: str, run_name: str, summary: dict[str, Any]) -> None:
    """OUTPUT_DIR/summary.json, atomically: a run's result after its last save, tied to the run by its name."""
    write_json_atomic(os.path.join(output_dir, SUMMARY_FILE), {"run_name": run_name, **summary})


def read_summary(output_dir: str) -> dict[str, Any] | None:
    """OUTPUT_DIR/summary.json, or None when there is none (or it cannot be read: a cut write is never whole)."""
    try:
        with open(os.path.join(output_dir, SUMMARY_FILE), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def finished_summary(output_dir: str, resumed: Resumed | None, total: int) -> dict[str, Any] | None:
    """The summary of the run that checkpoint `resumed` belongs to, when that run finished: the checkpoint is its last
    step, its final save is whole (no interrupted save in OUTPUT_DIR) and summary.json names the run; else None (steps
    to go, or a final save that a kill cut short: the run completes it)."""
    if resumed is None or resumed.step != total or os.path.exists(os.path.join(output_dir, SAVING_MARKER)):
        return None
    summary = read_summary(output_dir)
    return summary if summary is not None and summary.get("run_name") == resumed.meta.get("run_name") else None


def check_not_behind_a_finished_run(output_dir: str, resumed: Resumed, total: int, unit: str) -> None:
    """ValueError when `resumed` is an earlier checkpoint of a run that finished in `output_dir`: continuing from it
    would overwrite the finished run's checkpoints, model and summary."""
    summary = read_summary(output_dir)
    if resumed.step < total and summary is not None and summary.get("run_name") == resumed.meta.get("run_name"):
        raise ValueError(
            f"--resume '{resumed.path}' is checkpoint {resumed.step} of a run that finished its {total} {unit}s in "
            f"'{output_dir}' ({SUMMARY_FILE}); continuing from it there would overwrite that result: pass another "
            "--output_dir with this --resume to continue from it in a new directory, or --resume auto to see the "
            "finished run."
        )


# ---------------------------------------------------------------- the loop, and its tracker


def one_run_per_output_dir(main: Callable[..., T]) -> Callable[..., T]:
    """Decorate a script's `main`: the output-directory lock that `start_or_resume` takes is released when `main`
    returns or raises (a process that calls `main` again, a test or a notebook, can then take it again), and so are
    its loops (their signal handlers; a failed start's files)."""

    @functools.wraps(main)
    def locked_main(*args, **kwargs) -> T:
        failed = True
        try:
            result = main(*args, **kwargs)
            failed = False
            return result
        finally:
            while _active_loops:
                _active_loops.pop().release(failed)
            release_output_dir_locks()

    return locked_main


_active_loops: list["CheckpointedLoop"] = []
"""the loops of the `main` running in this process, released when it ends (`one_run_per_output_dir`)"""


def _stop_outside_the_loop(loop: "CheckpointedLoop") -> dict[int, Any]:
    """Until the loop's `saving` block (and again after it), SIGINT and SIGTERM stop the run at once with a line saying
    what is on disk (`CheckpointedLoop.outside_the_loop`); -> the handlers they had before (none off the main thread,
    where signals cannot be caught)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: Any) -> None:
        raise loop.outside_the_loop(signum)

    return {signum: signal.signal(signum, stop) for signum in cli.StopSignal.SIGNALS}


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
        self.resumed = start_or_resume(run, self.settings, defaults, ignored, accelerator, total, unit)
        self.first_step = self.resumed.step if self.resumed is not None else 0
        # a finished run's result (summary.json): the script reports it and keeps every file as it is
        self.finished = finished_summary(run.output_dir, self.resumed, total)
        self.saves = BackgroundSaves()
        self.stop = cli.StopSignal(unit, run.output_dir, accelerator.is_main_process, run.dist_timeout)
        self._save: Callable[[int], None] = lambda steps: None
        self._close: tuple[Callable[[], None], ...] = ()
        self._saved = False
        # what this start creates before anything is saved: gone again if it fails (a start that saved nothing
        # leaves nothing that blocks its own rerun)
        fresh = self.resumed is None and accelerator.is_main_process
        self._created = [
            d for d in (os.path.join(run.output_dir, n) for n in ("tb", "wandb")) if fresh and not os.path.exists(d)
        ]
        self._signals = _stop_outside_the_loop(self)
        _active_loops.append(self)

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
            self._saved = True
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

    def outside_the_loop(self, signum: int) -> cli.Stopped:
        """The stop of a signal that arrives before the loop's first step or after its last one, when no step can
        finish with a checkpoint: what is on disk, and how to go on."""
        name = signal.Signals(signum).name
        if self._saved or self.resumed is not None:
            message = (
                f"stopped by {name} before the run finished: its last checkpoint is on disk in "
                f"{state_dir(self.output_dir)}; the same command with --resume auto continues it"
            )
        else:
            message = (
                f"stopped by {name} before the first {self.unit}: nothing of this run was saved; run the same command "
                "again"
            )
        return cli.Stopped(message if self.accelerator.is_main_process else "", 128 + signum)

    def release(self, failed: bool) -> None:
        """When `main` ends: the signals back to their handlers before the run; after a failed start that saved
        nothing, what it created removed."""
        for signum, handler in self._signals.items():
            signal.signal(signum, handler)
        self._signals = {}
        saved = list_checkpoints(self.output_dir) or any(
            os.path.exists(os.path.join(self.output_dir, name)) for name in MODEL_MARKERS
        )
        if failed and not saved:
            for directory in self._created:
                shutil.rmtree(directory, ignore_errors=True)


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
