"""tools/reading_path.py counts a training script's reading path by the rules of its docstring."""

import ast
import re
from pathlib import Path

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


def test_reading_path_finds_the_first_ratio_and_the_reward_loss_of_the_scripts():
    for script, anchor in (("train_policy.py", r"^\s*ratio\s*="), ("train_reward.py", r"^\s*loss\s*=")):
        source = (REPO / script).read_text(encoding="utf-8")
        count = reading_path.count(source, script)
        first = next((i for i, line in enumerate(source.splitlines(), start=1) if re.search(anchor, line)), None)
        assert first is not None, f"{script} has no line matching {anchor!r}: update tools/reading_path.py's ANCHORS"
        assert count.anchor_line == first
        assert "Args" in count.concepts and count.fields and 0 < len(count.algorithm_lines) < count.main_lines


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
