"""The suite fails on deprecated calls into transformers, accelerate, torch and datasets (tests/conftest.py), so a
renamed keyword turns CI red before the old name is removed and silently ignored."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import StaticCache
from transformers.utils.logging import get_logger

from lm_human_preference_details import cli
from tests.planted import REPO, script_env


def test_the_old_cache_keyword_fails_a_test(tiny_lm):
    # transformers 5 renamed `past_key_values` to `cache`; once the alias goes, the old keyword is ignored silently
    cache = StaticCache(config=tiny_lm.config, max_cache_len=8)
    with pytest.raises(FutureWarning, match="the project calls transformers in a deprecated way: `past_key_values`"):
        tiny_lm.transformer(input_ids=torch.ones(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)
    tiny_lm.transformer(input_ids=torch.ones(1, 3, dtype=torch.long), cache=cache, use_cache=True)  # no warning


def test_a_library_installed_outside_site_packages_is_checked_too(tmp_path):
    # `pip install --target DIR` puts a library in a directory of any name: here transformers, through a link
    target = tmp_path / "target"
    target.mkdir()
    (target / "transformers").symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    path = os.pathsep.join(filter(None, [str(target), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**script_env(), "PYTHONPATH": path}
    check = (
        "import transformers.utils.generic as generic, tests.conftest as checker; "
        "print(generic.__file__); print(checker._library_of(generic.__file__))"
    )
    run = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    where, library = run.stdout.split()
    assert where.startswith(str(target)) and library == "transformers", run.stdout


def test_a_logged_transformers_deprecation_fails_a_test_even_when_quieted(no_deprecated_library_calls):
    cli.quiet_transformers()  # the scripts' verbosity (errors only) must not hide deprecations from the check
    get_logger("transformers.utils.generic").warning_once("`cache_params` are deprecated. Use `cache` instead.")
    get_logger("transformers.modeling_utils").warning("some weights were not loaded")  # not a deprecation
    assert no_deprecated_library_calls.messages == ["`cache_params` are deprecated. Use `cache` instead."]
    no_deprecated_library_calls.messages.clear()  # caught: let this test pass
