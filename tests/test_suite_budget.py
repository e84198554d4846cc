"""The suite's time and disk budget (tests/conftest.py, pyproject.toml, Makefile, .ci/run): `make test` leaves the
tests marked e2e_slow to `make test-e2e-slow`, which CI runs after it; `--dist loadfile` hands out the longest test
files first, the processes of the tests keep large freed blocks in the heap instead of page-faulting them in again, and
a passing test's temporary directory is removed when it ends, and so is the one of the processes they start."""

import ctypes
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest, test_demo, test_demo_nplus
from tests.planted import REPO

PROBE = """
import ctypes, resource
BLOCK = 64 * 2**20  # over glibc's default mmap threshold (32 MiB at most), under the suite's KEPT_BLOCKS
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
first = libc.malloc(BLOCK)
ctypes.memset(first, 1, BLOCK)
libc.free(first)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = libc.malloc(BLOCK)
ctypes.memset(second, 2, BLOCK)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
libc.free(second)
print(faults, BLOCK // resource.getpagesize())
"""
"""prints the page faults of writing a freshly allocated 64 MiB block after one of the same size was written and freed,
and the pages of the block"""


class FakeWorker:
    """What xdist's scheduler uses of a worker: its name and the test indices it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway, self.shutting_down, self.sent = SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_every_file_named_slowest_exists_once():
    assert len(set(conftest.SLOWEST_FILES)) == len(conftest.SLOWEST_FILES) >= 10
    missing = [name for name in conftest.SLOWEST_FILES if not (REPO / "tests" / name).is_file()]
    assert not missing, missing


def test_loadfile_hands_out_the_slowest_files_first_then_xdists_order():
    config = SimpleNamespace(
        getoption=lambda name: {"dist": "loadfile"}[name],
        getvalue=lambda name: {"tx": ["2*popen"]}[name],
        option=SimpleNamespace(loadscopereorder=True),
    )
    slowest, second = (f"tests/{name}" for name in conftest.SLOWEST_FILES[:2])
    # xdist alone hands out the files with the most tests first: here the two unlisted ones
    collection = [f"tests/test_many.py::t{i}" for i in range(9)] + [f"tests/test_some.py::t{i}" for i in range(6)]
    collection += [f"{second}::t{i}" for i in range(3)] + [f"{slowest}::t{i}" for i in range(2)]
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    workers = [FakeWorker("gw0"), FakeWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    files = [[collection[indices[0]].split("::")[0] for indices in worker.sent] for worker in workers]
    # each worker starts on one of the slowest files; then the others come in xdist's order (the most tests first)
    assert files == [[slowest, "tests/test_many.py"], [second]]  # the first holds 2 tests, the second 3
    assert list(scheduler.workqueue) == ["tests/test_some.py"]
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(getoption=lambda name: "load"), None) is None


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's malloc only")
def test_the_tests_and_the_processes_they_start_reuse_a_freed_large_block(capsys):
    exec(PROBE, {})  # this process (mallopt)
    faults, pages = map(int, capsys.readouterr().out.split())
    assert faults < pages // 10, (faults, pages)
    started = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    faults, pages = map(int, started.stdout.split())
    assert faults < pages // 10, (faults, pages)  # a process the tests start (the environment)
    default = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    started = subprocess.run([sys.executable, "-c", PROBE], env=default, capture_output=True, text=True, check=True)
    faults, pages = map(int, started.stdout.split())
    assert faults >= pages // 2, (faults, pages)  # glibc's default: the block is mapped and faulted in again


def test_a_passing_tests_temporary_directory_is_removed_and_a_failing_ones_kept(tmp_path):
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent("""
        def test_passes(tmp_path):
            (tmp_path / "written").write_text("x")

        def test_fails(tmp_path):
            (tmp_path / "written").write_text("x")
            assert False
        """)
    )
    basetemp = tmp_path / "basetemp"
    command = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
    command += ["-p", "no:xdist", "-p", "no:cacheprovider", "--basetemp", str(basetemp), "test_inner.py"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout[-2000:]
    left = sorted(path.parent.name for path in Path(basetemp).rglob("written"))
    assert left == ["test_fails0"], left


def test_ci_runs_make_test_then_the_slow_tier_and_lists_the_slowest_tests_of_both_only():
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    at = lines.index("make test")  # README.md's command, as it gives it
    assert lines[at - 1].startswith("export PYTEST_ADDOPTS=") and "--durations=30" in lines[at - 1]
    assert lines[at + 1] == "make test-e2e-slow"
    assert lines[at + 2] == "unset PYTEST_ADDOPTS"  # not the floor tests' run nor the mutation check's


def make_pytest(target: str) -> list[str]:
    """The pytest command line of a Makefile target's recipe, as words."""
    lines = (REPO / "Makefile").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    words = shlex.split(lines[at + 1])
    assert words[:3] == ["$(PYTHON)", "-m", "pytest"], words
    return words[3:]


def test_make_test_leaves_out_the_slow_tier_only_and_the_tier_starts_both_demos_at_once(tmp_path, request):
    # a test per marker registered without arguments (pyproject.toml's and a few of pytest's), and one without any
    markers = [match[1] for line in request.config.getini("markers") if (match := re.match(r"(\w+):", line))]
    assert {"slow", "e2e_slow", "floor"} <= set(markers), markers
    inner = ["import pytest"] + [f"@pytest.mark.{name}\ndef test_{name}(): pass" for name in markers]
    (tmp_path / "test_inner.py").write_text("\n\n".join([*inner, "def test_unmarked(): pass\n"]))

    def collected(words: list[str]) -> set[str]:
        expression = words[len(words) - 1 - words[::-1].index("-m") + 1]
        command = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
        command += ["-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", expression]
        run = subprocess.run([*command, "test_inner.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout[-2000:]
        return {line.split("::")[1] for line in run.stdout.splitlines() if line.startswith("test_inner.py::")}

    everything = {f"test_{name}" for name in markers} | {"test_unmarked"}
    test, tier = make_pytest("test"), make_pytest("test-e2e-slow")
    assert collected(test) == everything - {"test_slow", "test_e2e_slow"}
    assert collected(tier) == {"test_slow", "test_e2e_slow"}
    assert test[:4] == tier[:4] == ["-n", "2", "--dist", "loadfile"]  # a file per worker
    # the quick demos in two files, handed out first: at the same time, one per worker
    demos = (
        test_demo.test_run_demo_quick_raises_gold_score,
        test_demo_nplus.test_run_demo_nplus_quick_raises_gold_score,
    )
    assert [sys.modules[demo.__module__].__file__.rsplit("/", 1)[1] for demo in demos] == list(
        conftest.SLOWEST_FILES[:2]
    )
    for demo in demos:
        assert "e2e_slow" in {mark.name for mark in demo.pytestmark}, demo.__name__


def test_the_processes_tests_start_write_temporary_files_to_a_directory_removed_at_the_end():
    session = Path(os.environ["TMPDIR"])  # this session's (the autouse fixture's)
    assert session.parent == Path(tempfile.gettempdir()) and session.name.startswith("pytest-started-")
    probe = [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"]
    with conftest.started_processes_temp_dir() as inner:
        made = Path(subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip())
        assert made.parent == Path(inner) and made.is_dir()
        assert Path(tempfile.gettempdir()) != Path(inner)  # this process's own temporary files stay where they were
    assert not Path(inner).exists() and os.environ["TMPDIR"] == str(session)
