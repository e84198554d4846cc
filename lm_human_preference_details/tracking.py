"""A run's record: its name, its settings (args.json), and its logs (TensorBoard, Weights & Biases)."""

import os
import time
from collections.abc import Sequence
from typing import Any

import wandb
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch.utils.tensorboard import SummaryWriter

from lm_human_preference_details.files import write_json_atomic
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
