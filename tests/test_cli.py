"""The scripts' shared command line and console: presets, --dry_run, one-line errors, --debug, tables, numbers."""

import importlib
import io
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

import evaluate
import label_generation
import train_both
import train_policy
import train_reward
from lm_human_preference_details import cli
from tests.planted import REPO

SCRIPTS = ("train_reward.py", "train_policy.py", "label_generation.py")


def run(script: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """A script as a user runs it, offline, without raising on failure."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / script), *flags], env=env, capture_output=True, text=True, timeout=120
    )


def test_number_never_prints_negative_zero():
    assert cli.number(-0.0001) == "0.000"
    assert cli.number(-0.0) == "0.000"
    assert cli.number(-0.0006) == "-0.001"
    assert cli.number(1.23456, 2) == "1.23"


def test_print_table_prints_a_path_too_long_for_the_table_whole_under_it():
    buffer = io.StringIO()
    path = "/a/very/long/output/directory/" + "x" * 150 + "/[tb]"
    short = "/tmp/run"
    cli.print_table(Console(file=buffer, width=80), "t", {"output dir": path, "TensorBoard": short, "updates": 3})
    lines = buffer.getvalue().splitlines()
    assert f"output dir: {path}" in lines  # whole, on one line, brackets not read as markup
    assert any(line.startswith("│ TensorBoard │ /tmp/run") for line in lines) and "…" not in buffer.getvalue()
    assert all(len(line) <= 80 for line in lines if path not in line)


def test_print_table_keeps_a_value_that_fits_in_the_table():
    buffer = io.StringIO()
    path = "/tmp/" + "x" * 52  # 57 characters: with the 10-wide key column and the frame, exactly 80
    cli.print_table(Console(file=buffer, width=80), "t", {"output dir": path, "updates": 3})
    assert f"│ output dir │ {path} │" in buffer.getvalue().splitlines()


def test_script_console_prints_a_long_path_whole():
    buffer = io.StringIO()
    console = cli.make_console()
    console.file, console.width = buffer, 80
    path = "/tmp/" + "y" * 150 + "/labels.json"
    console.print(f"wrote 4 label rows to {path} (best_of_4, labeler vader); train with train_reward.py")
    assert path in buffer.getvalue().splitlines()[0]


def test_piped_console_is_wide():
    assert cli.make_console().width >= 160  # pytest captures stdout: not a terminal


def test_every_script_uses_the_same_task_presets():
    for presets in (train_policy.task_presets(), train_reward.task_presets()):
        assert list(presets) == ["sentiment", "descriptiveness", "tldr", "cnndm", "nplus_tldr"]
        assert all(args.task_id == name for name, args in presets.items())
    # the successor recipe's preset: the same task in both training scripts, so its reward model fits its policy
    policy, reward = train_policy.parse(["--task", "nplus_tldr"]), train_reward.parse(["--task", "nplus_tldr"])
    assert policy.task == reward.task and policy.task.end_at_eos and policy.task_id == reward.task_id == "nplus_tldr"
    assert list(label_generation.oai_presets()) == ["sentiment", "descriptiveness", "tldr", "cnndm"]
    assert train_policy.parse(["--task", "cnndm"]).task.temperature == 0.5
    assert train_reward.parse(["--task", "cnndm"]).task.temperature == 0.5
    assert label_generation.parse(["generate", "--task", "cnndm"]).task.temperature == 0.5
    assert train_reward.parse(["--task=tldr"]).batch_size == 16 and train_policy.parse(["--task=tldr"]).ppo.lr == 2e-6


def test_unknown_task_is_one_line():
    result = run("train_policy.py", "--task", "nope")
    assert result.returncode != 0 and "--task must be one of sentiment, descriptiveness, tldr, cnndm" in result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_a_usage_example_the_task_flag_and_dry_run(script):
    result = run(script, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    tasks = "sentiment,descriptiveness,tldr,cnndm" + (
        ",nplus_tldr" if script in ("train_reward.py", "train_policy.py") else ""
    )
    assert f"--task {{{tasks}}}" in text
    assert f"{script} {'generate ' if script == 'label_generation.py' else ''}--task" in text  # a usage example
    if script == "label_generation.py":
        text = " ".join(run(script, "generate", "--help").stdout.split())
    assert "--dry_run" in text


@pytest.mark.parametrize("module", [train_reward, train_policy])
def test_help_keeps_the_usage_lines_and_lists_task_among_the_options(module, capsys):
    with pytest.raises(SystemExit) as exit:
        module.parse(["--help"])
    assert exit.value.code == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    if module is train_reward:  # "Run:" and "Steps:" each start a line of their own
        assert any(line.startswith("Run:   accelerate launch") for line in lines)
        assert any(line.startswith("Steps: normalize the untrained reward") for line in lines)
    else:  # each usage example on its own line
        assert any(line.startswith("python train_policy.py --task sentiment --ppo.gradient") for line in lines)
    options = lines[next(i for i, line in enumerate(lines) if line.startswith("-h, --help")) :]
    flags = [line.split()[0] for line in options if line.startswith("--")]
    assert flags[:3] == ["--task", "--debug", "--seed"], flags[:3]
    tasks = "--task {sentiment,descriptiveness,tldr,cnndm,nplus_tldr}"  # OAI's experiments, then the successor recipe's
    assert tasks in options and "(default: sentiment)" in " ".join(options)


def test_join_wrapped_lines_joins_sentences_and_keeps_paragraphs_code_and_lists():
    doc = (  # an attribute docstring: its first line right after the quotes, the others indented
        "writes the candidates, `serve`\n    serves them (OUTPUT_DIR/seed{SEED}\n    (quick) with stages\n    3 and 4"
        "\n\n        python run.py --seed 1\n        python run.py --seed 2\n    then:\n    - one\n    - two"
        "\n    1. first"
    )
    assert cli.join_wrapped_lines(doc).split("\n") == [
        "writes the candidates, `serve` serves them (OUTPUT_DIR/seed{SEED} (quick) with stages 3 and 4", "",
        "    python run.py --seed 1", "    python run.py --seed 2", "then:", "- one", "- two", "1. first",
    ]  # fmt: skip


def sentence_breaks(help_text: str, width: int) -> list[str]:
    """The lines of a flag's help (indented 8, the layout of a piped --help) that start with a word the line before had
    room for within `width` columns: a break that the docstring's wrapping put there, not the console's."""
    lines = help_text.splitlines()
    return [
        f"{before.strip()} / {line.strip()}"
        for before, line in zip(lines, lines[1:])
        if before.startswith(" " * 8)
        and line.startswith(" " * 8)
        and line.strip()
        and len(before.rstrip()) + 1 + len(line.split()[0]) <= width
    ]


def run_demo_help(argv: list[str]) -> None:
    """demo/run_demo.py's command line, as its __main__ parses it."""
    sys.path.insert(0, str(REPO / "demo"))
    try:
        import run_demo
    finally:
        sys.path.remove(str(REPO / "demo"))
    cli.tyro_cli(run_demo.Args, args=argv)


@pytest.mark.parametrize(
    "parse, argv",
    [
        (train_policy.parse, []), (train_reward.parse, []), (evaluate.parse, []), (train_both.parse, []),
        *[(label_generation.parse, [command]) for command in ("generate", "sample", "serve", "convert", "agreement")],
        (run_demo_help, []),
    ],
)  # fmt: skip
def test_help_never_breaks_a_flags_sentence(parse, argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit:
        parse([*argv, "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert text.count("\n") > 10 and sentence_breaks(text, 80) == []


def test_keep_line_breaks_and_add_options_in_both_box_styles():
    doc = "Title line\nwrapped on.\n\nRun:   a command\nSteps: one, two\n    indented code\nProse after it."
    assert cli.keep_line_breaks(doc).split("\n") == [
        "Title line", "wrapped on.", "", "Run:   a command", "", "Steps: one, two", "    indented code", "",
        "Prose after it.",
    ]  # fmt: skip
    boxed = "╭─ options ─╮\n│ -h, --help    show this help message and exit │\n│ --seed INT    seed        │\n╰─╯"
    out = cli.add_options(boxed, {"--debug": "tracebacks", "--task {alpha,beta}": "preset"}).split("\n")
    width = len(boxed.split("\n")[1])
    assert out[2] == "│ --debug".ljust(16) + "tracebacks".ljust(width - 17) + "│"  # the help's column: 16
    assert (
        out[3] == "│ --task {alpha,beta}".ljust(width - 1) + "│"
        and out[4] == " " * 16 + "preset".ljust(width - 17) + "│"
    )
    assert out[5].startswith("│ --seed INT") and all(len(line) == width for line in out[1:5])
    plain = "  -h, --help   show this help message and exit \n  --seed INT   seed"
    assert cli.add_options(plain, {"--debug": "tracebacks"}).split("\n")[1].rstrip() == "  --debug      tracebacks"


def test_dry_run_prints_the_sizes_and_touches_nothing(tmp_path):
    out = tmp_path / ("x" * 150) / "out"  # longer than the console's 160 columns: printed whole under the table
    policy = run("train_policy.py", "--dry_run", "--output_dir", str(out))
    assert "1954" in policy.stdout and "7816" in policy.stdout  # nupdates and optimizer steps of the sentiment preset
    # the dry run checks the inputs: the default reward model models/reward does not exist here
    assert policy.returncode == 2 and "pass --rewards.trained_model DIR" in policy.stderr
    reward = run("train_reward.py", "--dry_run", "--output_dir", str(out))
    assert reward.returncode == 0, reward.stderr
    assert "156 (one epoch over 4992 labels)" in reward.stdout and "1 x 512" in reward.stdout
    assert f"output dir: {out}" in reward.stdout.splitlines()
    assert not out.exists()


def test_label_generation_dry_run_writes_nothing(tmp_path, tiny_model_dir):
    output = tmp_path / ("x" * 150) / "labels.json"
    result = run(
        "label_generation.py", "generate", "--base_model", tiny_model_dir, "--output", str(output), "--dry_run"
    )
    assert result.returncode == 0, result.stderr
    assert "vader" in result.stdout and f"output: {output}" in result.stdout.splitlines()
    assert not output.exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_input_is_one_line_and_debug_shows_the_traceback(script, tmp_path, tiny_model_dir):
    flags = {
        "train_reward.py": ("--base_model", str(tmp_path / "missing")),
        "train_policy.py": ("--rewards.trained_model", str(tmp_path / "missing"), "--base_model", tiny_model_dir),
        "label_generation.py": ("generate", "--labeler", "gpt4", "--base_model", str(tmp_path / "missing")),
    }[script]
    result = run(script, *flags)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and "missing" in lines[0] and "Traceback" not in result.stderr
    assert lines[-1] == "(run with --debug for the traceback)"
    debug = run(script, *flags, "--debug")
    assert debug.returncode not in (0, 2) and "Traceback" in debug.stderr
    env_debug = run(script, *flags, env={cli.DEBUG_ENV: "1"})
    assert "Traceback" in env_debug.stderr


def test_hub_name_offline_is_one_line():
    result = run("train_reward.py", "--base_model", "gpt2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "hub is unreachable" in result.stderr and "--base_model DIR" in result.stderr


def test_a_run_that_ends_well_leaves_the_process_group_and_one_that_fails_does_not(monkeypatch):
    # a process that exits with the group still up can abort in its teardown after its work is done (SIGABRT)
    import torch.distributed as dist

    left, at_exit = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: left.append(True))
    monkeypatch.setattr(cli.atexit, "register", at_exit.append)
    cli.run(lambda args: None, lambda argv: argv, [])
    # at the program's exit, not at once: a second script run in the same process reuses accelerate's process group
    assert left == [] and at_exit == [cli.end_process_group]
    at_exit.pop()()
    assert left == [True]

    def failing(args):
        raise ValueError("bad flag")

    with pytest.raises(SystemExit):  # the others may be gone: leaving the group could wait for them
        cli.run(failing, lambda argv: argv, [])
    assert left == [True] and at_exit == []


HELP_FLAGS = REPO / "tests" / "help_flags"
"""each training script's flags as its --help listed them before the run group (settings.py) moved its engineering
flags into one nested group: a user's command lines must keep working"""


def listed_flags(help_text: str) -> set[str]:
    """The option names of a tyro --help text: the `--flag` (and `--no_flag`) that starts a cell of its boxes."""
    flags = set()
    for line in help_text.splitlines():
        for cell in (cell.strip() for cell in line.split("│")):
            if cell.startswith("--"):
                names = [part.split(" ")[0] for part in re.split(r"\s{2,}", cell)[0].split(", ")]
                flags |= {name for name in names if re.fullmatch(r"--[a-z0-9_.]+", name)}
    return flags


@pytest.mark.parametrize("script", ["train_policy", "train_reward", "train_sft"])
def test_help_lists_every_flag_it_listed_before_the_run_group(script, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")  # one box per row: a wider terminal puts boxes side by side and cuts cells
    module = importlib.import_module(script)
    with pytest.raises(SystemExit):
        module.parse(["--help"])
    before = set((HELP_FLAGS / f"{script}.txt").read_text(encoding="utf-8").split())
    assert listed_flags(capsys.readouterr().out) == before
