"""The TRL switch (`--task trl_tldr`): one update equals TRL 0.29.1's PPOTrainer on the same inputs, quantity by
quantity (docs/migrating-from-trl.md#parity-test); the same comparison with one of TRL's differences put back at this
project's default tells them apart. The runs and rows are in tests/trl_parity.py; a missing trl fails here."""

import pytest

from tests import trl_parity
from tests.trl_parity import red, run_ours, run_trl, switch_flags, table


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trl_parity"))
    world = trl_parity.make_world(root)
    return root, world, run_trl(world, root)


def test_one_update_of_the_trl_switch_equals_trls(trl_run):
    root, world, trl = trl_run
    rows = trl_parity.compare(trl, run_ours(world, trl, switch_flags(world, f"{root}/switch")))
    assert not red(rows), "\n" + table(rows)
    # the run did what TRL's did: two updates of 2 epochs, one optimizer step each, clipping on both losses
    assert rows["optimizer steps"].scale == trl_parity.UPDATES * trl_parity.EPOCHS
    assert rows["policy clip fraction"].scale > 0 and rows["value clip fraction"].scale > 0


def test_the_default_whitening_variance_instead_of_the_switchs_makes_rows_differ(trl_run):
    # the planted difference: the population variance (divided by n) where TRL divides by n - 1; what comes before
    # the whitening stays equal, the whitened rewards, the advantages and the weights after the update differ
    root, world, trl = trl_run
    flags = switch_flags(world, f"{root}/population") + ["--ppo.whiten_variance", "population"]
    rows = trl_parity.compare(trl, run_ours(world, trl, flags))
    differing = red(rows)
    assert {"whitened rewards", "advantages", "weights after each step"} <= set(differing), "\n" + table(rows)
    for before in ("queries", "responses up to s", "scores after the penalty", "minibatch order", "optimizer steps"):
        assert before not in differing, "\n" + table(rows)
