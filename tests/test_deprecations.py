"""The suite fails on deprecated calls into transformers, accelerate, torch and datasets (tests/conftest.py), so a
renamed keyword turns CI red before the old name is removed and silently ignored."""

import pytest
import torch
from transformers import StaticCache
from transformers.utils.logging import get_logger

from lm_human_preference_details import cli


def test_the_old_cache_keyword_fails_a_test(tiny_lm):
    # transformers 5 renamed `past_key_values` to `cache`; once the alias goes, the old keyword is ignored silently
    cache = StaticCache(config=tiny_lm.config, max_cache_len=8)
    with pytest.raises(FutureWarning, match="the project calls transformers in a deprecated way: `past_key_values`"):
        tiny_lm.transformer(input_ids=torch.ones(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)
    tiny_lm.transformer(input_ids=torch.ones(1, 3, dtype=torch.long), cache=cache, use_cache=True)  # no warning


def test_a_logged_transformers_deprecation_fails_a_test_even_when_quieted(no_deprecated_library_calls):
    cli.quiet_transformers()  # the scripts' verbosity (errors only) must not hide deprecations from the check
    get_logger("transformers.utils.generic").warning_once("`cache_params` are deprecated. Use `cache` instead.")
    get_logger("transformers.modeling_utils").warning("some weights were not loaded")  # not a deprecation
    assert no_deprecated_library_calls.messages == ["`cache_params` are deprecated. Use `cache` instead."]
    no_deprecated_library_calls.messages.clear()  # caught: let this test pass
