"""tyro command lines whose defaults come from one of OAI's launch.py experiments, picked with `--task NAME`."""

import sys
from collections.abc import Sequence
from typing import TypeVar

import tyro

T = TypeVar("T")


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


def parse_args(args_type: type[T], presets: dict[str, T], default_task: str, doc: str, argv=None) -> tuple[str, T]:
    """Parse argv into `args_type`, starting from the preset chosen with `--task` (any field can still be overridden)."""
    task, rest = pop_task_flag(sys.argv[1:] if argv is None else argv, list(presets), default_task)
    description = (
        f"{doc}\n\n--task {{{','.join(presets)}}} selects the settings of OAI's launch.py for that experiment "
        f"(default: {default_task}); every flag below then overrides one of them."
    )
    return task, tyro.cli(args_type, default=presets[task], args=rest, description=description, use_underscores=True)
