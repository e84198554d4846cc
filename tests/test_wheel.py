"""The wheel holds the whole package: built from the checkout's files, installed into a fresh environment outside the
checkout, every module of lm_human_preference_details (its sub-packages too) imports from the installed copy."""

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.planted import REPO

PACKAGE = "lm_human_preference_details"


def package_modules(root: Path) -> list[str]:
    """Every module of the package under `root`, as a dotted name."""
    names = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.slow
def test_the_wheel_installs_every_module_of_the_package(tmp_path):
    # the files a wheel is built from, copied out of the checkout: the build writes nothing into it
    source = tmp_path / "source"
    shutil.copytree(REPO / PACKAGE, source / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    # a fresh environment that sees the installed dependencies (torch, transformers, ...) but installs the package
    # from the wheel, ahead of the checkout's editable install
    env = tmp_path / "env"
    venv.create(env, system_site_packages=True, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", site, str(wheel)]
    subprocess.run(install, check=True, capture_output=True, text=True, timeout=300)
    modules = package_modules(REPO)
    assert {"lm_human_preference_details.nplus.critic", "lm_human_preference_details.labeling.labelserver"} <= set(
        modules
    )
    program = (
        "import importlib, json, sys\n"
        f"modules = {modules!r}\n"
        "print(json.dumps({name: importlib.import_module(name).__file__ for name in modules}))\n"
    )
    clean_env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    imported = subprocess.run(
        [str(python), "-c", program], cwd=tmp_path, env=clean_env, capture_output=True, text=True, timeout=600
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    files = json.loads(imported.stdout.strip().splitlines()[-1])
    outside = {name: file for name, file in files.items() if not file.startswith(site)}
    assert not outside, f"modules imported from outside the installed wheel: {outside}"
    assert set(files) == set(modules)
