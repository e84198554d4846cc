"""docs/implementation-details.md: every detail tag the code cites has an anchor there, and every OAI link is pinned."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "implementation-details.md"
OAI_COMMIT = "cbfd210bb8b08f6bc5c26878c10984b90f516c66"

# the project's code: the package, the three scripts, the demo and the benchmarks (tests/ excluded)
CODE_FILES = sorted(
    [*(REPO / "lm_human_preference_details").rglob("*.py")]
    + [REPO / name for name in ("train_reward.py", "train_policy.py", "label_generation.py", "evaluate.py")]
    + [REPO / name for name in ("train_sft.py", "train_both.py") if (REPO / name).exists()]
    + [*(REPO / "demo").rglob("*.py"), *(REPO / "benchmark").rglob("*.py")]
)

# every tag of the implementation details, G1..G10, R1..R8, P1..P20, O1..O5, D1..D7, H1..H3, LG, TV1..TV14
_FAMILIES = (("G", 10), ("R", 8), ("P", 20), ("O", 5), ("D", 7), ("H", 3))
ALL_TAGS = [
    *(f"{family}{i}" for family, count in _FAMILIES for i in range(1, count + 1)),
    "LG",
    *(f"TV{i}" for i in range(1, 15)),
]
# numbered sections that code may cite as "spec §4.1" or "spec 1.2"
SECTION_ANCHORS = {
    "1": "overview",
    "1.1": "pipeline",
    "1.2": "models",
    "1.3": "shapes",
    "2": "details",
    "3": "hyperparameters",
    "3.1": "hp-reward",
    "3.2": "hp-task",
    "3.3": "hp-policy",
    "4": "metrics",
    "4.1": "metrics-policy",
    "4.2": "metrics-reward",
    "5": "test-vectors",
    "7": "open-points",
}

_LETTER_TAG = r"(?:[A-Z]{1,2}\d+|LG)"
_SECTION = r"§\s*\d+(?:\.\d+)?"
# "spec G4", "(spec D3)", "spec §4.1", "spec 1.2", "spec O1-O3", "spec P5, P6", "spec LG, P2, P3"; a bare number
# is read as a section only right after "spec", never inside a list ("spec P2, 4 episodes" is P2 alone)
_SPEC_RE = re.compile(
    rf"\bspec\s+((?:{_LETTER_TAG}|{_SECTION}|\d+(?:\.\d+)?)"
    rf"(?:\s*(?:,|-|–|/|\band\b)\s*(?:{_LETTER_TAG}|{_SECTION}))*)"
)
# bare citations without "spec": TV13, TV10-TV12 anywhere; "(P7)", "(G2)", "(P5, P6)" in parentheses
_TV_RE = re.compile(r"\bTV\d+(?:\s*[-–]\s*TV\d+)?\b")
_PAREN_TAG = r"(?:[GRPODH]\d{1,2}|LG)"
_PAREN_RE = re.compile(rf"\(({_PAREN_TAG}(?:\s*(?:,|-|–)\s*{_PAREN_TAG})*)\)")
_ANCHOR_RE = re.compile(r'<a id="([^"]+)"></a>')
# a GitHub link to OAI's repository, up to whitespace, a closing bracket or a quote
_OAI_LINK_RE = re.compile(r"https?://github\.com/openai/lm-human-preferences[^\s)\]>\"'`]*")
_PINNED_RE = re.compile(
    rf"https://github\.com/openai/lm-human-preferences/blob/{OAI_COMMIT}/[A-Za-z0-9_./-]+\.[a-z]+(?:#L\d+(?:-L\d+)?)?"
)


def _expand(citation: str) -> list[str]:
    """The tags of one citation: 'O1-O3' -> O1, O2, O3; 'P5, P6' -> P5, P6; '§ 4.1' -> §4.1; '1.2' -> §1.2."""
    tags = []
    for part in re.split(r"\s*(?:,|/|\band\b)\s*", citation):
        ends = [end.replace(" ", "") for end in re.split(r"\s*[-–]\s*", part) if end]
        ends = [end if re.match(r"[A-Z§]", end) else f"§{end}" for end in ends]
        bounds = [re.fullmatch(r"([A-Z]+)(\d+)", end) for end in ends]
        if len(ends) == 2 and all(bounds) and bounds[0][1] == bounds[1][1] and int(bounds[0][2]) <= int(bounds[1][2]):
            tags += [f"{bounds[0][1]}{i}" for i in range(int(bounds[0][2]), int(bounds[1][2]) + 1)]
        else:
            tags += ends
    return tags


def cited_tags(text: str) -> list[tuple[str, int]]:
    """(tag, line number) of every detail tag cited in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        citations = [m.group(1) for m in _SPEC_RE.finditer(line)]
        citations += [m.group(0) for m in _TV_RE.finditer(line)]
        citations += [m.group(1) for m in _PAREN_RE.finditer(line)]
        found += [(tag, number) for citation in citations for tag in _expand(citation)]
    return found


def anchor_of(tag: str) -> str:
    """The anchor id of a tag: G4 -> g4, LG -> lg, §4.1 -> metrics-policy; an unknown section -> section-N."""
    if tag.startswith("§"):
        return SECTION_ANCHORS.get(tag[1:], f"section-{tag[1:]}")
    return tag.lower()


def doc_anchors() -> list[str]:
    return _ANCHOR_RE.findall(DOC.read_text(encoding="utf-8"))


def test_cited_tags_parser_reads_every_citation_form():
    text = "\n".join(
        [
            "# prefix + query + suffix (spec G4)",
            "# truncate -> score (raw query, spec G4) -> filter penalty",
            "# statistics under OAI's names (spec §4.1)",
            '"""as OAI\'s Policy (spec 1.2)."""',
            "# TF1 Adam, eps 1e-5 (spec O1-O3)",
            "# reward whitening and GAE (spec P5, P6); spec P2, 4 episodes",
            "# those that pass the filter (spec LG, P2, P3)",
            "# global RNG (reward-label order, TV13) untouched; TV10-TV12",
            "# forward on context + raw response (P7); the spec parser; labeler_spec = spec",
        ]
    )
    assert [tag for tag, _ in cited_tags(text)] == [
        "G4",
        "G4",
        "§4.1",
        "§1.2",
        "O1",
        "O2",
        "O3",
        "P5",
        "P6",
        "P2",
        "LG",
        "P2",
        "P3",
        "TV13",
        "TV10",
        "TV11",
        "TV12",
        "P7",
    ]
    assert [line for _, line in cited_tags(text)][:3] == [1, 2, 3]
    assert [anchor_of(tag) for tag in ("G4", "LG", "TV6", "§4.1", "§4.2", "§9")] == [
        "g4",
        "lg",
        "tv6",
        "metrics-policy",
        "metrics-reward",
        "section-9",
    ]


def test_every_spec_tag_in_code_resolves_to_an_anchor():
    anchors = set(doc_anchors())
    missing = []
    for path in CODE_FILES:
        for tag, line in cited_tags(path.read_text(encoding="utf-8")):
            if anchor_of(tag) not in anchors:
                missing.append(f"{tag} (#{anchor_of(tag)}) cited at {path.relative_to(REPO)}:{line}")
    assert not missing, f"tags cited in the code without an anchor in {DOC.relative_to(REPO)}:\n" + "\n".join(missing)


def test_doc_has_one_anchor_per_tag_and_section():
    anchors = doc_anchors()
    duplicates = sorted({a for a in anchors if anchors.count(a) > 1})
    assert not duplicates, f"anchors defined more than once: {duplicates}"
    expected = [anchor_of(tag) for tag in ALL_TAGS] + list(SECTION_ANCHORS.values()) + ["deviations"]
    missing = [anchor for anchor in expected if anchor not in anchors]
    assert not missing, f"{DOC.relative_to(REPO)} lacks the anchors {missing}"
    # every internal link points at an anchor that exists
    links = re.findall(r"\]\(#([^)]+)\)", DOC.read_text(encoding="utf-8"))
    dangling = sorted(set(links) - set(anchors))
    assert not dangling, f"links to missing anchors: {dangling}"


def test_docs_permalinks_are_pinned():
    files = [DOC, *CODE_FILES, *(p for p in sorted((REPO / "tests").rglob("*.py")) if p.name != "test_docs.py")]
    unpinned = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for link in _OAI_LINK_RE.findall(line):
                link = link.rstrip(".,;:")
                if not _PINNED_RE.fullmatch(link):
                    unpinned.append(f"{path.relative_to(REPO)}:{number}: {link}")
    assert not unpinned, (
        f"links to openai/lm-human-preferences must read .../blob/{OAI_COMMIT}/PATH, then nothing, #Lnn or #Lnn-Lmm:\n"
        + "\n".join(unpinned)
    )


NPLUS_DOC = REPO / "docs" / "nplus-details.md"
_NPLUS_RE = re.compile(r"\bnplus\s+(N\d+(?:\s*(?:,|-|–)\s*N\d+)*)")
# the upstream code that the successor recipe's spec cites, each at the commit its section 0 pins
NPLUS_REPOS = {
    "vwxyzjn/summarize_from_feedback_details": "ee77a9abc31f5338365ee087945c5bcafac7f1ca",
    "huggingface/trl": (
        "14ef1aba152fddbc5a58f3a8a712b6e509e7e69d",
        "55f5433e15cc6203d3c731f9de5247b00878bebd",
        "46d09bd2408f17605409fb3ee8ba12705add7faa",
        "617406a4e69551c115c145114497999618d24f3c",  # v0.29.1, whose update the trl_tldr preset matches
    ),
    "openai/summarize-from-feedback": "700967448d10004279f138666442bf1497d0e705",
}
_NPLUS_LINK_RE = re.compile(
    r"https?://github\.com/(vwxyzjn/summarize_from_feedback_details|huggingface/trl|openai/summarize-from-feedback)"
    r"[^\s)\]>\"'`]*"
)


def nplus_citations(text: str) -> list[tuple[str, int]]:
    """Every `nplus N20` (also `nplus N19-N21`, `nplus N19, N20`) in a text, expanded, with its line."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for match in _NPLUS_RE.finditer(line):
            parts = re.split(r"\s*,\s*", match.group(1))
            for part in parts:
                ends = [int(n) for n in re.findall(r"N(\d+)", part)]
                found += [(f"N{i}", number) for i in range(ends[0], ends[-1] + 1)]
    return found


def test_nplus_citation_parser_reads_every_form():
    assert nplus_citations("x (nplus N20)\n# nplus N19-N21\ny nplus N2, N5") == [
        ("N20", 1),
        ("N19", 2),
        ("N20", 2),
        ("N21", 2),
        ("N2", 3),
        ("N5", 3),
    ]


def test_every_nplus_citation_in_code_resolves_to_an_anchor():
    anchors = set(_ANCHOR_RE.findall(NPLUS_DOC.read_text(encoding="utf-8")))
    missing = [
        f"{tag} cited at {path.relative_to(REPO)}:{line}"
        for path in CODE_FILES
        for tag, line in nplus_citations(path.read_text(encoding="utf-8"))
        if tag.lower() not in anchors
    ]
    assert not missing, f"successor-recipe details cited without an anchor in {NPLUS_DOC.name}:\n" + "\n".join(missing)


def test_successor_recipe_links_are_pinned_to_the_specs_commits():
    files = [NPLUS_DOC, *CODE_FILES, *sorted((REPO / "docs").glob("*.md"))]
    unpinned = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in _NPLUS_LINK_RE.finditer(line):
                link, repo = match.group(0).rstrip(".,;:"), match.group(1)
                commits = NPLUS_REPOS[repo] if isinstance(NPLUS_REPOS[repo], tuple) else (NPLUS_REPOS[repo],)
                if not any(link.startswith(f"https://github.com/{repo}/blob/{c}/") for c in commits):
                    if link.rstrip("/") != f"https://github.com/{repo}":
                        unpinned.append(f"{path.relative_to(REPO)}:{number}: {link}")
    assert not unpinned, "links to the successor recipe's code must be pinned to the spec's commits:\n" + "\n".join(
        unpinned
    )
