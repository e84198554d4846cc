"""The house plan: scripts import only the package (never each other; train_both.py runs the two training scripts),
the package has no import cycle."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lm_human_preference_details"
SCRIPTS = sorted(p.stem for p in REPO.glob("*.py"))


def imports(path: Path) -> set[str]:
    """Top-level module names imported by a file (relative to the repository root)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_script_imports_another_script():
    users = [*REPO.glob("*.py"), *REPO.glob("demo/*.py"), *REPO.glob("benchmark/*.py"), *REPO.glob(f"{PACKAGE}/*.py")]
    assert SCRIPTS, "no scripts found"
    for path in users:
        imported = {name.split(".")[0] for name in imports(path)}
        scripts = imported & set(SCRIPTS) - {path.stem}
        if path.parent.name == "benchmark" or path.stem == "train_both":  # they call the scripts' parse and main
            continue
        assert not scripts, f"{path.relative_to(REPO)} imports the script(s) {sorted(scripts)}; import the package"


def test_package_has_no_import_cycle():
    modules = {p.stem: p for p in (REPO / PACKAGE).glob("*.py") if p.stem != "__init__"}
    graph = {
        name: {n.split(".")[1] for n in imports(path) if n.startswith(f"{PACKAGE}.") and n.split(".")[1] in modules}
        for name, path in modules.items()
    }

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join((*stack, name))}"
        for dep in graph[name]:
            visit(dep, (*stack, name))

    for name in graph:
        visit(name, ())


def test_whitening_is_written_once():
    sources = [p.read_text() for p in [*REPO.glob("*.py"), *(REPO / PACKAGE).glob("*.py")]]
    assert sum(src.count("torch.rsqrt(var + 1e-8)") for src in sources) == 1
