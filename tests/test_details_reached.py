"""Every function that docs/details.md names as this project's code for a detail is one that the scripts run.

A detail's guarding test must test the code that training runs, not a twin of it that only tests call. The check is a
static call graph over the project's source: names resolved through imports, methods by name (`x.step()` reaches every
method `step`), a class reaching its special methods and `forward` (which Python and nn.Module call for it). It starts
at what `python SCRIPT.py` runs: the `if __name__ == "__main__":` block of each script, which runs `parse`, then `main`.
"""

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DETAILS = REPO / "docs" / "details.md"
PACKAGE = "lm_human_preference_details"
SCRIPTS = ("train_policy.py", "train_reward.py", "label_generation.py", "evaluate.py", "train_both.py")
"""the scripts a user runs"""

_ROW_RE = re.compile(r"^\| \[([^\]]+)\]\(implementation-details\.md#[\w.-]+\)(.*)\|\s*$", re.MULTILINE)
_FILE_LINK_RE = re.compile(r"\bin \[[^\]]+\]\(\.\./([^)\s]+\.py)\)")
_CODE_NAME_RE = re.compile(r"`([A-Za-z_][\w.]*)`")
_CALLED_FOR_A_CLASS = re.compile(r"__\w+__|forward")
"""methods that run without being named: Python's special methods, and `forward` (run by nn.Module.__call__)"""


@dataclass
class Module:
    """One source file of the project: its definitions and what its names refer to."""

    name: str
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)
    """qualified name (`f`, `C`, `C.m`) -> its def"""
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    """local name -> (module, name), name None when the local name is the module itself"""
    constants: set[str] = field(default_factory=set)
    """names assigned at the top level (`TASKS`)"""


def module_name(path: Path) -> str:
    """`train_policy`, `lm_human_preference_details.labels`, a package's `__init__.py` as the package."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def assigned_names(node: ast.AST) -> set[str]:
    """The names a statement assigns (`TASKS = ...`, `OAI_RANKS: int = 8`); empty for any other statement."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return {target.id for target in targets if isinstance(target, ast.Name)}


def load_modules() -> dict[str, Module]:
    """The scripts and every module of the package, parsed."""
    paths = [REPO / script for script in SCRIPTS] + sorted((REPO / PACKAGE).rglob("*.py"))
    modules = {}
    for path in paths:
        module = Module(module_name(path), ast.parse(path.read_text(encoding="utf-8")))
        for node in module.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.defs[node.name] = node
            module.constants |= assigned_names(node)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        module.defs[f"{node.name}.{item.name}"] = item
        modules[module.name] = module
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name if alias.asname else alias.name.split(".")[0]
                    module.imports[alias.asname or name] = (name, None)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    target = (submodule, None) if submodule in modules else (node.module, alias.name)
                    module.imports[alias.asname or alias.name] = target
    return modules


def resolve(
    modules: dict[str, Module], module: str, name: str, seen: frozenset = frozenset()
) -> tuple[str, str] | None:
    """The (module, qualified name) that `name` of `module` is defined as, following imports and re-exports."""
    if module not in modules or (module, name) in seen:
        return None
    if name in modules[module].defs:
        return module, name
    target = modules[module].imports.get(name)
    if target is None or target[1] is None:
        return None
    return resolve(modules, *target, seen | {(module, name)})


def methods_by_name(modules: dict[str, Module]) -> dict[str, set[tuple[str, str]]]:
    """Method name -> every (module, `Class.method`) of that name."""
    methods = {}
    for module in modules.values():
        for qualname in module.defs:
            if "." in qualname:
                methods.setdefault(qualname.split(".")[1], set()).add((module.name, qualname))
    return methods


def references(
    modules: dict[str, Module], methods: dict[str, set[tuple[str, str]]], module: str, nodes: list[ast.AST]
) -> set[tuple[str, str]]:
    """The project definitions that `nodes` of `module` refer to: names, `module.name`, and methods by name."""
    found = set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                target = resolve(modules, module, node.id)
                if target:
                    found.add(target)
            elif isinstance(node, ast.Attribute):
                base = node.value.id if isinstance(node.value, ast.Name) else None
                imported = modules[module].imports.get(base) if base else None
                if imported and imported[1] is None:
                    target = resolve(modules, imported[0], node.attr)
                    if target:
                        found.add(target)
                found |= methods.get(node.attr, set())
    return found


def reached_from_the_scripts(modules: dict[str, Module]) -> set[tuple[str, str]]:
    """Every (module, qualified name) that the scripts' `__main__` blocks reach, with each module's top-level code."""
    roots = []
    for script in SCRIPTS:
        module = modules[module_name(REPO / script)]
        for node in module.tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                roots.append((module.name, node.body))
    methods = methods_by_name(modules)
    reached: set[tuple[str, str]] = set()
    imported: set[str] = set()
    todo = list(roots)
    while todo:
        module, nodes = todo.pop()
        if module not in imported:  # a module's top-level code runs when it is imported
            imported.add(module)
            top_level = [n for n in modules[module].tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            todo.append((module, top_level))
        for target in references(modules, methods, module, nodes):
            if target in reached:
                continue
            reached.add(target)
            target_module, qualname = target
            node = modules[target_module].defs[qualname]
            if isinstance(node, ast.ClassDef):
                body = [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                todo.append((target_module, [*node.decorator_list, *node.bases, *body]))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _CALLED_FOR_A_CLASS.fullmatch(
                        item.name
                    ):
                        reached.add((target_module, f"{qualname}.{item.name}"))
                        todo.append((target_module, [item]))
            else:
                todo.append((target_module, [node]))
    return reached


def named_code(text: str) -> list[tuple[str, str, str]]:
    """(detail tag, module, name) for every function, method or class that the "code" column of the details table
    names: the names in backticks before each "in [file](path)"; constants and `main` steps are left out by the
    caller (they are no definitions, or the root itself)."""
    named = []
    for tag, rest in _ROW_RE.findall(text):
        code = rest.split("|")[-2]
        start = 0
        for link in _FILE_LINK_RE.finditer(code):
            module = module_name(REPO / link.group(1))
            for name in _CODE_NAME_RE.findall(code[start : link.start()]):
                named.append((tag, module, name))
            start = link.end()
    return named


def unreached_details(text: str, modules: dict[str, Module]) -> list[str]:
    """The names of the details table that are a definition of the project that no script reaches, or no name of the
    module it links (a function that was renamed or removed)."""
    reached = reached_from_the_scripts(modules)
    unreached = []
    for tag, module, name in named_code(text):
        if module not in modules:
            unreached.append(f"{tag}: `{name}` in {module}, a module that is not the project's")
        elif name in modules[module].defs:
            if (module, name) not in reached:
                unreached.append(f"{tag}: `{name}` in {module}")
        elif name not in modules[module].constants:
            unreached.append(f"{tag}: `{name}` in {module}, which defines no such name")
    return unreached


def test_every_function_the_details_table_names_is_run_by_a_script():
    text = DETAILS.read_text(encoding="utf-8")
    modules = load_modules()
    named = named_code(text)
    definitions = [
        (tag, module, name) for tag, module, name in named if module in modules and name in modules[module].defs
    ]
    assert len(definitions) >= 40, f"docs/details.md names only {len(definitions)} functions of the project: {named}"
    unreached = unreached_details(text, modules)
    assert not unreached, (
        "docs/details.md names code that no script's `main` (or `parse`) reaches, so its tests guard code training "
        f"does not run; name the function the scripts call, or make them call it: {unreached}"
    )


def test_a_twin_that_only_tests_call_is_found():
    # a copy of a detail's function that the scripts never call, named in the table, is reported
    modules = load_modules()
    labels = modules[f"{PACKAGE}.labels"]
    twin = ast.parse("def best_of_n_loss(rewards, best):\n    return rewards\n").body[0]
    labels.tree.body.append(twin)
    labels.defs["best_of_n_loss"] = twin
    row = (
        "| [R5](implementation-details.md#r5) best-of-4 | [label_types.py](https://example.org) | `best_of_n_loss` in "
        "[labels.py](../lm_human_preference_details/labels.py); `label_loss` in [train_reward.py](../train_reward.py) "
        "| `test_best_of_n_loss_is_softmax_cross_entropy` |\n"
    )
    assert unreached_details(row, modules) == ["R5: `best_of_n_loss` in lm_human_preference_details.labels"]
