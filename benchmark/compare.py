"""Overlay training runs on OAI's: one panel per metric against episodes, mean and a band over seeds, final values.

    # offline: TensorBoard directories (each --output_dir is one run; a glob of seed directories is one group)
    python benchmark/compare.py --runs "tf_adam=models/oai_sentiment/seed*/train_policy" \
        "torch_adam=models/ablation_torch_adam/seed*/train_policy" --output_dir compare/adam
    # online: against OAI's own sentiment runs in the wandb project openrlbenchmark/lm-human-preferences
    python benchmark/compare.py \
        --wandb "OAI=openrlbenchmark/lm-human-preferences?task_id=sentiment&task.value.policy.initial_model=124M" \
        --runs "ours=models/oai_sentiment/seed*/train_policy" --output_dir compare/sentiment

A source is GROUP=WHERE; sources that share a GROUP form one group. Local WHERE: a path or glob; each match is one
run, a directory with TensorBoard event files anywhere below it, or a .csv export (a header of metric names, one row
per step, with elapsed/episodes or a step column). wandb WHERE: ENTITY/PROJECT?key=value&... where `tag=T`,
`group=G`, `state=S` and `name=N` select on the run itself and any other key on its config (`task_id=sentiment`).
OAI's wandb names (`ppo/objective/score`, `ppo/ppo/policy/entropy`) are read as their TensorBoard tags.

Writes OUTPUT_DIR/curves.{png,...} and OUTPUT_DIR/final_values.md: per metric and group, the mean of every run's
last --last_k values, and each group's difference to the reference group with a bootstrap confidence interval.
"""

import os
import sys
from dataclasses import dataclass, field
from typing import Literal

from rich import box
from rich.console import Console
from rich.table import Column, Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lm_human_preference_details import cli
from lm_human_preference_details.instruments import compare


@dataclass
class Args:
    runs: list[str] = field(default_factory=list)
    """local runs, GROUP=PATH_OR_GLOB ...: TensorBoard directories (an --output_dir) or CSV exports; quote globs"""
    wandb: list[str] = field(default_factory=list)
    """wandb runs, GROUP=ENTITY/PROJECT?key=value&... (keys: tag, group, state, name, else a config key); online only"""
    reference: str | None = None
    """group the others are compared with in the table (default: the first --wandb group, else the first --runs one)"""
    metrics: list[str] = field(default_factory=lambda: list(compare.DEFAULT_METRICS))
    """metrics to plot and tabulate, by this project's (= OAI's TensorBoard) names; OAI's wandb `ppo/` is implied"""
    band: Literal["stderr", "minmax"] = "stderr"
    """band around the mean over runs: standard error of the mean, or min/max"""
    output_dir: str = "compare"
    """where curves.<format> and final_values.md are written"""
    formats: list[Literal["png", "svg", "pdf"]] = field(default_factory=lambda: ["png"])
    """figure formats to write"""
    last_k: int = 10
    """a run's final value is the mean of its last this-many logged values"""
    num_points: int = 256
    """episode grid points each group's runs are interpolated onto before averaging"""
    episodes_per_step: float | None = None
    """for runs without elapsed/episodes: episodes = (step + 1) * this (OAI: 512 books, 32 tldr/cnndm)"""
    bootstrap_samples: int = 10_000
    """bootstrap resamples of the difference of group means"""
    confidence: float = 0.95
    """confidence level of the bootstrap interval"""
    min_runs: int = compare.MIN_RUNS_FOR_CI
    """runs (seeds) each of two groups needs for a bootstrap interval of their difference; fewer: no interval"""
    seed: int = 0
    """seed of the bootstrap resampling"""
    title: str | None = None
    """figure title"""
    kl_target: float | None = None
    """KL target (nats) drawn on the objective/kl panel; default: the adaptive targets in the local runs' args.json
    (6 for OAI's books tasks); pass it for wandb runs"""


def split_source(source: str, flag: str) -> tuple[str, str]:
    """'GROUP=WHERE' -> (GROUP, WHERE)."""
    group, sep, where = source.partition("=")
    if not sep or not group or not where or "/" in group or "?" in group:
        raise SystemExit(f"error: {flag} takes GROUP=WHERE, got '{source}'")
    return group, where


def load_groups(args: Args) -> dict[str, list[compare.Run]]:
    """Runs by group, wandb groups first, in the order given."""
    groups: dict[str, list[compare.Run]] = {}
    for source in args.wandb:
        group, where = split_source(source, "--wandb")
        groups.setdefault(group, []).extend(compare.load_wandb_runs(where, args.episodes_per_step))
    for source in args.runs:
        group, where = split_source(source, "--runs")
        groups.setdefault(group, []).extend(compare.load_local_runs(where, args.episodes_per_step))
    return groups


def main(args: Args) -> None:
    """Load, plot, tabulate."""
    if not args.runs and not args.wandb:
        raise SystemExit("error: give at least one source with --runs or --wandb")
    console = Console(soft_wrap=True)  # tables fit the terminal; a line of text is never broken: a path stays whole
    try:
        groups = load_groups(args)
    except (compare.WandbUnavailableError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    reference = args.reference or next(iter(groups))
    if reference not in groups:
        raise SystemExit(f"error: --reference '{reference}' is none of the groups {list(groups)}")

    runs_table = Table("group", "runs", "last episode (min - max)", "metrics found", title="runs")
    for group, runs in groups.items():
        found = sorted({metric for run in runs for metric in run.curves if metric in args.metrics})
        last = [max(curve.episodes[-1] for curve in run.curves.values()) for run in runs if run.curves]
        span = f"{min(last):.0f} - {max(last):.0f}" if last else "—"
        runs_table.add_row(group, str(len(runs)), span, f"{len(found)}/{len(args.metrics)}")
    console.print(runs_table)
    missing = [m for m in args.metrics if not any(m in run.curves for runs in groups.values() for run in runs)]
    if missing:
        console.print(f"[yellow]no run logs {', '.join(missing)}[/yellow]")

    stem = os.path.join(args.output_dir, "curves")
    targets = [args.kl_target] if args.kl_target is not None else compare.kl_targets(groups)
    paths = compare.plot_curves(
        groups, args.metrics, stem, args.band, args.formats, args.num_points, args.title, targets
    )
    rows = compare.final_value_rows(
        groups, args.metrics, reference, args.last_k, args.bootstrap_samples, args.confidence, args.seed, args.min_runs
    )
    markdown = compare.markdown_table(rows, reference, args.confidence, args.min_runs)
    table_path = os.path.join(args.output_dir, "final_values.md")
    with open(table_path, "w") as f:
        f.write(
            f"Final value of a run: mean of its last {args.last_k} logged values. Difference: the group's mean minus "
            f"the mean of group {reference}, with a percentile bootstrap interval over runs "
            f"({args.bootstrap_samples} resamples, seed {args.seed}) when both groups have at least {args.min_runs} "
            f"runs.\n\n{markdown}"
        )

    percent = f"{100 * args.confidence:g}% CI"
    final_tables = {}  # one table per metric, its name in the title: whole at any terminal width
    for row in rows:
        diff = "—" if row.diff is None else f"{row.diff:+.4g}"
        ci = compare.confidence_cell(row, args.min_runs)
        cells = [compare.format_number(row.mean), compare.format_number(row.stderr), diff, ci]
        if row.metric not in final_tables:
            numbers = [Column(header, no_wrap=True) for header in ("runs", "final", "stderr", "diff", percent)]
            title = f"{row.metric}: final values, diff vs {reference}"
            final_tables[row.metric] = Table(
                Column("group", overflow="fold"), *numbers, title=title, title_justify="left", box=box.SIMPLE_HEAD
            )
        final_tables[row.metric].add_row(row.group, str(row.num_runs), *cells)
    for table in final_tables.values():
        console.print(table)
    few = {group: len(runs) for group, runs in groups.items() if len(runs) < args.min_runs}
    if few and len(groups) > 1:
        listed = ", ".join(f"{group} ({count})" for group, count in few.items())
        console.print(
            f"[yellow]no confidence interval where a group has fewer than {args.min_runs} runs: {listed}; an interval "
            "from 1 or 2 seeds is no evidence of a difference, run more seeds (--min_runs sets the minimum)[/yellow]"
        )
    console.print(f"wrote {', '.join(paths)} and {table_path}")


if __name__ == "__main__":
    main(cli.tyro_cli(Args, description=__doc__, use_underscores=True))
