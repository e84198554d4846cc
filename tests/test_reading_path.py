"""tools/reading_path.py counts a training script's reading path by the rules of its docstring."""

import ast
import re
from pathlib import Path

import pytest

from tools import reading_path

REPO = Path(__file__).resolve().parents[1]

_TOY_SCRIPT = '''
from dataclasses import dataclass, field
import time
from lm_human_preference_details import core
from lm_human_preference_details.modeling import sample
from lm_human_preference_details.ppo_plumbing import start_tracker


@dataclass
class Inner:
    lr: float = 1.0


@dataclass
class Args:
    seed: int = 1
    inner: Inner = field(default_factory=Inner)


LIMIT = 3


def losses(x):
    ratio = x.exp()
    return ratio


def main(args):
    """Docstring."""
    accelerator = core.make_accelerator(1.0)
    tracker = start_tracker(args, accelerator)
    # a comment
    x = sample(args.seed, accelerator.device)
    if accelerator.is_main_process:
        print(x)
    start = time.time()
    y = losses(
        x,
    )
    tracker.log({"y": y})
    return y
'''

_TOY_LAYOUT = {"core", "modeling", "ppo_plumbing"}
"""the toy package's modules"""


def test_reading_path_counts_a_script_by_its_documented_rules():
    count = reading_path.count(_TOY_SCRIPT, "toy.py", modules=_TOY_LAYOUT)
    lines = _TOY_SCRIPT.splitlines()
    assert count.total_lines == len(lines)
    assert lines[count.anchor_line - 1].strip() == "ratio = x.exp()"
    # imported from the package, then defined above the anchor line: dataclasses, a constant, the function holding it
    assert count.concepts == ["core", "sample", "start_tracker", "Inner", "Args", "LIMIT", "losses"]
    assert count.fields == ["Args.seed", "Args.inner", "Inner.lr"]
    assert count.main_lines == lines.index("    return y") - lines.index("def main(args):") + 1
    # algorithm: the sample call (it also reads the accelerator), the three lines of the losses call, the return;
    # plumbing: the accelerator, the tracker and its log, the print and its `if`, the time
    algorithm = [lines[line - 1].strip() for line in count.algorithm_lines]
    assert algorithm == ["x = sample(args.seed, accelerator.device)", "y = losses(", "x,", ")", "return y"]
    assert count.algorithm_statements == 3


def test_the_scripts_are_every_training_script():
    training = [
        path.name
        for path in sorted(REPO.glob("train_*.py"))
        if re.search(r"^class Args\b", path.read_text(encoding="utf-8"), re.MULTILINE)
    ]
    assert sorted(reading_path.SCRIPTS) == training


@pytest.mark.parametrize("script", reading_path.SCRIPTS)
def test_reading_path_finds_the_first_math_line_of_each_script(script):
    source = (REPO / script).read_text(encoding="utf-8")
    count = reading_path.count(source, script)
    assert count.anchor_line is not None, f"{script} has no line matching its anchor: update reading_path's ANCHORS"
    # the math is code of one of the script's functions, met after its configuration
    tree = ast.parse(source)
    holders = [
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.lineno < count.anchor_line <= n.end_lineno
    ]
    assert holders, f"{script}: the anchor line {count.anchor_line} is in no function"
    assert "Args" in count.concepts and count.fields and 0 < len(count.algorithm_lines) < count.main_lines


_SFT_SOURCE = '''"""Trains with F.cross_entropy(logits, labels); a docstring that quotes the loss is no math:
loss = F.cross_entropy(logits, labels)
"""

import torch.nn.functional as F

IGNORE_INDEX = -100
"""F.cross_entropy(...)'s default ignore_index"""


def loss_sum(logits, targets):
    # F.cross_entropy(...) sums here
    return F.cross_entropy(
        logits, targets, reduction="sum"
    )


def mean_loss(logits, targets):
    loss = F.cross_entropy(logits, targets)
    return loss
'''


def test_the_anchors_find_the_first_math_line_past_comments_and_docstrings():
    lines = _SFT_SOURCE.splitlines()
    count = reading_path.count(_SFT_SOURCE, "train_sft.py", modules=set())
    assert lines[count.anchor_line - 1] == "    return F.cross_entropy("
    for call in ("torch.nn.functional.cross_entropy(", "cross_entropy(", "nn.functional.cross_entropy("):
        variant = _SFT_SOURCE.replace("return F.cross_entropy(", f"return {call}")
        assert reading_path.count(variant, "train_sft.py", modules=set()).anchor_line == count.anchor_line
    assert (
        reading_path.count(_SFT_SOURCE, "train_sft.py", r"^\s*loss\s*=", set()).anchor_line
        == lines.index("    loss = F.cross_entropy(logits, targets)") + 1
    )
    ratio = '''"""The policy loss:
ratio = exp(new - old)
"""
# ratio = later
def losses(new, old):
    ratios = new - old
    ratio = (new - old).exp()
    return ratio
'''
    for script in ("train_policy.py", "any_script.py"):
        assert reading_path.count(ratio, script, modules=set()).anchor_line == 7
    reward = "def f(x):\n    losses = x\n    # loss = x\n    loss = x.mean()\n"
    assert reading_path.count(reward, "train_reward.py", modules=set()).anchor_line == 4
    assert reading_path.count("x = 1\n", "train_sft.py", modules=set()).anchor_line is None


def test_an_import_from_a_sub_package_binds_its_module_and_an_import_from_a_module_binds_a_name():
    source = """
from lm_human_preference_details import tasks, VERSION
from lm_human_preference_details import sizes as sizing
from lm_human_preference_details.nplus import critic as nplus_critic, NPLUS_TASKS
from lm_human_preference_details.nplus.deep import leaf
from lm_human_preference_details.modeling import sample
from lm_human_preference_details.instruments import metrics
import lm_human_preference_details.devices as devs
from accelerate import Accelerator
"""
    layout = {"tasks", "sizes", "nplus", "nplus.critic", "nplus.deep", "nplus.deep.leaf", "modeling", "instruments"}
    imports = reading_path.package_imports(ast.parse(source), layout)
    assert [(i.name, i.module, i.binds_module) for i in imports] == [
        ("tasks", "tasks", True),
        ("VERSION", "", False),  # a name of the package's __init__, not a module
        ("sizing", "sizes", True),
        ("nplus_critic", "nplus.critic", True),
        ("NPLUS_TASKS", "nplus", False),
        ("leaf", "nplus.deep.leaf", True),
        ("sample", "modeling", False),
        ("metrics", "instruments", False),  # not in this layout: a name of the sub-package instruments
        ("devs", "devices", True),
    ]
    assert [i.line for i in imports] == [2, 2, 3, 4, 4, 5, 6, 7, 8]


def test_the_package_layout_holds_its_modules_and_sub_packages():
    layout = reading_path.package_modules()
    assert {"devices", "sizes", "modeling", "nplus", "nplus.critic", "instruments.host_syncs"} <= layout
    assert "" not in layout and not any(module.endswith("__init__") for module in layout)


_DECLARED_PLUMBING_RE = re.compile(r"name their module \(([^)]*)\)")


def declared_plumbing(source: str) -> set[str]:
    """The names of the comment just above a script's `main` (and its decorators): "The plumbing calls name their
    module (checkpoint., cli., ...)"."""
    lines = source.splitlines()
    main = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    line = min([main.lineno] + [decorator.lineno for decorator in main.decorator_list]) - 1
    comment = []
    while line >= 1 and lines[line - 1].lstrip().startswith("#"):
        comment.insert(0, lines[line - 1].lstrip().removeprefix("#").strip())
        line -= 1
    match = _DECLARED_PLUMBING_RE.search(" ".join(comment))
    assert match, f"no 'The plumbing calls name their module (a., b., ...)' comment just above main: {comment}"
    return {name.strip().removesuffix(".") for name in match.group(1).split(",")}


@pytest.mark.parametrize("script", reading_path.SCRIPTS)
def test_the_plumbing_modules_of_a_script_are_those_its_comment_above_main_declares(script):
    source = (REPO / script).read_text(encoding="utf-8")
    imports = reading_path.package_imports(ast.parse(source), reading_path.package_modules())
    plumbing = {i.name for i in imports if i.binds_module and reading_path.is_plumbing_module(i.module)}
    assert plumbing == declared_plumbing(source), (
        f"{script}: the modules tools/reading_path.py reads as plumbing differ from those the comment above main "
        "declares: update the comment or PLUMBING_MODULES"
    )


def test_a_declared_plumbing_comment_reads_the_bound_names():
    source = """
import x
# The plumbing calls name their module (checkpoint., sizing.,
# ppo_plumbing.): skip them to read the algorithm.
@decorator
def main(args):
    pass
"""
    assert declared_plumbing(source) == {"checkpoint", "sizing", "ppo_plumbing"}


def test_a_module_is_plumbing_by_its_path_its_last_name_or_a_part_naming_plumbing():
    plumbing = [
        "devices",
        "sizes",
        "labels",
        "nplus.sft_plumbing",
        "instruments.host_syncs",
        "sft_plumbing",
        "plumbing.loop",
    ]
    algorithm = ["modeling", "nplus.critic", "nplus.sft_data", "tasks", "sft", "rewards", ""]
    assert [m for m in plumbing + algorithm if reading_path.is_plumbing_module(m)] == plumbing


_CONFIG_SCRIPT = '''from dataclasses import dataclass, field


@dataclass
class Unnested:
    a: int = 1


@dataclass
class Optimizer:
    lr: float = 1e-5
    """the learning rate"""


@dataclass
class Args:
    seed: int = 1
    optimizer: Optimizer = field(default_factory=Optimizer)


def oai_presets() -> dict[str, Args]:
    return {"a": Args()}


def books_preset(label_file):
    return label_file


def tuned(seed):
    return Args(seed=seed)


def helper() -> int:
    return 1


def losses(x):
    ratio = x.exp()
    return ratio


def parse() -> Args:
    return Args()
'''


def block(source: str, header: str) -> tuple[str, int, int]:
    """(name, first line, last line) of the top-level class or function whose `class`/`def` line starts with
    `header`: from its decorator to its last indented line."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    first = start - 1 if lines[start - 1].startswith("@") else start
    end = start + 1
    while end < len(lines) and (lines[end].startswith(" ") or not lines[end]):
        end += 1
    while not lines[end - 1]:
        end -= 1
    return header.split()[1], first + 1, end


def test_configuration_lines_are_args_its_nested_dataclasses_and_the_presets_above_the_math():
    count = reading_path.count(_CONFIG_SCRIPT, "toy.py", modules=set())
    # Unnested, helper and the anchor's function are no configuration; parse returns Args but lies below the anchor
    names = ("class Optimizer", "class Args", "def oai_presets", "def books_preset", "def tuned")
    assert count.configuration == [block(_CONFIG_SCRIPT, name) for name in names]
    assert count.config_lines == 4 + 4 + 2 + 2 + 2
    assert f"| {count.config_lines} |" in count.row()
    below = reading_path.count(_CONFIG_SCRIPT.replace("ratio = x.exp()", "y = x.exp()"), "toy.py", modules=set())
    assert below.configuration[-1] == block(_CONFIG_SCRIPT, "def parse")
    assert below.config_lines == count.config_lines + 2


def test_the_table_has_a_cell_per_column():
    header, rule = reading_path.HEADER.splitlines()
    row = reading_path.count(_CONFIG_SCRIPT, "toy.py", modules=set()).row()
    assert header.count("|") == rule.count("|") == row.count("|")
    assert "configuration lines" in header


def test_the_tool_prints_a_markdown_table_of_every_script(capsys):
    counts = reading_path.main([])
    printed = capsys.readouterr().out.splitlines()
    assert [result.script for result in counts] == list(reading_path.SCRIPTS)
    assert printed == reading_path.HEADER.splitlines() + [result.row() for result in counts]
