"""demo/run_demo.py --quick --recipe nplus end to end, in a file of its own so that `make test-e2e-slow` runs it on
one pytest-xdist worker while test_demo.py's quick run takes the other (both on test_demo.py's shared world and
pretrained model)."""

import json

import pytest

from tests.test_demo import demo_root, run_demo_quick  # noqa: F401 (the shared fixture)


@pytest.mark.slow
@pytest.mark.e2e_slow
def test_run_demo_nplus_quick_raises_gold_score(demo_root):  # noqa: F811
    run = run_demo_quick(demo_root, "--recipe", "nplus")
    seed_dir = demo_root / "nplus-quick-seed1"
    results = json.loads((seed_dir / "results.json").read_text())
    assert (results["recipe"], results["mode"]) == ("nplus", "quick")
    assert results["gold"]["margin"] >= results["guaranteed_margin"] >= 0.2, results["gold"]
    accuracy = results["reward_model"]
    assert accuracy["accuracy_after"] > max(0.5, accuracy["accuracy_before"]), accuracy
    # the SFT model ends its responses at EOS: nearly every sample of the base (SFT) and trained policy passes
    assert min(results["filter_pass_rate"].values()) > 0.9, results["filter_pass_rate"]
    assert "SFT policy" in run.stdout and "guaranteed: as guaranteed" in run.stdout
