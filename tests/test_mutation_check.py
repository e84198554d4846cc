"""tools/mutation_check.py's runner: the order of the breakages, a job's copy, threads and temporary directories, and a
run stopped half-way (the breakage list itself is checked against the code by tests/test_readme.py)."""

import importlib.util
import json
import time

import psutil
import pytest

from tests.planted import REPO

SPEC = importlib.util.spec_from_file_location("mutation_check", REPO / "tools" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(mutation_check)

PROBE = """
import json, os, time

import torch


def test_probe(tmp_path):
    (tmp_path / "written").write_text("x")
    record = {"threads": torch.get_num_threads(), "tmp_path": str(tmp_path), "cwd": os.getcwd()}
    with open(os.environ["PROBE_RECORD"], "w") as f:
        json.dump(record, f)


def test_sleeps():
    open(os.environ["PROBE_RECORD"], "w").close()
    time.sleep(600)
"""
"""a project's test file: what the runner's pytest sees"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A small project in place of the repository: its conftest.py sets 2 intra-op threads, as the suite's does."""
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "conftest.py").write_text("import torch\n\ntorch.set_num_threads(2)\n")
    (root / "tests" / "test_probe.py").write_text(PROBE)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    monkeypatch.setattr(mutation_check, "REPO", root)
    monkeypatch.setenv("PROBE_RECORD", str(tmp_path / "record.json"))
    return root


def test_slow_marked_breakages_run_first_and_the_others_in_the_lists_order():
    breakages = mutation_check.BREAKAGES
    ordered = mutation_check.run_order(breakages, REPO)
    slow = [b.id for b in breakages if any(mutation_check.starts_processes(REPO, t) for t in b.tests)]
    assert sorted(b.id for b in ordered) == sorted(b.id for b in breakages)
    assert [b.id for b in ordered] == slow + [b.id for b in breakages if b.id not in slow]
    assert "O4-fsdp-rollout-not-gathered" in slow and "G1-oai-pad-not-mapped" not in slow  # slow: its test's mark
    assert mutation_check.starts_processes(REPO, "tests/test_demo.py::test_run_demo_quick_raises_gold_score")
    assert not mutation_check.starts_processes(REPO, "tests/test_labels.py::test_load_labels_maps_oai_pad")


def test_a_job_runs_in_its_own_copy_on_its_share_of_the_cores_and_leaves_only_its_log(project, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    files = ["pyproject.toml", "tests/conftest.py", "tests/test_probe.py"]
    job = mutation_check.Job("probe", None, ["tests/test_probe.py::test_probe"], 300)
    results = mutation_check.run_jobs([job], files, 2, False, scratch, keep=False)
    assert results["probe"][0] == 0, (scratch / "probe.log").read_text()
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["cwd"] == str(scratch / "probe")  # the copy
    assert record["threads"] == max(1, mutation_check.cores() // 2)  # over the conftest's 2: 2 jobs share the cores
    assert record["tmp_path"].startswith(str(scratch / "probe" / mutation_check.BASETEMP))
    assert sorted(path.name for path in scratch.iterdir()) == ["probe.log"]  # the copy and its temporary files gone


def test_a_run_stopped_half_way_stops_its_jobs(project, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    files = ["pyproject.toml", "tests/conftest.py", "tests/test_probe.py"]
    job = mutation_check.Job("sleeper", None, ["tests/test_probe.py::test_sleeps"], 300)
    running, sleep = [], time.sleep

    def interrupted_once_the_job_sleeps(seconds):  # Ctrl-C while the job's test sleeps
        sleep(seconds)
        if (tmp_path / "record.json").exists():
            running.extend(
                p for p in psutil.Process().children(recursive=True) if "run_pytest" in " ".join(p.cmdline())
            )
            raise KeyboardInterrupt

    monkeypatch.setattr(mutation_check.time, "sleep", interrupted_once_the_job_sleeps)
    with pytest.raises(KeyboardInterrupt):
        mutation_check.run_jobs([job], files, 1, False, scratch, keep=False)
    assert len(running) == 1 and not running[0].is_running()  # killed and reaped
