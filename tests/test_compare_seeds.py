"""benchmark/compare.py gives no bootstrap interval from fewer runs per group than MIN_RUNS_FOR_CI, and says why."""

import pytest

from lm_human_preference_details.instruments import compare
from tests.test_compare import SEED_UPDATES, run_cli, write_tb_run


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """low/seed1..3 (3 runs), high/seed1..2 (2 runs, 1 above low), one/seed1 (1 run)."""
    root = tmp_path_factory.mktemp("seeds")
    for seed in SEED_UPDATES:
        write_tb_run(root / "low" / f"seed{seed}", 1.0, seed)
    for seed in (1, 2):
        write_tb_run(root / "high" / f"seed{seed}", 2.0, seed)
    write_tb_run(root / "one" / "seed1", 2.0, 1)
    return root


def test_no_interval_from_fewer_runs_than_the_minimum(runs_root):
    groups = {g: compare.load_local_runs(str(runs_root / g / "seed*")) for g in ("low", "high", "one")}
    assert compare.MIN_RUNS_FOR_CI == 3
    rows = {row.group: row for row in compare.final_value_rows(groups, ["objective/score"], "low", last_k=5)}
    for group in ("high", "one"):  # the difference of means stays, the interval goes
        assert rows[group].too_few_runs and rows[group].ci_low is None and rows[group].ci_high is None
        assert rows[group].diff == pytest.approx(1.0, abs=0.15)
    table = compare.markdown_table(list(rows.values()), "low")
    assert table.count("| none: < 3 runs |") == 2
    # the reference group too: 2 runs of `high` against 3 of `low` get no interval either way round
    rows = {row.group: row for row in compare.final_value_rows(groups, ["objective/score"], "high", last_k=5)}
    assert rows["low"].too_few_runs and rows["low"].ci_low is None
    # with the minimum lowered to 2, two runs get an interval; one run still does not
    rows = {row.group: row for row in compare.final_value_rows(groups, ["objective/score"], "low", 5, min_runs=2)}
    assert rows["high"].ci_low is not None and not rows["high"].too_few_runs and rows["one"].too_few_runs


def test_cli_marks_groups_with_too_few_seeds(runs_root, tmp_path):
    out = tmp_path / "compare"
    result = run_cli(
        "--runs", f"low={runs_root}/low/seed*", f"high={runs_root}/high/seed*",
        "--metrics", "objective/score", "--last_k", "5", "--output_dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stdout = " ".join(result.stdout.split())
    assert "no confidence interval where a group has fewer than 3 runs: high (2)" in stdout
    assert "--min_runs" in stdout and "none: < 3 runs" in stdout
    table = (out / "final_values.md").read_text()
    assert "when both groups have at least 3 runs" in table and "| none: < 3 runs |" in table
