"""The implementation-details table (docs/details.md), its short list in README.md, the docs' "Guarded by" lines and
the mutation check's breakage list agree with each other and with the code: named tests exist, links resolve, every
detail has tests and a breakage."""

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOC = REPO / "docs" / "implementation-details.md"
DETAILS = REPO / "docs" / "details.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

_ROW_RE = re.compile(r"^\| \[([^\]]+)\]\(implementation-details\.md#([\w.-]+)\)(.*)\|\s*$", re.MULTILINE)
_README_ROW_RE = re.compile(r"^\| \[([^\]]+)\]\(docs/implementation-details\.md#([\w.-]+)\) \| [^|]+ \|$", re.MULTILINE)
_GUARDED_RE = re.compile(r"^Guarded by: <!-- tests:(\S+) -->(.*)$", re.MULTILINE)
_TEST_NAME_RE = re.compile(r"`(test_\w+)`")
_LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
_ANCHOR_RE = re.compile(r'<a id="([^"]+)"></a>')


def defined_tests() -> set[str]:
    """Every test function defined in tests/ (top level or in a class)."""
    names = set()
    for path in (REPO / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def details_rows() -> dict[str, dict]:
    """The implementation-details table of docs/details.md: tag -> anchor and the tests named in the last column."""
    rows = {}
    for tag, anchor, rest in _ROW_RE.findall(DETAILS.read_text(encoding="utf-8")):
        assert tag not in rows, f"docs/details.md has two rows for {tag}"
        rows[tag] = {"anchor": anchor, "tests": _TEST_NAME_RE.findall(rest.split("|")[-1])}
    return rows


def guarded_by() -> dict[str, list[str]]:
    """The docs' `Guarded by: <!-- tests:TAG -->` lines: tag -> test names."""
    lines = _GUARDED_RE.findall(DOC.read_text(encoding="utf-8"))
    tags = [tag for tag, _ in lines]
    assert len(tags) == len(set(tags)), f"a tag has two Guarded-by lines: {tags}"
    return {tag: _TEST_NAME_RE.findall(rest) for tag, rest in lines}


def mutation_check():
    """tools/mutation_check.py as a module."""
    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "tools" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_details_table_rows_name_existing_tests():
    rows, tests = details_rows(), defined_tests()
    assert len(rows) >= 50, f"the implementation-details table has only {len(rows)} rows"
    for tag, row in rows.items():
        assert row["tests"], f"docs/details.md row {tag} names no test"
        missing = [name for name in row["tests"] if name not in tests]
        assert not missing, f"docs/details.md row {tag} names tests that do not exist in tests/: {missing}"


def test_docs_guarded_by_lines_name_existing_tests():
    tests = defined_tests()
    for tag, names in guarded_by().items():
        assert names, f"docs/implementation-details.md: the Guarded-by line of {tag} names no test"
        missing = [name for name in names if name not in tests]
        assert not missing, f"the Guarded-by line of {tag} names tests that do not exist in tests/: {missing}"


def test_details_table_covers_every_guarded_detail_with_the_same_tests():
    rows, guarded = details_rows(), guarded_by()
    anchors = set(_ANCHOR_RE.findall(DOC.read_text(encoding="utf-8")))
    details = {tag for tag in guarded if not tag.startswith("TV")}  # test vectors are listed in the docs only
    assert details - set(rows) == set(), (
        f"details with a Guarded-by line but no row in docs/details.md: {details - set(rows)}"
    )
    assert set(rows) - details == set(), (
        f"docs/details.md rows without a Guarded-by line in the docs: {set(rows) - details}"
    )
    for family, count in (("G", 10), ("R", 8), ("P", 20), ("O", 5), ("D", 7)):
        expected = {f"{family}{i}" for i in range(1, count + 1)}
        assert expected <= set(rows), f"docs/details.md lacks {sorted(expected - set(rows))}"
    assert {"§4.1", "§4.2"} <= set(rows)
    for tag, row in rows.items():
        assert row["anchor"] in anchors, (
            f"docs/details.md row {tag} links to #{row['anchor']}, not an anchor of the docs"
        )
        assert row["tests"] == guarded[tag], f"{tag}: docs/details.md names {row['tests']}, the docs {guarded[tag]}"


def test_readme_lists_every_detail_of_the_table_in_its_order():
    listed = _README_ROW_RE.findall(README.read_text(encoding="utf-8"))
    assert len(listed) == len({tag for tag, _ in listed}), "README.md lists a detail twice"
    assert listed == [(tag, row["anchor"]) for tag, row in details_rows().items()], (
        "README.md's list of details must name the rows of docs/details.md, in order, with the same links"
    )


def test_relative_links_resolve():
    problems = []
    for page in PAGES:
        for target in _LINK_RE.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # web links; in-page anchors are checked by test_docs
            path_part, _, fragment = target.partition("#")
            path = (page.parent / path_part).resolve()
            where = f"{page.relative_to(REPO)} -> {target}"
            if not path.exists():
                problems.append(f"{where}: no such file")
                continue
            lines = re.fullmatch(r"L(\d+)(?:-L(\d+))?", fragment)
            if lines:
                count = len(path.read_text(encoding="utf-8").splitlines())
                last = int(lines[2] or lines[1])
                if not 1 <= int(lines[1]) <= last <= count:
                    problems.append(f"{where}: {path.name} has {count} lines")
            elif fragment and path.suffix == ".md" and fragment not in _ANCHOR_RE.findall(path.read_text("utf-8")):
                problems.append(f"{where}: no anchor #{fragment} in {path.name}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_mutation_check_list_matches_the_code_and_covers_every_row():
    module = mutation_check()
    problems = module.list_problems(module.BREAKAGES, REPO)
    assert not problems, "tools/mutation_check.py's breakages do not match the code:\n" + "\n".join(problems)
    rows, guarded = details_rows(), guarded_by()
    # the successor recipe's details (N1, N2, ...) are the anchors of docs/nplus-details.md
    nplus = {b.detail for b in module.BREAKAGES if re.fullmatch(r"N\d+", b.detail)}
    nplus_anchors = set(_ANCHOR_RE.findall((REPO / "docs" / "nplus-details.md").read_text(encoding="utf-8")))
    assert {tag.lower() for tag in nplus} <= nplus_anchors, f"no such anchor of docs/nplus-details.md: {nplus}"
    breakages = [b for b in module.BREAKAGES if b.detail not in nplus]
    unknown = sorted({b.detail for b in breakages} - set(guarded))
    assert not unknown, f"breakages name detail tags the docs do not have: {unknown}"
    uncovered = sorted(set(rows) - {b.detail for b in breakages})
    assert not uncovered, f"docs/details.md rows without a breakage in tools/mutation_check.py: {uncovered}"
    assert len(breakages) >= 40
    for b in breakages:
        named = {node.split("::")[-1].split("[")[0] for node in b.tests}
        assert named & set(rows[b.detail]["tests"]), (
            f"{b.id}: none of its tests is listed in docs/details.md row {b.detail}"
        )
