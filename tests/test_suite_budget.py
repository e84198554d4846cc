"""The suite's disk budget (pyproject.toml): a passing test's temporary directory is removed when it ends."""

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.planted import REPO


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
