"""The house plan: scripts import only the package (never each other; train_both.py runs the two training scripts),
the package has no import cycle, and its rooms (sub-packages) stand above its modules: a module never imports a room,
a room never imports another, and no training script imports the instruments."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lm_human_preference_details"
SCRIPTS = sorted(p.stem for p in REPO.glob("*.py"))
ROOMS = ("labeling", "instruments", "nplus")
"""The package's sub-packages: the labeling server and its store, and the analysis instruments (compare, metrics,
host syncs) that benchmarks, tools and tests use; and the successor recipe's own parts (nplus)."""
ROOM_USERS = {
    "labeling": {"label_generation"},
    "instruments": set(),
    "nplus": {"train_sft", "train_policy", "train_reward", "train_both", "evaluate"},
}
"""The scripts at the repository root that may import each room (the demo, benchmarks, tools and tests may too)."""


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


def package_modules() -> dict[str, Path]:
    """The package's modules by dotted name below the package: `cli`, `labeling.labelstore`, ..."""
    paths = (REPO / PACKAGE).rglob("*.py")
    return {".".join(p.relative_to(REPO / PACKAGE).with_suffix("").parts): p for p in paths if p.stem != "__init__"}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that a file imports (`from PACKAGE.files import write_atomic` -> `files`)."""
    found = set()
    for name in imports(path):
        parts = name.split(".")
        if parts[0] != PACKAGE:
            continue
        dotted = [".".join(parts[1:k]) for k in range(len(parts), 1, -1)]
        found |= set([d for d in dotted if d in modules][:1])
    return found


def room_of(module: str) -> str | None:
    """The room that holds a module (`labeling.labelstore` -> `labeling`), None for the package's own modules."""
    first = module.split(".")[0]
    return first if first in ROOMS else None


def test_no_script_imports_another_script():
    users = [*REPO.glob("*.py"), *REPO.glob("demo/*.py"), *REPO.glob("benchmark/*.py"), *(REPO / PACKAGE).rglob("*.py")]
    assert SCRIPTS, "no scripts found"
    for path in users:
        imported = {name.split(".")[0] for name in imports(path)}
        scripts = imported & set(SCRIPTS) - {path.stem}
        if path.parent.name == "benchmark" or path.stem == "train_both":  # they call the scripts' parse and main
            continue
        assert not scripts, f"{path.relative_to(REPO)} imports the script(s) {sorted(scripts)}; import the package"


def test_package_has_no_import_cycle():
    modules = package_modules()
    assert {room_of(name) for name in modules} >= set(ROOMS), "a room is missing"
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import cycle: {' -> '.join((*stack, name))}"
        for dep in graph[name]:
            visit(dep, (*stack, name))

    for name in graph:
        visit(name, ())


def test_rooms_stand_above_the_package_modules():
    modules = package_modules()
    for name, path in modules.items():
        rooms = {room_of(dep) for dep in imported_modules(path, modules)} - {None, room_of(name)}
        below = "a room imports only the package's modules" if room_of(name) else "a module never imports a room"
        assert not rooms, f"{path.relative_to(REPO)} imports the room(s) {sorted(rooms)}: {below}"


def test_scripts_import_only_their_rooms():
    modules = package_modules()
    for path in REPO.glob("*.py"):
        rooms = {room_of(dep) for dep in imported_modules(path, modules)} - {None}
        unexpected = {room for room in rooms if path.stem not in ROOM_USERS[room]}
        assert not unexpected, f"{path.name} imports the room(s) {sorted(unexpected)}, which no training script uses"


def test_whitening_is_written_once_per_recipe():
    # OAI's whiten in train_policy.py, beside GAE; the successor's masked whitening in its room (nplus N22, N23), which
    # nothing of OAI's recipe imports: each tested against its own re-derivation
    sources = {p: p.read_text() for p in [*REPO.glob("*.py"), *(REPO / PACKAGE).rglob("*.py")]}
    written = {p.relative_to(REPO).as_posix(): src.count("torch.rsqrt(var + 1e-8)") for p, src in sources.items()}
    assert {path: count for path, count in written.items() if count} == {
        "train_policy.py": 1,
        f"{PACKAGE}/nplus/end_at_eos.py": 1,
    }
