"""The scripts' shared command line and console: `--task` presets, `--debug`, one-line errors, start/end tables.

Every script parses the same way: `--task NAME` picks one of OAI's launch.py experiments, every other flag then
overrides one field of it (tyro), and `--debug` shows the traceback that bad input otherwise reports in one line.
"""

import atexit
import contextlib
import functools
import io
import os
import re
import shutil
import signal
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import tyro
import tyro._strings as tyro_strings
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from lm_human_preference_details.files import OutputError
from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.sources import SourceUnavailableError

T = TypeVar("T")

TABLE_FRAME = 7
"""columns a two-column rich table adds to its cells: `│ `, ` │ ` and ` │`"""

USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    HubUnavailableError,
    SourceUnavailableError,
    ImportError,
    OutputError,
)
"""Exceptions that mean bad input (a flag, a file, the network): reported as one line, not a traceback."""
DEBUG_ENV = "LHPD_DEBUG"
"""Set to 1 to see tracebacks, like --debug."""


DIVERGED_EXIT_CODE = 3
"""exit status of a training run that ended, saved, but diverged (train_policy.py; --allow_divergence: 0)"""


class Stopped(Exception):
    """A run that ended after saving but did not succeed: stopped on request (SIGINT/SIGTERM, code 128 + signal) or
    diverged (DIVERGED_EXIT_CODE); `cli.run` prints the message and exits with `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopSignal:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler) ask a training loop to stop at its next step and save a checkpoint.

    The first signal sets `signum` and prints one line; the loop folds `flag()` into the statistics it already reduces
    over processes, so every process sees the same decision without an extra host sync. A second signal exits at once
    (the last checkpoint on disk is whole: checkpoints are written atomically), and so does a process that has not
    stopped `patience` seconds after the first: one whose peers are gone, e.g. torchrun's SIGTERM to the survivors of
    a failed process, never reaches the next reduction.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, what: str, output_dir: str, announce: bool = True, patience: float | None = None):
        self.what, self.output_dir, self.announce, self.patience = what, output_dir, announce, patience
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._deadline: threading.Timer | None = None

    def install(self) -> "StopSignal":
        """Catch the signals from now on (again a no-op)."""
        if not self._previous:
            self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def restore(self) -> None:
        """Give the signals back to the handlers they had before `install`; no deadline any more."""
        if self._deadline is not None:
            self._deadline.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> "StopSignal":
        return self.install()

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def _exit_now(self, signum: int, why: str) -> None:
        """Exit at once with 128 + signal number, after one line naming the last checkpoint's directory."""
        if self.announce:
            print(
                f"{signal.Signals(signum).name} {why}: stopped at once; continue from the last checkpoint in "
                f"{self.output_dir} with the same command and --resume auto",
                file=sys.stderr,
                flush=True,
            )
        os._exit(128 + signum)

    def _handle(self, signum: int, frame) -> None:
        """First signal: remember it (and start the patience deadline); second: exit now."""
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._exit_now(signum, "again")
        self.signum = signum
        if self.patience is not None:
            why = f"{self.patience:g} s ago, and the {self.what} has not finished (--dist_timeout)"
            self._deadline = threading.Timer(self.patience, self._exit_now, (signum, why))
            self._deadline.daemon = True
            self._deadline.start()
        if self.announce:
            print(
                f"{name}: stopping after the current {self.what} with a checkpoint; press Ctrl-C again to stop at once",
                file=sys.stderr,
                flush=True,
            )

    @property
    def requested(self) -> bool:
        """Whether a signal arrived."""
        return self.signum is not None

    def flag(self, device: torch.device) -> torch.Tensor:
        """1.0 on `device` when a signal arrived, else 0.0: a fill, no host-to-device copy to wait for."""
        return torch.full((), float(self.requested), device=device)

    def stopped(self, done: str, checkpoint_dir: str, main_process: bool) -> Stopped:
        """The exception that ends the run after its checkpoint: one line naming it and `--resume auto`."""
        name = signal.Signals(self.signum or signal.SIGINT).name
        message = (
            f"stopped by {name} after {done}; checkpoint {checkpoint_dir}; continue with the same command and "
            "--resume auto"
        )
        return Stopped(message if main_process else "", 128 + (self.signum or signal.SIGINT))


@contextlib.contextmanager
def unchecked_when_offline(print_fn: Callable[[str], Any], what: str) -> Iterator[None]:
    """Run a dry run's check; when it needs the hub or a download that is unreachable, print that `what` was not
    checked instead of failing (a dry run on a machine without network still shows the settings)."""
    try:
        yield
    except (HubUnavailableError, SourceUnavailableError) as e:
        print_fn(f"dry run: {what} not checked: {e}")


def pop_flag(argv: Sequence[str], flag: str) -> tuple[bool, list[str]]:
    """Remove a boolean `flag` from argv; -> whether it was there, the rest."""
    rest = [arg for arg in argv if arg != flag]
    return len(rest) != len(argv), rest


def pop_task_flag(argv: Sequence[str], choices: Sequence[str], default: str) -> tuple[str, list[str]]:
    """Split `--task NAME` / `--task=NAME` off argv (but not `--task.field`); error on an unknown name."""
    rest, task = [], default
    it = iter(argv)
    for arg in it:
        if arg == "--task":
            task = next(it, "")
        elif arg.startswith("--task="):
            task = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if task not in choices:
        raise SystemExit(f"error: --task must be one of {', '.join(choices)} (got '{task}')")
    return task, rest


_LABELLED_LINE = re.compile(r"^[A-Z][\w-]*(?: [\w-]+)?:(?:\s|$)")
"""A docstring line that starts an entry of its own: "Run:", "Steps:", "Held-out queries:"."""


def keep_line_breaks(doc: str) -> str:
    """`doc` with a blank line before each labelled line and after each indented block.

    --help joins a line to the one before it unless it is indented, a list item or follows a blank line
    (`join_wrapped_lines`, applied to every description), so "Run: ..." and "Steps: ..." would run together; a blank
    line is the break it keeps.
    """
    out: list[str] = []
    for line in doc.strip().splitlines():
        previous = out[-1] if out else ""
        after_code = previous.startswith(" ") and line[:1].isalpha()
        if previous.strip() and (_LABELLED_LINE.match(line) or after_code):
            out.append("")
        out.append(line)
    return "\n".join(out)


_LIST_ITEM = re.compile(r"^(?:[-*] |\d+[.)] )")
"""A line that starts an item of a list: "- ", "* ", "1. ", "2) "."""


def join_wrapped_lines(text: str) -> str:
    """`text` with the line breaks of its wrapped sentences turned into spaces, for --help to wrap anew; a blank line,
    an indented line (a code example) and a list item still start a line of their own.

    tyro's own rule (`tyro._strings.remove_single_line_breaks`) keeps a break before every line that starts with a
    non-letter and runs before it dedents a field's docstring, so each continuation line of an indented docstring, or
    one that starts with `code`, a parenthesis or a number, broke its sentence in --help.
    """
    lines = tyro_strings.dedent(text).splitlines()
    out: list[str] = []
    for line in (line.rstrip() for line in lines):
        previous = out[-1] if out else ""
        if previous[:1].strip() and line[:1].strip() and not _LIST_ITEM.match(line):
            out[-1] += " " + line
        else:
            out.append(line)
    return "\n".join(out).strip("\n")


@contextlib.contextmanager
def joined_help_lines() -> Iterator[None]:
    """Within it, tyro builds --help with `join_wrapped_lines` in place of its own rule (tyro's modules look the rule
    up in tyro._strings at each call, so swapping it there reaches every docstring tyro reads)."""
    original = getattr(tyro_strings, "remove_single_line_breaks", None)
    if original is None:  # another tyro: its own rule stays
        yield
        return
    tyro_strings.remove_single_line_breaks = join_wrapped_lines
    try:
        yield
    finally:
        tyro_strings.remove_single_line_breaks = original


def tyro_cli(*args: Any, **kwargs: Any) -> Any:
    """`tyro.cli(*args, **kwargs)`, its --help built from docstrings whose wrapped sentences are joined."""
    with joined_help_lines():
        return tyro.cli(*args, **kwargs)


def describe(doc: str, tasks: Sequence[str], default_task: str) -> str:
    """The --help text: the script's docstring (usage examples included), then how --task combines with the flags."""
    return (
        f"{keep_line_breaks(doc)}\n\n--task {{{','.join(tasks)}}} selects the settings of OAI's launch.py for that "
        f"experiment (default: {default_task}); every flag below then overrides one of them."
    )


def popped_flag_options(tasks: Sequence[str], default_task: str) -> dict[str, str]:
    """The flags this module takes off argv before tyro parses it, and their help: listed among tyro's options."""
    return {
        f"--task {{{','.join(tasks)}}}": f"OAI's launch.py experiment (nplus_*: the successor recipe's run, "
        "docs/nplus.md) whose settings are the defaults of every flag "
        f"below (default: {default_task})",
        "--debug": f"show the full traceback of an error instead of one line (or set {DEBUG_ENV}=1)",
    }


def add_options(help_text: str, options: dict[str, str]) -> str:
    """tyro's help with `options` (flag -> help) listed after -h/--help, in the layout of its options box."""
    lines = help_text.split("\n")
    first = next(i for i, line in enumerate(lines) if "-h, --help" in line)
    last = first if "show this help" in lines[first] else first + 1
    left = lines[first][: lines[first].index("-h, --help")]
    column, width = lines[last].index("show this help"), len(lines[last])
    border = "│" if lines[last].rstrip().endswith("│") else ""
    rows = []
    for flag, text in options.items():
        parts = textwrap.wrap(text, width=max(20, width - column - (len(border) + 1 if border else 0)))
        if len(left) + len(flag) + 2 <= column:
            rows.append(f"{left}{flag}".ljust(column) + parts.pop(0))
        else:
            rows.append(f"{left}{flag}")
        rows += [" " * column + part for part in parts]
    rows = [row.ljust(width - len(border)) + border for row in rows]
    return "\n".join(lines[: last + 1] + rows + lines[last + 1 :])


def explicit_truncation_flag(argv: list[str]) -> list[str]:
    """argv where passing only one of --task.truncate_token and --task.truncate_text also unsets the other (a preset's
    or a saved run's value): an explicit id replaces the presets' text, and `--task.truncate_token None` turns the
    filter off, as before the text form existed."""
    names = {arg.split("=", 1)[0] for arg in argv}
    flags = ("--task.truncate_token", "--task.truncate_text")
    for given, other in (flags, flags[::-1]):
        if given in names and other not in names:
            return [*argv, other, "None"]
    return argv


def parse_args(args_type: type[T], presets: dict[str, T], default_task: str, doc: str, argv=None) -> tuple[str, T]:
    """Parse argv into `args_type`, starting from the `--task` preset (any field can still be overridden)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    task, rest = pop_task_flag(pop_flag(argv, "--debug")[1], list(presets), default_task)
    rest = explicit_truncation_flag(rest)
    description = describe(doc, list(presets), default_task)
    parse = functools.partial(tyro_cli, args_type, default=presets[task], description=description, use_underscores=True)
    return task, cli_with_options(parse, rest, popped_flag_options(list(presets), default_task))


def cli_with_options(parse: Callable[..., T], rest: list[str], options: dict[str, str]) -> T:
    """`parse(args=rest)`; when `rest` asks for help, tyro's help with `options` added to it, then exit."""
    if "-h" not in rest and "--help" not in rest:
        return parse(args=rest)
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        parse(args=rest)
    print(add_options(help_text.getvalue().rstrip("\n"), options))
    sys.exit(0)


def run(main: Callable[[T], Any], parse: Callable[[list[str]], T], argv: Sequence[str] | None = None) -> None:
    """Parse the command line and run `main`; bad input ends with one `error: ...` line and exit code 2.

    `--debug` on the command line (or LHPD_DEBUG=1) re-raises instead, with the full traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    debug, argv = pop_flag(argv, "--debug")
    debug = debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    try:
        main(parse(argv))
        atexit.register(end_process_group)  # at the program's exit: a script run in-process may come next
    except Stopped as e:
        if str(e):
            print(str(e), file=sys.stderr, flush=True)
        sys.exit(e.code)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted; a training script continues from its last checkpoint with --resume auto", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {e}\n(run with --debug for the traceback)", file=sys.stderr)
        sys.exit(2)


def end_process_group() -> None:
    """At the exit of a program whose run ended well: leave the process group (torchrun, accelerate launch), as torch
    asks before a program exits; a process that exits with the group still up can abort in its teardown (SIGABRT,
    "terminate called without an active exception") after all its work is done. Not sooner: accelerate keeps its
    state for the process, and a second script run in the same process reuses that state's process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def quiet_transformers() -> None:
    """Silence transformers' and the hub's per-load progress bars and load reports (our own tables say what loaded)."""
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def make_console() -> Console:
    """A rich console that never breaks a line of text (soft wrap: a printed path stays whole for the user to copy;
    the terminal wraps it, as it wraps `print`); tables fit its width, 160 columns when output is piped."""
    width = None if sys.stdout.isatty() else max(160, shutil.get_terminal_size((160, 24)).columns)
    return Console(width=width, highlight=False, soft_wrap=True)


def number(value: float, digits: int = 3) -> str:
    """`value` with `digits` decimals, never "-0.000"."""
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def print_table(console: Console, title: str, rows: dict[str, Any]) -> None:
    """A two-column (what, value) table; a value too long for the console's width (a long path) is left out of it and
    printed whole under it as `what: value`: a path folded across table lines could not be copied."""
    values = {key: value if isinstance(value, str) else str(value) for key, value in rows.items()}
    key_width = max(map(cell_len, values), default=0)
    fits = {key: cell_len(value) + key_width + TABLE_FRAME <= console.width for key, value in values.items()}
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True, min_width=key_width)
    table.add_column("value", no_wrap=True)
    for key, value in values.items():
        if fits[key]:
            table.add_row(Text(key), Text(value))
    console.print(table)
    for key, value in values.items():
        if not fits[key]:
            console.print(Text.assemble((key, "bold"), ": ", value), soft_wrap=True)


def parse_subcommands(presets: dict[str, dict[str, Any]], default_task: str, doc: str, argv=None) -> tuple[str, Any]:
    """Parse `SUBCOMMAND flags...`; each subcommand's defaults come from the `--task` preset (presets[task][name])."""
    import operator
    from typing import Annotated

    argv = sys.argv[1:] if argv is None else list(argv)
    task, rest = pop_task_flag(pop_flag(argv, "--debug")[1], list(presets), default_task)
    rest = explicit_truncation_flag(rest)
    commands = [
        Annotated[type(default), tyro.conf.subcommand(name, default=default)] for name, default in presets[task].items()
    ]
    description = describe(doc, list(presets), default_task)
    union = functools.reduce(operator.or_, commands)
    parse = functools.partial(tyro_cli, union, description=description, use_underscores=True)
    return task, cli_with_options(parse, rest, popped_flag_options(list(presets), default_task))
