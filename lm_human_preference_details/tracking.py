"""A run's record: its name, its settings (args.json), and its logs (TensorBoard, Weights & Biases)."""

import contextlib
import errno
import json
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import wandb
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch.utils.tensorboard import SummaryWriter

from lm_human_preference_details.files import WriteFailed, write_json_atomic
from lm_human_preference_details.settings import recorded


def run_name(accelerator: Accelerator, *parts: Any) -> str:
    """`part1__part2__...__<unix time>`, from rank 0's clock on every process (one name for one run)."""
    name = "__".join([*map(str, parts), str(int(time.time()))])
    return broadcast_object_list([name])[0] if accelerator.num_processes > 1 else name


def save_args(args: Any, output_dir: str) -> None:
    """The run's settings (a dataclass) as `output_dir/args.json`, its run group's at the top level as their flags
    are named (`settings.recorded`)."""
    write_json_atomic(os.path.join(output_dir, "args.json"), recorded(args))


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


class GuardedEventFile:
    """The file that TensorBoard's writer thread appends each record to, guarded: a write that fails (disk full)
    never raises in that thread (which would print its traceback and leave the error to the next call that happens to
    look); the record it cut short is cut off the file, later records are dropped, and the error waits in `error` for
    the training thread (`Tracker.check`)."""

    def __init__(self, file: Any, path: str):
        self.file, self.path = file, path
        self.error: BaseException | None = None
        self.cut = True
        """whether the file ends with a whole record (a record cut short was cut off)"""

    def _guarded(self, call: Callable[..., Any], *args: Any) -> None:
        if self.error is not None:
            return
        size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        try:
            call(*args)
        except Exception as e:  # handed to the training thread
            self.error = e
            try:
                os.truncate(self.path, size)
            except OSError:
                self.cut = False

    def write(self, data: bytes) -> None:
        self._guarded(self.file.write, data)

    def flush(self) -> None:
        self._guarded(self.file.flush)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()

    @property
    def closed(self) -> bool:
        return self.file.closed


def guard_event_file(writer: SummaryWriter) -> GuardedEventFile | None:
    """Put a GuardedEventFile between `writer`'s TensorBoard record writer and its event file. TensorBoard offers no
    hook for it: the record writer is its EventFileWriter's `_async_writer._writer`, writing to `._writer`. None where
    a TensorBoard keeps them otherwise: the run then logs unguarded, as TensorBoard does."""
    events = writer.file_writer.event_writer
    records = getattr(getattr(events, "_async_writer", None), "_writer", None)
    if not (hasattr(records, "_writer") and hasattr(events, "_file_name")):
        return None
    guard = GuardedEventFile(records._writer, events._file_name)
    records._writer = guard
    return guard


WANDB_WRITE_FAILED = "failed to save record"
"""what wandb's service writes to its log (debug-internal.log) when the run's file cannot take a record; the process
that logs is not told: wandb drops the record"""


def wandb_write_error(log_path: str, offset: int) -> tuple[OSError | None, int]:
    """The first write that wandb's service logged as failed in `log_path` after byte `offset` (its text's ending:
    "no space left on device", "disk quota exceeded", ...), and the offset to read on from."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return None, offset
    end = data.rfind(b"\n") + 1  # a line still being written is read at the next check
    for line in data[:end].decode("utf-8", "replace").splitlines():
        try:
            message = str(json.loads(line).get("msg", ""))
        except (ValueError, AttributeError):
            continue
        if WANDB_WRITE_FAILED in message:
            text = message.rsplit(": ", 1)[-1]
            number = {"no space left on device": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT}.get(text.lower())
            return OSError(number or errno.EIO, text), offset + end
    return None, offset + end


_OPEN_TRACKERS: "weakref.WeakSet[Tracker]" = weakref.WeakSet()
"""the process's trackers not yet closed"""


def abandon_open_trackers() -> None:
    """`abandon` every tracker of the process not yet closed (a run that stops on a write that failed)."""
    for tracker in list(_OPEN_TRACKERS):
        tracker.abandon()


class Tracker:
    """TensorBoard logging under output_dir/tb, plus Weights & Biases when `track`; a no-op on non-main processes.
    A log that cannot be written (disk full) is raised once in the training thread, as WriteFailed: at the next
    `log`, `flush` or `close`."""

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
        self.output_dir = output_dir
        self.events: GuardedEventFile | None = None
        self.wandb_log: tuple[str, int] | None = None
        """wandb's service log and the offset read up to"""
        self.reported = False
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
            log_path = self.run.settings.log_internal
            self.wandb_log = (log_path, os.path.getsize(log_path) if os.path.exists(log_path) else 0)
        wait_past_earlier_event_files(os.path.join(output_dir, "tb"))  # this run's points sort after a killed run's
        self.writer = SummaryWriter(os.path.join(output_dir, "tb"), purge_step=purge_step)
        self.events = guard_event_file(self.writer)
        _OPEN_TRACKERS.add(self)
        if purge_step == 0:
            self.writer.add_text("hyperparameters", _markdown_table(["param", "value"], sorted(config.items())))

    def check(self) -> None:
        """WriteFailed, once, when TensorBoard's event file or wandb's run file could not take a record."""
        if self.reported:
            return
        failed = None
        if self.events is not None and self.events.error is not None:
            kept = "the points before it are whole in that file"
            if not self.events.cut:
                kept = "the last record of that file may be cut short"
            what = f"the TensorBoard logs ({os.path.relpath(self.events.path, self.output_dir)})"
            failed = WriteFailed(what, self.output_dir, self.events.error, kept)
        elif self.wandb_log is not None:
            error, offset = wandb_write_error(*self.wandb_log)
            self.wandb_log = (self.wandb_log[0], offset)
            if error is not None:
                what = f"wandb's run (its log {os.path.relpath(self.wandb_log[0], self.output_dir)} says so)"
                failed = WriteFailed(what, self.output_dir, error, "wandb left out the points it could not write")
        if failed is not None:
            self.reported = True
            raise failed

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalars at `step`."""
        if self.writer is None:
            return
        self.check()
        metrics = {k: float(v) for k, v in metrics.items()}
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Log a table: a wandb.Table, and a markdown text entry in TensorBoard."""
        if self.writer is None:
            return
        self.check()
        self.writer.add_text(key, _markdown_table(columns, rows), step)
        if self.run is not None:
            self.run.log({key: wandb.Table(columns=columns, rows=rows)}, step=step)

    def flush(self) -> None:
        """Write the logged points to disk (before a checkpoint, so a kill loses none logged before it)."""
        if self.writer is not None:
            self.writer.flush()
        self.check()

    def close(self) -> None:
        """Flush and close the writers."""
        _OPEN_TRACKERS.discard(self)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.run is not None:
            self.run.finish()
            self.run = None
        self.check()

    def abandon(self) -> None:
        """Close the writers of a run that stops on an error, raising nothing: wandb's run ends now, with exit code
        2 (left to wandb's own exit handler on a full disk, its service's connection fails and its logging prints
        tracebacks after the run's error line)."""
        _OPEN_TRACKERS.discard(self)
        self.reported = True
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            self.writer = None
        if self.run is not None:
            with contextlib.suppress(Exception):
                self.run.finish(exit_code=2)
            self.run = None
