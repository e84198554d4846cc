"""The reader's guides stay true to the code: the spec named at the top of each training script, one list of the
`# DEVIATION (key):` markers (docs/deviations.md), a docs/layout.md row for every module of the package, the same help
for a flag both training scripts take."""

import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import typing
from pathlib import Path

import pytest

import train_policy
import train_reward
import train_sft

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lm_human_preference_details"
SPEC = REPO / "docs" / "implementation-details.md"
DEVIATIONS = REPO / "docs" / "deviations.md"
LAYOUT = REPO / "docs" / "layout.md"

# ---------------------------------------------------------------------------------------------------- spec X
_SPEC_NOTE_RE = re.compile(r"`spec X`[^\n]*\n?[^\n]*docs/implementation-details\.md#x\b")
_SPEC_EXAMPLE_RE = re.compile(r"spec ([A-Z]+\d+) is docs/implementation-details\.md#([a-z0-9-]+)")


@pytest.mark.parametrize("script", [train_policy, train_reward], ids=["train_policy", "train_reward"])
def test_script_docstring_names_the_file_that_spec_x_cites(script):
    doc = script.__doc__
    assert _SPEC_NOTE_RE.search(doc), (
        f"{script.__name__}.py: its docstring must say `spec X` is docs/implementation-details.md#x"
    )
    example = _SPEC_EXAMPLE_RE.search(" ".join(doc.split()))
    assert example, (
        f"{script.__name__}.py: its docstring gives no example `spec P5 is docs/implementation-details.md#p5`"
    )
    anchors = re.findall(r'<a id="([^"]+)"></a>', SPEC.read_text(encoding="utf-8"))
    assert example[2] == example[1].lower() and example[2] in anchors, f"no anchor #{example[2]} in {SPEC.name}"


# ---------------------------------------------------------------------------------------------------- deviations
# "# DEVIATION (key): reason" in the project's code; a bare "# DEVIATION:" has no key and fails the test below
_MARKER_RE = re.compile(r"#\s*DEVIATION\b(?:\s*\(([^)]*)\))?\s*:?")
_DEVIATION_ROW_RE = re.compile(r"^\| `([a-z0-9-]+)` \|", re.MULTILINE)
_FIX = (
    "Mark each deliberate difference from OAI in the code as `# DEVIATION (key): reason`, with the key of its row in "
    "docs/deviations.md (add a row there for a new difference: key, where, when, difference, why); a row whose "
    "markers are all gone is deleted."
)


def code_files() -> list[Path]:
    """The project's Python files, tests excluded."""
    skip = {"tests", ".git", ".venv", "venv", "build"}
    return sorted(p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts))


def deviation_markers() -> list[tuple[str | None, str]]:
    """(key or None, 'file:line') of every `# DEVIATION` marker in the project's code."""
    found = []
    for path in code_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in _MARKER_RE.finditer(line):
                found.append((match[1], f"{path.relative_to(REPO)}:{number}"))
    return found


def deviation_rows() -> list[str]:
    """The keys of docs/deviations.md's table, in order."""
    return _DEVIATION_ROW_RE.findall(DEVIATIONS.read_text(encoding="utf-8"))


def test_deviation_marker_parser_reads_keys_and_bare_markers():
    lines = [
        "x = 1  # DEVIATION (bf16-ratio): why",
        "# DEVIATION: no key",
        "# DEVIATION(pad-logit): tight",
        "# deviation",
    ]
    assert [m[1] for line in lines for m in _MARKER_RE.finditer(line)] == ["bf16-ratio", None, "pad-logit"]


def test_every_deviation_marker_has_a_row_and_every_row_a_marker():
    markers, rows = deviation_markers(), deviation_rows()
    assert len(rows) == len(set(rows)), f"docs/deviations.md has a key twice: {sorted(rows)}"
    unkeyed = [where for key, where in markers if not key]
    assert not unkeyed, f"`# DEVIATION` markers without a key at {unkeyed}. {_FIX}"
    unlisted = [f"{key} at {where}" for key, where in markers if key not in rows]
    assert not unlisted, f"`# DEVIATION` markers whose key has no row in docs/deviations.md: {unlisted}. {_FIX}"
    unmarked = sorted(set(rows) - {key for key, _ in markers})
    assert not unmarked, f"docs/deviations.md rows that no `# DEVIATION (key):` marker names: {unmarked}. {_FIX}"


def test_readme_and_docs_point_to_the_one_list_of_deviations():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count("(docs/deviations.md)") == 1, "README.md links to docs/deviations.md in one line"
    for page in ("details.md", "implementation-details.md"):
        text = (REPO / "docs" / page).read_text(encoding="utf-8")
        assert "(deviations.md)" in text, f"docs/{page} does not link to deviations.md"
        assert "| why |" not in text, f"docs/{page} keeps a table of deviations of its own: the list is deviations.md"


# ---------------------------------------------------------------------------------------------------- layout
_LAYOUT_LINK_RE = re.compile(r"\]\(\.\./(lm_human_preference_details/[^)#]+\.py)\)")


def package_modules() -> set[str]:
    """Every module of the package and its subpackages, as a path from the repository root (`__init__.py` aside)."""
    return {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def layout_modules() -> set[str]:
    """The package modules that docs/layout.md's table rows link to."""
    rows = [line for line in LAYOUT.read_text(encoding="utf-8").splitlines() if line.startswith("| [")]
    return {link for row in rows for link in _LAYOUT_LINK_RE.findall(row)}


def test_layout_has_a_row_for_every_module_and_no_row_for_a_missing_one():
    modules, rows = package_modules(), layout_modules()
    missing = sorted(modules - rows)
    assert not missing, f"docs/layout.md has no row linking {missing}: add one (file | what | OAI counterpart)"
    gone = sorted(rows - modules)
    assert not gone, f"docs/layout.md rows link modules that do not exist: {gone}: update or delete those rows"


def test_layout_link_parser_reads_subpackages():
    row = "| [a.py](../lm_human_preference_details/a.py), [b.py](../lm_human_preference_details/labeling/b.py) | x |"
    assert set(_LAYOUT_LINK_RE.findall(row)) == {
        "lm_human_preference_details/a.py",
        "lm_human_preference_details/labeling/b.py",
    }


# ---------------------------------------------------------------------------------------------------- shared flags
# flags that two training scripts take whose help rightly differs, and why; every other shared flag has one help text
SCRIPT_SPECIFIC_HELP = {
    "base_model": "it becomes the policy and its reference, the reward model's trunk, or the model SFT fine-tunes",
    "seed": "train_sft.py's seed also draws its one shuffle of the pairs; the others shuffle with --data_seed",
    "batch_size": "labels per step in train_reward.py, pairs per step in train_sft.py",
    "lr": "train_reward.py anneals linearly as OAI, train_sft.py on a cosine as N+",
    "weight_decay": "train_sft.py's AdamW always decays; the others decay only with --no_use_tensorflow_adam",
    "eval_interval": "held-out label accuracy vs the --eval_split loss",
}


def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings (the string after each field, as tyro reads them), whitespace collapsed; those of
    the fields it inherits too."""
    docs = {}
    for base in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(base) or base is object:
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0].body
        docs.update(
            {
                field.target.id: " ".join(doc.value.value.split())
                for field, doc in zip(body, body[1:])
                if isinstance(field, ast.AnnAssign)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
            }
        )
    return docs


def flag_help(cls: type, prefix: str = "") -> dict[str, str | None]:
    """--flag name (underscores, dotted groups) -> its help text, for every flag of an Args dataclass; a group nested
    without a prefix (tyro.conf.arg(name=""): the run group) gives its flags their plain names."""
    hints, docs, flags = typing.get_type_hints(cls, include_extras=True), field_docs(cls), {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        metadata = hint.__metadata__ if typing.get_origin(hint) is typing.Annotated else ()
        if any("Suppress" in repr(m) for m in metadata):
            continue  # not a flag (tyro.conf.Suppress)
        group = typing.get_args(hint)[0] if metadata else hint
        if dataclasses.is_dataclass(group) and any(getattr(m, "name", None) == "" for m in metadata):
            flags.update(flag_help(group, prefix))
            continue
        flags[prefix + field.name] = docs.get(field.name)
        if dataclasses.is_dataclass(group):
            flags.update(flag_help(group, f"{prefix}{field.name}."))
    return flags


def test_flags_that_training_scripts_share_have_the_same_help():
    helps = {module.__name__: flag_help(module.Args) for module in (train_policy, train_reward, train_sft)}
    assert {"seed", "output_dir", "bf16", "task.query_length"} <= helps["train_policy"].keys() & helps["train_reward"]
    assert {"output_dir", "resume", "track", "dry_run"} <= helps["train_sft"].keys() & helps["train_policy"].keys()
    differ, differing = [], set()
    for (one, first), (other, second) in itertools.combinations(helps.items(), 2):
        for name in sorted(first.keys() & second.keys()):
            assert first[name] and second[name], f"--{name} has no help text"
            if first[name] != second[name]:
                differing.add(name)
                if name not in SCRIPT_SPECIFIC_HELP:
                    differ.append(f"--{name}\n  {one}.py: {first[name]}\n  {other}.py: {second[name]}")
    assert not differ, (
        "flags of two training scripts with different help texts:\n"
        + "\n".join(differ)
        + "\nword them the same (or, where the flag means another thing per script, add it to SCRIPT_SPECIFIC_HELP)"
    )
    stale = sorted(set(SCRIPT_SPECIFIC_HELP) - differing)
    assert not stale, f"SCRIPT_SPECIFIC_HELP names flags that are not shared or whose help agrees: {stale}"
