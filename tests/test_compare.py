"""instruments/compare.py and benchmark/compare.py on runs written here (TensorBoard and CSV), offline."""

import csv
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tyro
from torch.utils.tensorboard import SummaryWriter

from lm_human_preference_details.instruments import compare
from tests.planted import REPO

BATCH = 64
SEED_UPDATES = {1: 30, 2: 24, 3: 36}  # a different number of updates per seed
SEED_OFFSETS = {1: -0.1, 2: 0.0, 3: 0.1}


def score(base: float, seed: int, step: int) -> float:
    """The planted objective/score of a run: rises from base, seed-specific offset."""
    return base + SEED_OFFSETS[seed] + 0.5 * (1 - np.exp(-step / 8))


def entropy(seed: int, step: int) -> float:
    """The planted ppo/policy/entropy of a run."""
    return 3.0 - 0.02 * step + 0.05 * seed


def write_tb_run(path, base: float, seed: int) -> None:
    """A run as train_policy.py logs it: OAI names, step = 0-based update, elapsed/episodes = (step + 1) * batch."""
    writer = SummaryWriter(str(path / "tb"))
    for step in range(SEED_UPDATES[seed]):
        writer.add_scalar("objective/score", score(base, seed, step), step)
        writer.add_scalar("ppo/policy/entropy", entropy(seed, step), step)
        writer.add_scalar("elapsed/episodes", (step + 1) * BATCH, step)
    writer.close()


def write_oai_csv(path, base: float, seed: int) -> None:
    """A CSV export of an OAI wandb run: every name carries OAI's extra `ppo/` prefix."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ppo/global_step", "ppo/elapsed/episodes", "ppo/objective/score", "ppo/ppo/policy/entropy"])
        for step in range(SEED_UPDATES[seed]):
            writer.writerow([step, (step + 1) * BATCH, score(base, seed, step), entropy(seed, step)])


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    """high/seed*, low/seed* and same/seed* (= low) TensorBoard runs; oai/seed*.csv (= low) CSV exports."""
    root = tmp_path_factory.mktemp("runs")
    for seed in SEED_UPDATES:
        for group, base in (("low", 1.0), ("high", 2.0), ("same", 1.0)):
            write_tb_run(root / group / f"seed{seed}", base, seed)
        (root / "oai").mkdir(exist_ok=True)
        write_oai_csv(root / "oai" / f"seed{seed}.csv", 1.0, seed)
    return root


def test_canonical_name_strips_only_oais_wandb_prefix():
    assert compare.canonical_name("ppo/objective/score") == "objective/score"
    assert compare.canonical_name("ppo/ppo/policy/entropy") == "ppo/policy/entropy"
    assert compare.canonical_name("ppo/elapsed/episodes") == "elapsed/episodes"
    assert compare.canonical_name("ppo/global_step") == "global_step"
    # this project's (= OAI's TensorBoard) names stay as they are
    for name in ("objective/score", "ppo/policy/entropy", "ppo/val/var_explained", "ppo/loss/total", "train/x"):
        assert compare.canonical_name(name) == name


def test_tensorboard_runs_are_read_against_episodes(runs_root):
    runs = compare.load_local_runs(str(runs_root / "low" / "seed*"))
    assert [os.path.basename(run.name) for run in runs] == ["seed1", "seed2", "seed3"]
    for seed, run in zip(SEED_UPDATES, runs):
        curve = run.curves["objective/score"]
        steps = np.arange(SEED_UPDATES[seed])
        np.testing.assert_array_equal(curve.episodes, (steps + 1) * BATCH)
        np.testing.assert_allclose(curve.values, [score(1.0, seed, s) for s in steps], rtol=1e-6)
        assert compare.EPISODES not in run.curves and "step" not in run.curves


def test_csv_with_oai_prefixed_names_reads_like_tensorboard(runs_root):
    csv_runs = compare.load_local_runs(str(runs_root / "oai" / "*.csv"))
    tb_runs = compare.load_local_runs(str(runs_root / "low" / "seed*"))
    for csv_run, tb_run in zip(csv_runs, tb_runs):
        assert set(csv_run.curves) == {"objective/score", "ppo/policy/entropy"}
        for metric in csv_run.curves:
            np.testing.assert_array_equal(csv_run.curves[metric].episodes, tb_run.curves[metric].episodes)
            np.testing.assert_allclose(csv_run.curves[metric].values, tb_run.curves[metric].values, rtol=1e-6)


def test_step_column_gives_episodes_only_when_asked(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text("_step,ppo/objective/score\n0,1.5\n1,\n2,2.5\n")
    with pytest.raises(compare.MissingEpisodesError, match="--episodes_per_step"):
        compare.load_local_runs(str(path))
    (run,) = compare.load_local_runs(str(path), episodes_per_step=512)
    np.testing.assert_array_equal(run.curves["objective/score"].episodes, [512, 1536])  # the empty cell is skipped
    np.testing.assert_array_equal(run.curves["objective/score"].values, [1.5, 2.5])


def test_interpolation_onto_the_episode_grid(runs_root):
    runs = compare.load_local_runs(str(runs_root / "low" / "seed*"))
    curves = [run.curves["objective/score"] for run in runs]
    grid = compare.episode_grid(curves, 50)
    assert grid[0] == BATCH and grid[-1] == min(SEED_UPDATES.values()) * BATCH  # the range all seeds cover
    wide_grid = np.linspace(BATCH, max(SEED_UPDATES.values()) * BATCH, 50)
    for seed, curve in zip(SEED_UPDATES, curves):
        values = compare.interpolate(curve, wide_grid)
        steps = np.arange(SEED_UPDATES[seed])
        direct = np.interp(wide_grid, (steps + 1) * BATCH, [score(1.0, seed, s) for s in steps])
        inside = wide_grid <= SEED_UPDATES[seed] * BATCH
        np.testing.assert_allclose(values[inside], direct[inside], rtol=1e-6)
        assert np.isnan(values[~inside]).all()  # no extrapolation past a run's last update
    # halfway between update 0 (64 episodes) and update 1 (128): the mean of the two logged values
    midpoint = compare.interpolate(curves[0], np.array([96.0]))[0]
    assert midpoint == pytest.approx((score(1.0, 1, 0) + score(1.0, 1, 1)) / 2, rel=1e-6)


def test_seed_band_matches_numpy():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(3, 40))
    values[1, 30:] = np.nan  # one seed stopped earlier
    values[:, 39] = [np.nan, np.nan, 1.0]  # a single seed left
    mean, low, high = compare.seed_band(values, "stderr")
    count = np.isfinite(values).sum(0)
    np.testing.assert_allclose(mean, np.nanmean(values, 0))
    stderr = np.nanstd(values[:, :39], 0, ddof=1) / np.sqrt(count[:39])
    np.testing.assert_allclose(high[:39] - mean[:39], stderr)
    np.testing.assert_allclose(mean[:39] - low[:39], stderr)
    np.testing.assert_allclose(mean[:30], values[:, :30].mean(0))
    np.testing.assert_allclose(high[:30] - mean[:30], values[:, :30].std(0, ddof=1) / np.sqrt(3))
    assert np.isnan(low[39]) and np.isnan(high[39]) and mean[39] == 1.0
    mean, low, high = compare.seed_band(values, "minmax")
    np.testing.assert_allclose(low, np.nanmin(values, 0))
    np.testing.assert_allclose(high, np.nanmax(values, 0))


def test_final_value_table_and_bootstrap_interval(runs_root):
    groups = {g: compare.load_local_runs(str(runs_root / g / "seed*")) for g in ("low", "high", "same")}
    rows = compare.final_value_rows(groups, ["objective/score"], "low", last_k=5, num_resamples=10_000, seed=0)
    by_group = {row.group: row for row in rows}
    finals = {
        group: np.array([score(base, s, np.arange(n)[-5:]).mean() for s, n in SEED_UPDATES.items()])
        for group, base in (("low", 1.0), ("high", 2.0), ("same", 1.0))
    }
    for group, row in by_group.items():
        assert row.num_runs == 3 and row.episodes == np.median([n * BATCH for n in SEED_UPDATES.values()])
        assert row.mean == pytest.approx(finals[group].mean(), rel=1e-6)
        assert row.stderr == pytest.approx(finals[group].std(ddof=1) / np.sqrt(3), rel=1e-5)
    assert by_group["low"].diff is None
    high = by_group["high"]
    true_difference = finals["high"].mean() - finals["low"].mean()
    assert true_difference == pytest.approx(1.0) and high.diff == pytest.approx(true_difference, rel=1e-6)
    assert 0 < high.ci_low < true_difference < high.ci_high  # separated groups: the CI excludes 0
    same = by_group["same"]
    assert same.diff == pytest.approx(0.0, abs=1e-6) and same.ci_low < 0 < same.ci_high
    # seeded: the same interval again
    again = compare.bootstrap_mean_difference(finals["low"], finals["high"], seed=0)
    assert again == compare.bootstrap_mean_difference(finals["low"], finals["high"], seed=0)
    table = compare.markdown_table(rows, "low")
    lines = table.strip().splitlines()
    assert lines[0] == "| metric | group | runs | episodes | final (mean) | stderr | diff vs low | 95% CI |"
    assert len(lines) == 2 + 3 and lines[3].startswith("| objective/score | high | 3 | 1920 |")
    assert f"{high.diff:+.4g}" in lines[3] and f"[{high.ci_low:.4g}, {high.ci_high:.4g}]" in lines[3]


def test_plot_writes_png_and_svg(runs_root, tmp_path):
    groups = {g: compare.load_local_runs(str(runs_root / g / "seed*")) for g in ("low", "high")}
    groups["oai"] = compare.load_local_runs(str(runs_root / "oai" / "*.csv"))
    metrics = ["objective/score", "ppo/policy/entropy", "objective/kl"]  # no run logs objective/kl: an empty panel
    paths = compare.plot_curves(groups, metrics, str(tmp_path / "out" / "curves"), "minmax", ["png", "svg"])
    assert paths == [str(tmp_path / "out" / "curves.png"), str(tmp_path / "out" / "curves.svg")]
    png = (tmp_path / "out" / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert b"<svg" in (tmp_path / "out" / "curves.svg").read_bytes()[:2000]


def test_kl_panel_draws_the_kl_target_of_the_runs_args_json(tmp_path, monkeypatch):
    import matplotlib.lines

    for seed, adaptive in ((1, {"enabled": True, "target": 6.0}), (2, {"enabled": False, "target": 6.0})):
        write_tb_run(tmp_path / f"seed{seed}", 1.0, seed)
        (tmp_path / f"seed{seed}" / "args.json").write_text(json.dumps({"rewards": {"adaptive_kl": adaptive}}))
    runs = compare.load_local_runs(str(tmp_path / "seed*"))
    assert [run.kl_target for run in runs] == [6.0, None]  # a fixed kl_coef has no target
    groups = {"ours": runs}
    assert compare.kl_targets(groups) == [6.0]
    figure = compare.curves_figure(groups, ["objective/score", "objective/kl"], targets=compare.kl_targets(groups))
    score_ax, kl_ax = figure.axes[:2]
    dashed = [
        line for line in kl_ax.lines if isinstance(line, matplotlib.lines.Line2D) and line.get_linestyle() == "--"
    ]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [6.0, 6.0]
    assert [text.get_text() for text in kl_ax.texts] == ["not logged", "KL target 6 nats"]
    assert not any(line.get_linestyle() == "--" for line in score_ax.lines) and not score_ax.texts
    # the command line draws the runs' targets, or --kl_target
    spec = importlib.util.spec_from_file_location("compare_cli", REPO / "benchmark" / "compare.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    drawn = []
    monkeypatch.setattr(cli.compare, "plot_curves", lambda *args: drawn.append(args[-1]) or [])
    for flags in ([], ["--kl_target", "12"]):
        cli.main(tyro.cli(cli.Args, args=[f"--runs=ours={tmp_path}/seed*", "--output_dir", str(tmp_path), *flags]))
    assert drawn == [[6.0], [12.0]]


def test_wandb_source_syntax():
    path, filters = compare.parse_wandb_source(
        "openrlbenchmark/lm-human-preferences?task_id=sentiment&task.value.policy.initial_model=124M&tag=v1&seed=3"
    )
    assert path == "openrlbenchmark/lm-human-preferences"
    assert filters == {
        "$and": [
            {"config.task_id.value": "sentiment"},
            {"config.task.value.policy.initial_model.value": "124M"},
            {"tags": {"$in": ["v1"]}},
            {"config.seed.value": 3},
        ]
    }
    assert compare.parse_wandb_source("me/proj?group=g&name=run-1&state=finished")[1] == {
        "$and": [{"group": "g"}, {"display_name": "run-1"}, {"state": "finished"}]
    }
    assert compare.parse_wandb_source("me/proj") == ("me/proj", {})
    with pytest.raises(ValueError, match="ENTITY/PROJECT"):
        compare.parse_wandb_source("lm-human-preferences?task_id=sentiment")


def test_wandb_source_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    start = time.time()
    with pytest.raises(compare.WandbUnavailableError, match="unreachable"):
        compare.load_wandb_runs("openrlbenchmark/lm-human-preferences?task_id=sentiment")
    assert time.time() - start < 1
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there: refused at once
    start = time.time()
    assert not compare.wandb_reachable(timeout=3.0) and time.time() - start < 1


def run_cli(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """benchmark/compare.py as a user runs it."""
    return subprocess.run(
        [sys.executable, "benchmark/compare.py", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_cli_offline_on_tensorboard_and_csv_runs(runs_root, tmp_path):
    out = tmp_path / ("x" * 150) / "compare"  # longer than the console: a printed path must still be whole
    result = run_cli(
        "--runs", f"low={runs_root}/low/seed*", f"high={runs_root}/high/seed*", f"OAI={runs_root}/oai/*.csv",
        "--reference", "OAI", "--metrics", "objective/score", "ppo/policy/entropy",
        "--formats", "png", "svg", "--last_k", "5", "--output_dir", str(out), env={"COLUMNS": "80"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG") and (out / "curves.svg").stat().st_size > 0
    table = (out / "final_values.md").read_text()
    assert "mean of its last 5 logged values" in table and "| metric | group | runs |" in table
    rows = {}
    for line in table.splitlines():
        if line.startswith("| objective/score |"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[1]] = cells
    assert list(rows) == ["low", "high", "OAI"] and rows["OAI"][6] == "—"
    # the CSV group holds `low`'s values under OAI's prefixed names: no difference; `high` is 1 above
    assert abs(float(rows["low"][6])) < 1e-5
    assert float(rows["high"][6]) == pytest.approx(1.0, abs=1e-5)
    lines = result.stdout.splitlines()
    written = [line for line in lines if line.startswith("wrote ")]
    assert len(written) == 1 and str(out / "curves.png") in written[0] and str(out / "final_values.md") in written[0]
    # an 80-column console keeps every metric name and number whole: one table per metric, named in its title
    assert "objective/score: final values" in result.stdout and "ppo/policy/entropy: final values" in result.stdout
    assert "…" not in result.stdout and max(len(line) for line in lines if line not in written) <= 80


def test_cli_wandb_source_offline_is_one_clear_line(runs_root, tmp_path):
    start = time.time()
    result = run_cli(
        "--wandb", "OAI=openrlbenchmark/lm-human-preferences?task_id=sentiment",
        "--runs", f"ours={runs_root}/low/seed*", "--output_dir", str(tmp_path),
        env={"WANDB_MODE": "offline"},
    )  # fmt: skip
    assert result.returncode != 0 and time.time() - start < 30
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith("error: wandb source") and "unreachable" in result.stderr
