"""How much a reader meets before a training script's RL math, and how much of its `main` is the algorithm.

    python tools/reading_path.py                         # the three training scripts as checked out
    python tools/reading_path.py --rev 37272d1           # the same scripts at a commit (those it has)
    python tools/reading_path.py train_policy.py -v      # also list concepts, configuration, algorithm lines

One table row per script, every count taken from the script's syntax tree (`ast`), the same way for every script:

- total lines: the file's lines.
- first math line: the first line that matches the anchor (ANCHORS): `ratio =` (PPO's probability ratio) for
  train_policy.py and any other script, `loss =` (the reward model's label loss) for train_reward.py, a call of
  `cross_entropy(` outside a comment (the next-token loss, `F.cross_entropy(...)`) for train_sft.py; `--anchor REGEX`
  picks another. The lines of a docstring (or any bare string) are skipped: a string that quotes the math is none.
- concepts before it: the module-level names defined above that line (functions, classes, constants) plus every name
  imported from the project's package (`from lm_human_preference_details.x import a, b` is a and b,
  `from lm_human_preference_details import core` is core). An imported name is a module when the package has a
  module or sub-package of that path (`from lm_human_preference_details.nplus import critic` binds the module
  nplus.critic, as nplus/critic.py exists), else a name of the module it is imported from
  (`from lm_human_preference_details.modeling import sample` binds a name of modeling); the package's layout is read
  from the working tree, or at the commit of `--rev`. In brackets, the configuration fields met above it: the
  dataclass fields of `Args` and of the script's own dataclasses that `Args` nests (directly or through another).
- configuration lines: the lines a reader crosses in the script's configuration above the first math line: those of
  `Args` and of the script's dataclasses that it nests, and those of its preset functions (module-level functions
  named `...presets` or `...preset`, or that return `Args`: `-> Args`, `-> dict[str, Args]`, `return Args(...)`),
  each from its first decorator to its last line.
- main: the lines of `def main` from its `def` to its last line, then how many of them are algorithm lines: the
  non-blank, non-comment lines of main's statements, its docstring excluded, that are not plumbing; in brackets the
  algorithm statements (a block's header is one), which line wrapping does not change. A statement is plumbing when
  * every call in it is a plumbing call, i.e. its callee's root name is a plumbing name; or it has no call and reads
    a plumbing name (calls of Python's builtins, `len(...)`, `range(...)`, decide nothing: they count as no call);
  * or it is bookkeeping: its outermost call prints or logs (`print(...)`, `X.print(...)`, `X.log(...)`);
  * or it is a block (`if`, `with`, `def`, ...) whose header is plumbing by the rules above, or whose body is all
    plumbing;
  * or it has no call and reads no plumbing name (`x = y.z`, `return`, `pass`) and every other statement of its
    block is plumbing.
  Plumbing names: the plumbing modules of the package and every name imported from one (a module is plumbing when
  PLUMBING_MODULES lists its path or its last name, or when a part of its path contains "plumbing": ppo_plumbing,
  reward_plumbing, nplus.sft_plumbing; these are the modules that each script's comment above `main` declares
  plumbing); the standard library's bookkeeping (BOOKKEEPING_NAMES: print, time, os, dataclasses, ...); and every
  name that main binds from a plumbing call or a plumbing `def` (the accelerator, console, tracker, progress bar,
  saves, stop signal, ...), found by repeating the pass until nothing changes. A name bound by merely reading plumbing
  (`first = resumed.step`) stays algorithm, and so do main's parameters (`args`), whatever returns them.
  Everything else is algorithm, calls into the script's own functions included. A block's header lines (an `if`
  test, a `for` line, `else:`) count as its header does.
"""

import argparse
import ast
import builtins
import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lm_human_preference_details"
SCRIPTS = ("train_policy.py", "train_reward.py", "train_sft.py")
# the first math line per script: reward, the label loss; SFT, the next-token cross-entropy (`F.cross_entropy(`,
# `torch.nn.functional.cross_entropy(` or an imported `cross_entropy(`, wherever its line starts: `return`, `loss =`)
# with no `#` before it on its line
ANCHORS = {"train_reward.py": r"^\s*loss\s*=", "train_sft.py": r"^[^#]*\bcross_entropy\("}
DEFAULT_ANCHOR = r"^\s*ratio\s*="
# the package's modules that hold no RL math, by path or last name: processes, devices, sizes, command line, checks,
# checkpoints, the output directory's claim, the loop's resume and saves, tracking, files, the hub, label files; any
# module with "plumbing" in a part of its path too (ppo_plumbing, reward_plumbing, nplus.sft_plumbing: see
# is_plumbing_module)
PLUMBING_MODULES = {
    "checkpoint",
    "cli",
    "core",
    "devices",
    "distributed",
    "files",
    "host_syncs",
    "hub",
    "labels",
    "output_claim",
    "resumable",
    "resume_check",
    "settings",
    "sizes",
    "tracking",
    "validation",
}
BUILTINS = set(dir(builtins)) - {"print"}  # len(...), list(...), range(...): they decide nothing
HEADER = (
    "| script | total lines | first math line | concepts before it (+fields) | configuration lines "
    "| lines of main, of them algorithm |\n"
    "|---|---|---|---|---|---|"
)
BOOKKEEPING_NAMES = {"contextlib", "dataclasses", "json", "os", "print", "shutil", "sys", "time", "wandb"}


@dataclasses.dataclass
class PathCount:
    """One script's row of the reading-path table."""

    script: str
    total_lines: int
    anchor_line: int | None
    concepts: list[str]
    fields: list[str]
    configuration: list[tuple[str, int, int]]  # (class or function, first line, last line) above the anchor line
    config_lines: int
    main_lines: int
    algorithm_lines: list[int]
    algorithm_statements: int

    def row(self) -> str:
        """The markdown table row."""
        main = f"{self.main_lines}, {len(self.algorithm_lines)} ({self.algorithm_statements} statements)"
        anchor = self.anchor_line if self.anchor_line is not None else "-"
        concepts = f"{len(self.concepts)} (+{len(self.fields)} fields)"
        return f"| {self.script} | {self.total_lines} | {anchor} | {concepts} | {self.config_lines} | {main} |"


def is_plumbing_module(module: str) -> bool:
    """Whether `lm_human_preference_details.a.b` (given as "a.b") is a plumbing module: PLUMBING_MODULES lists its
    path or its last name, or a part of its path contains "plumbing" (ppo_plumbing, a plumbing sub-package)."""
    parts = module.split(".")
    return module in PLUMBING_MODULES or parts[-1] in PLUMBING_MODULES or any("plumbing" in part for part in parts)


class PackageImport(NamedTuple):
    """One name a module-level import from the package binds."""

    line: int
    name: str  # the name bound in the script (`nplus_critic` of `... import critic as nplus_critic`)
    module: str  # the module's path inside the package ("nplus.critic"; "" is the package's own __init__)
    binds_module: bool  # the name is the module itself, not one of the module's names


@functools.cache
def package_modules(rev: str | None = None) -> frozenset[str]:
    """The paths inside the package ("devices", "nplus", "nplus.critic") of its modules and sub-packages, in the
    working tree or at commit `rev`."""
    if rev is None:
        files = [path.relative_to(REPO).as_posix() for path in (REPO / PACKAGE).rglob("*.py")]
    else:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", rev, "--", PACKAGE], cwd=REPO, capture_output=True, text=True
        )
        if listed.returncode != 0:
            sys.exit(f"error: git ls-tree {rev} {PACKAGE} failed: {listed.stderr.strip()}")
        files = [name for name in listed.stdout.splitlines() if name.endswith(".py")]
    modules = set()
    for file in files:
        parts = file.removesuffix(".py").split("/")[1:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        # a module's folders are sub-packages too (with or without an __init__.py)
        modules |= {".".join(parts[:end]) for end in range(1, len(parts) + 1)}
    return frozenset(modules)


def package_imports(tree: ast.Module, modules: frozenset[str] | set[str]) -> list[PackageImport]:
    """Every name that a module-level import from the package binds; `modules` is the package's layout
    (`package_modules`), which tells a module (`from package.nplus import critic`) from a name of a module
    (`from package.modeling import sample`)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE:
            inner = node.module[len(PACKAGE) + 1 :]
            for alias in node.names:
                path = f"{inner}.{alias.name}" if inner else alias.name
                binds_module = path in modules
                found.append(
                    PackageImport(
                        node.lineno, alias.asname or alias.name, path if binds_module else inner, binds_module
                    )
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE and alias.name != PACKAGE:
                    found.append(
                        PackageImport(node.lineno, alias.asname or alias.name, alias.name[len(PACKAGE) + 1 :], True)
                    )
    return found


def defined_names(node: ast.stmt) -> list[str]:
    """The names a module-level statement defines (imports excluded)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def config_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """`Args` and the script's own dataclasses that it nests, directly or through another."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    found, todo = [], ["Args"]
    while todo:
        name = todo.pop(0)
        if name not in classes or classes[name] in found:
            continue
        found.append(classes[name])
        for field in classes[name].body:
            if isinstance(field, ast.AnnAssign):
                todo += [n.id for n in ast.walk(field.annotation) if isinstance(n, ast.Name)]
    return found


def returns_args(function: ast.FunctionDef) -> bool:
    """Whether a function returns `Args`: its return annotation names it (`Args`, `dict[str, Args]`, "Args"), or it
    returns `Args(...)`."""
    annotation = [] if function.returns is None else list(ast.walk(function.returns))
    annotated = any(
        (isinstance(n, ast.Name) and n.id == "Args")
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and re.search(r"\bArgs\b", n.value))
        for n in annotation
    )
    built = any(
        isinstance(n, ast.Return)
        and isinstance(n.value, ast.Call)
        and isinstance(n.value.func, ast.Name)
        and n.value.func.id == "Args"
        for n in ast.walk(function)
    )
    return annotated or built


def preset_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The script's module-level preset functions: named `...presets` or `...preset`, or returning `Args`."""
    return [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and (node.name.endswith(("presets", "preset")) or returns_args(node))
    ]


def first_line(node: ast.ClassDef | ast.FunctionDef) -> int:
    """A class's or function's first line: its first decorator's, else its `class`/`def` line."""
    return min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])


def root_name(node: ast.expr) -> str | None:
    """`a` of `a.b.c(...)`, `a[0].b`, `a().b`; None for anything else."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def own_parts(node: ast.stmt) -> list[ast.AST]:
    """What a statement evaluates itself: a block's header (test, iterable, context managers), a simple statement's
    whole expression; never the statements nested in a block."""
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in node.items]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try)):
        return []
    return [node]


def nested_blocks(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists a block holds (body, orelse, handlers' bodies, finalbody)."""
    blocks = [getattr(node, name) for name in ("body", "orelse", "finalbody") if getattr(node, name, None)]
    blocks += [handler.body for handler in getattr(node, "handlers", [])]
    return [block for block in blocks if block and isinstance(block[0], ast.stmt)]


def bound_names(node: ast.stmt) -> set[str]:
    """The names a statement of main binds: assignment and loop targets, `with ... as`, nested defs."""
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def is_docstring(node: ast.stmt) -> bool:
    """Whether a statement is a bare string (a docstring)."""
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


class MainCounter:
    """Sorts the statements of `main` into algorithm and plumbing (see the module docstring)."""

    def __init__(self, plumbing_names: set[str], parameters: set[str]):
        self.plumbing = set(plumbing_names)
        self.parameters = parameters  # main's own (`args`): the configuration, whatever plumbing returns it
        self.is_plumbing: dict[ast.stmt, bool] = {}

    def calls_plumbing(self, parts: list[ast.AST]) -> bool | None:
        """Whether the parts' calls make them plumbing (True) or algorithm (False); None when they call nothing."""
        every_call = [n for part in parts for n in ast.walk(part) if isinstance(n, ast.Call)]
        calls = [n for n in every_call if root_name(n.func) not in BUILTINS or root_name(n.func) in self.plumbing]
        if not calls:
            return None
        outer = calls[0]
        if isinstance(outer.func, ast.Name) and outer.func.id == "print":
            return True
        if isinstance(outer.func, ast.Attribute) and outer.func.attr in ("print", "log"):
            return True
        return all(root_name(call.func) in self.plumbing for call in calls)

    def reads_plumbing(self, parts: list[ast.AST]) -> bool | None:
        """The parts' calls decide; without a call, True when they read a plumbing name, else None (neutral)."""
        by_calls = self.calls_plumbing(parts)
        if by_calls is not None:
            return by_calls
        loads = [n for part in parts for n in ast.walk(part) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        return True if {n.id for n in loads} & self.plumbing else None

    def classify_block(self, block: list[ast.stmt]) -> bool:
        """Classify every statement of `block` (recursively); True when all of them are plumbing."""
        verdicts: dict[ast.stmt, bool | None] = {}
        for node in block:
            if is_docstring(node):
                self.is_plumbing[node] = True  # a docstring: not counted either way
                verdicts[node] = None
                continue
            inner = [self.classify_block(nested) for nested in nested_blocks(node)]
            own = self.reads_plumbing(own_parts(node))
            if own is None and not inner:
                verdicts[node] = None  # reads nothing either way (`x = y.z`, `return`): takes its block's verdict
                continue
            plumbing = bool(own) or (bool(inner) and all(inner))
            # what a plumbing call returns is plumbing (`tracker = start_tracker(...)`), as is a plumbing `def`;
            # a name merely read from plumbing (`first_update = resumed.step`) is not
            made_by_plumbing = self.calls_plumbing(own_parts(node)) or (not own_parts(node) and plumbing)
            if made_by_plumbing:
                self.plumbing |= bound_names(node) - self.parameters
            verdicts[node] = plumbing
            self.is_plumbing[node] = plumbing
        decided = [v for v in verdicts.values() if v is not None]
        all_plumbing = all(decided) if decided else False
        for node, verdict in verdicts.items():
            if verdict is None and node not in self.is_plumbing:
                self.is_plumbing[node] = all_plumbing
        return all(self.is_plumbing[node] for node in block)

    def run(self, main: ast.FunctionDef) -> None:
        """Classify until the set of plumbing names stops growing."""
        while True:
            before = set(self.plumbing)
            self.is_plumbing = {}
            self.classify_block(main.body)
            if self.plumbing == before:
                return


def line_owners(main: ast.FunctionDef) -> dict[int, ast.stmt]:
    """Each line of main's body -> the innermost statement it belongs to (a block's header lines to the block)."""
    owners: dict[int, ast.stmt] = {}

    def visit(block: list[ast.stmt]) -> None:
        for node in block:
            for line in range(node.lineno, node.end_lineno + 1):
                owners[line] = node
            for nested in nested_blocks(node):
                visit(nested)

    visit(main.body)
    return owners


def count(
    source: str, script: str, anchor: str | None = None, modules: frozenset[str] | set[str] | None = None
) -> PathCount:
    """The reading-path row of one script's source; `modules`: the package's layout (default: the working tree's)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    pattern = re.compile(anchor or ANCHORS.get(Path(script).name, DEFAULT_ANCHOR))
    strings = {
        line for node in ast.walk(tree) if is_docstring(node) for line in range(node.lineno, node.end_lineno + 1)
    }
    anchor_line = next((i for i, line in enumerate(lines, start=1) if i not in strings and pattern.search(line)), None)
    before = anchor_line if anchor_line is not None else len(lines) + 1
    imports = package_imports(tree, package_modules() if modules is None else modules)
    concepts = [imported.name for imported in imports if imported.line < before]
    for node in tree.body:
        if node.lineno < before and not isinstance(node, (ast.Import, ast.ImportFrom)):
            concepts += [name for name in defined_names(node) if name not in concepts]
    fields = [
        f"{cls.name}.{node.target.id}"
        for cls in config_classes(tree)
        if cls.lineno < before
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]
    configuration = [
        (node.name, first_line(node), node.end_lineno)
        for node in sorted(config_classes(tree) + preset_functions(tree), key=first_line)
        if node.lineno < before
    ]
    config_lines = sum(last - first + 1 for _, first, last in configuration)
    head = (script, len(lines), anchor_line, concepts, fields, configuration, config_lines)
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    if main is None:
        return PathCount(*head, 0, [], 0)
    plumbing = {imported.name for imported in imports if is_plumbing_module(imported.module)} | BOOKKEEPING_NAMES
    counter = MainCounter(plumbing, {arg.arg for arg in main.args.args})
    counter.run(main)
    owners = line_owners(main)
    algorithm = [
        line
        for line, owner in sorted(owners.items())
        if not counter.is_plumbing[owner] and lines[line - 1].strip() and not lines[line - 1].strip().startswith("#")
    ]
    statements = len({id(owners[line]) for line in algorithm})
    main_lines = main.end_lineno - main.lineno + 1
    return PathCount(*head, main_lines, algorithm, statements)


def read_source(script: str, rev: str | None) -> str:
    """The script's text, from the working tree or from `git show REV:SCRIPT`."""
    if rev is None:
        return (REPO / script).read_text(encoding="utf-8")
    shown = subprocess.run(["git", "show", f"{rev}:{script}"], cwd=REPO, capture_output=True, text=True)
    if shown.returncode != 0:
        sys.exit(f"error: git show {rev}:{script} failed: {shown.stderr.strip()}")
    return shown.stdout


def exists_at(script: str, rev: str) -> bool:
    """Whether commit `rev` has the file `script` (train_sft.py is younger than the other scripts)."""
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{script}"], cwd=REPO, capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> list[PathCount]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "scripts", nargs="*", help="scripts, relative to the repository root (default: SCRIPTS, those the commit has)"
    )
    parser.add_argument("--rev", help="read the scripts at this git commit instead of the working tree")
    parser.add_argument("--anchor", help="regex of the first math line (default: per script, see above)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="list the concepts, the configuration and the algorithm lines"
    )
    options = parser.parse_args(argv)
    scripts = options.scripts or [script for script in SCRIPTS if options.rev is None or exists_at(script, options.rev)]
    print(HEADER)
    counts = []
    for script in scripts:
        source = read_source(script, options.rev)
        counts.append(count(source, script, options.anchor, package_modules(options.rev)))
        print(counts[-1].row())
    if options.verbose:
        for result in counts:
            lines = read_source(result.script, options.rev).splitlines()
            print(f"\n{result.script}: concepts {', '.join(result.concepts)}")
            print(f"{result.script}: fields {', '.join(result.fields)}")
            blocks = ", ".join(f"{name} {first}-{last}" for name, first, last in result.configuration)
            print(f"{result.script}: configuration {blocks}")
            print(f"{result.script}: algorithm lines of main")
            for line in result.algorithm_lines:
                print(f"{line:5d} {lines[line - 1]}")
    return counts


if __name__ == "__main__":
    main()
