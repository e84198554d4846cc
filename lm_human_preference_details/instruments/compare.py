"""Learning curves from TensorBoard, CSV exports and wandb, aligned on episodes, aggregated over seeds and compared.

Metric names are OAI's TensorBoard tags (`objective/score`, `ppo/policy/entropy`, `elapsed/episodes`), which this
project logs too. OAI's wandb project openrlbenchmark/lm-human-preferences syncs those tags with one more `ppo/` in
front (`ppo/objective/score`, `ppo/ppo/policy/entropy`); `canonical_name` removes it, so every source reads alike.
The x-axis is episodes, whatever the step convention (OAI logs update s at step s, elapsed/episodes = (s + 1) * batch).
"""

import csv
import glob
import json
import logging
import math
import os
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_METRICS = (
    "objective/score",
    "objective/kl",
    "objective/kl_coef",
    "ppo/policy/entropy",
    "ppo/val/var_explained",
    "ppo/policy/clipfrac",
    "ppo/policy/approxkl",
)
"""Panels of the comparison plot and rows of the final-value table, unless asked otherwise."""
EPISODES = "elapsed/episodes"
"""The x-axis: episodes seen so far, (update + 1) * batch_size (OAI train_policy.py#L247)."""
STEP_KEYS = ("global_step", "step", "_step")
"""Step columns, in order of preference, to derive episodes from when a run has no elapsed/episodes."""
OAI_TAG_ROOTS = ("objective/", "ppo/", "elapsed/")
"""First components of OAI's policy tags; under OAI's wandb `ppo/` prefix they mark a name to shorten."""
Band = Literal["stderr", "minmax"]


class WandbUnavailableError(RuntimeError):
    """A wandb source was asked for, but the wandb server cannot be reached (no network, or WANDB_MODE=offline)."""


class MissingEpisodesError(ValueError):
    """A run has neither elapsed/episodes nor, with episodes_per_step, a step column to derive it from."""


@dataclass
class Curve:
    """One metric of one run: values against episodes, sorted by episodes."""

    episodes: np.ndarray
    values: np.ndarray


@dataclass
class Run:
    """A run's name (path or wandb id) and its curves by canonical metric name."""

    name: str
    curves: dict[str, Curve]
    kl_target: float | None = None
    """the adaptive KL controller's target in nats, from the run's args.json (None: unknown or a fixed kl_coef)"""


MIN_RUNS_FOR_CI = 3
"""runs each group needs for a bootstrap interval: resampling 1 or 2 runs gives intervals that are no evidence"""


@dataclass
class FinalRow:
    """One metric of one group in the final-value table; diff and CI are None for the reference group."""

    metric: str
    group: str
    num_runs: int
    mean: float
    stderr: float
    episodes: float
    diff: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    too_few_runs: bool = False
    """the group or the reference has fewer runs than an interval needs: no CI"""


# ---------------------------------------------------------------------------------------------------- names and columns
def canonical_name(name: str) -> str:
    """OAI's wandb name -> its TensorBoard tag (ppo/objective/score -> objective/score, ppo/ppo/policy/entropy ->
    ppo/policy/entropy); this project's own names (ppo/policy/entropy) are returned unchanged."""
    if name.startswith("ppo/"):
        rest = name[len("ppo/") :]
        if rest.startswith(OAI_TAG_ROOTS) or rest == "global_step":
            return rest
    return name


def rows_to_columns(rows: Sequence[dict[str, float]]) -> dict[str, np.ndarray]:
    """Rows of {name: value} -> one float array per canonical name, NaN where a row lacks that name."""
    canonical_rows = [{canonical_name(key): value for key, value in row.items()} for row in rows]
    names = sorted({name for row in canonical_rows for name in row})
    return {name: np.array([row.get(name, np.nan) for row in canonical_rows], dtype=float) for name in names}


def run_from_columns(name: str, columns: dict[str, np.ndarray], episodes_per_step: float | None = None) -> Run:
    """Curves of every metric column against episodes: elapsed/episodes, else (step + 1) * episodes_per_step."""
    columns = {canonical_name(key): np.asarray(values, dtype=float) for key, values in columns.items()}
    step_key = next((key for key in STEP_KEYS if key in columns), None)
    if EPISODES in columns:
        episodes = columns[EPISODES]
    elif step_key is not None and episodes_per_step is not None:
        episodes = (columns[step_key] + 1) * episodes_per_step
    else:
        raise MissingEpisodesError(
            f"run '{name}' logs no {EPISODES}; pass --episodes_per_step (OAI books: 512, tldr/cnndm: 32) to derive "
            f"episodes from its {step_key or 'step'} column"
        )
    curves = {}
    for key, values in columns.items():
        if key == EPISODES or key in STEP_KEYS:
            continue
        logged = np.isfinite(episodes) & np.isfinite(values)
        if logged.any():
            order = np.argsort(episodes[logged], kind="stable")
            curves[key] = Curve(episodes[logged][order], values[logged][order])
    return Run(name, curves)


# ---------------------------------------------------------------------------------------------------- local sources
def read_tensorboard(path: str) -> dict[str, np.ndarray]:
    """Scalars of every TensorBoard event file under `path` (e.g. an --output_dir), one row per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = glob.glob(os.path.join(glob.escape(path), "**", "events.out.tfevents.*"), recursive=True)
    by_step: dict[int, dict[str, float]] = {}
    for directory in sorted({os.path.dirname(file) for file in event_files}):
        events = EventAccumulator(directory, size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                by_step.setdefault(event.step, {"step": event.step})[tag] = event.value
    return rows_to_columns([by_step[step] for step in sorted(by_step)])


def _to_float(text: str) -> float:
    """A CSV cell as a float; empty or non-numeric cells are NaN."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def read_csv(path: str) -> dict[str, np.ndarray]:
    """A CSV export of one run: a header of metric names (OAI's `ppo/`-prefixed ones too), one row per step."""
    with open(path, newline="") as f:
        rows = [{key: _to_float(value) for key, value in row.items() if key} for row in csv.DictReader(f)]
    return rows_to_columns(rows)


def kl_target_of(path: str) -> float | None:
    """The KL target of a train_policy.py run directory, from its args.json; None without one or with a fixed β."""
    try:
        with open(os.path.join(path, "args.json")) as f:
            adaptive = json.load(f)["rewards"]["adaptive_kl"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(adaptive["target"]) if adaptive.get("enabled") else None


def load_local_runs(pattern: str, episodes_per_step: float | None = None) -> list[Run]:
    """The runs a path or glob names: each match is one run, a .csv file or a directory with TensorBoard events."""
    paths = sorted(glob.glob(pattern)) or ([pattern] if os.path.exists(pattern) else [])
    if not paths:
        raise FileNotFoundError(f"no file or directory matches '{pattern}'")
    runs = []
    for path in paths:
        columns = read_csv(path) if path.lower().endswith(".csv") else read_tensorboard(path)
        if not columns:
            raise ValueError(
                f"'{path}' holds no scalars: expected a .csv export or a directory with TensorBoard events"
            )
        run = run_from_columns(path, columns, episodes_per_step)
        run.kl_target = kl_target_of(path) if os.path.isdir(path) else None
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------------- wandb
def _json_scalar(text: str) -> str | int | float | bool:
    """'1' -> 1, 'true' -> True, '0.5' -> 0.5; anything else stays a string (config values keep their type)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (bool, int, float)) else text


def parse_wandb_source(source: str) -> tuple[str, dict]:
    """'entity/project?key=value&...' -> ('entity/project', wandb API filters), all conditions and-ed: `tag=T` (runs
    tagged T), `group=G`, `state=S`, `name=N` (display name), any other key a config value (`task_id=sentiment`)."""
    path, _, query = source.partition("?")
    if path.count("/") != 1 or not all(path.split("/")):
        raise ValueError(f"wandb source '{source}' must look like ENTITY/PROJECT[?key=value&...]")
    conditions: list[dict] = []
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key == "tag":
            conditions.append({"tags": {"$in": [value]}})
        elif key in ("group", "state"):
            conditions.append({key: value})
        elif key == "name":
            conditions.append({"display_name": value})
        else:
            # the same key form openrlbenchmark uses for this project: config.<dotted key>.value
            conditions.append({f"config.{key}.value": _json_scalar(value)})
    return path, ({"$and": conditions} if conditions else {})


def wandb_host() -> tuple[str, int]:
    """Host and port of the wandb server (WANDB_BASE_URL, default https://api.wandb.ai)."""
    url = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def wandb_reachable(timeout: float = 3.0) -> bool:
    """True unless WANDB_MODE is offline/disabled or the wandb server does not accept a TCP connection within
    `timeout` seconds (name lookup included: it runs in a thread that is not waited for longer)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return False
    connected = threading.Event()

    def connect() -> None:
        """Open and close one connection to the server."""
        try:
            with socket.create_connection(wandb_host(), timeout=timeout):
                connected.set()
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout)
    return connected.is_set()


def _numeric_items(row: dict) -> dict[str, float]:
    """The numeric entries of a wandb history row (tables, media and strings dropped)."""
    return {key: float(value) for key, value in row.items() if isinstance(value, (int, float))}


def load_wandb_runs(source: str, episodes_per_step: float | None = None) -> list[Run]:
    """Every run of a wandb source (parse_wandb_source's syntax) with its full history; runs without episodes are
    skipped with a warning (e.g. the reward-model runs of a project)."""
    if not wandb_reachable():
        host, _ = wandb_host()
        raise WandbUnavailableError(
            f"wandb source '{source}' needs {host}, which is unreachable (offline, or WANDB_MODE=offline); "
            "compare local TensorBoard directories or CSV exports with --runs instead"
        )
    import wandb

    path, filters = parse_wandb_source(source)
    runs = []
    for wandb_run in wandb.Api(timeout=60).runs(path, filters=filters):
        rows = [_numeric_items(row) for row in wandb_run.scan_history()]
        name = f"{path}/{wandb_run.id} ({wandb_run.name})"
        try:
            runs.append(run_from_columns(name, rows_to_columns(rows), episodes_per_step))
        except MissingEpisodesError as error:
            logger.warning("skipped: %s", error)
    if not runs:
        raise ValueError(f"no run of wandb source '{source}' matched its filters and logged {EPISODES}")
    return runs


# ---------------------------------------------------------------------------------------------------- aggregation
def episode_grid(curves: Sequence[Curve], num_points: int) -> np.ndarray:
    """`num_points` evenly spaced episodes over the range every curve covers (from the latest first point to the
    earliest last point), so that a mean over runs never changes its set of runs; the union range if they are
    disjoint."""
    start = max(curve.episodes[0] for curve in curves)
    stop = min(curve.episodes[-1] for curve in curves)
    if stop < start:
        start = min(curve.episodes[0] for curve in curves)
        stop = max(curve.episodes[-1] for curve in curves)
    return np.linspace(start, stop, num_points)


def interpolate(curve: Curve, grid: np.ndarray) -> np.ndarray:
    """The curve linearly interpolated at `grid` episodes; NaN outside its logged range."""
    return np.interp(grid, curve.episodes, curve.values, left=np.nan, right=np.nan)


def seed_band(values: np.ndarray, band: Band = "stderr") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over runs (rows of `values`, NaN where a run has no point) and a band: mean -+ standard error of the mean
    (sample std / sqrt(n), NaN where n < 2) or the min/max over runs."""
    finite = np.isfinite(values)
    count = finite.sum(0)
    filled = np.where(finite, values, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, filled.sum(0) / count, np.nan)
        if band == "minmax":
            return mean, np.fmin.reduce(values, axis=0), np.fmax.reduce(values, axis=0)
        squares = np.where(finite, (values - mean) ** 2, 0.0).sum(0)
        stderr = np.where(count > 1, np.sqrt(squares / (count - 1) / count), np.nan)
    return mean, mean - stderr, mean + stderr


def final_value(curve: Curve, last_k: int) -> float:
    """Mean of the run's last `last_k` logged values."""
    return float(curve.values[-last_k:].mean())


def bootstrap_mean_difference(
    reference: np.ndarray, other: np.ndarray, num_resamples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """mean(other) - mean(reference) and its percentile bootstrap confidence interval, resampling the runs of each
    group with replacement."""
    reference, other = np.asarray(reference, dtype=float), np.asarray(other, dtype=float)
    rng = np.random.default_rng(seed)
    reference_means = reference[rng.integers(0, len(reference), (num_resamples, len(reference)))].mean(1)
    other_means = other[rng.integers(0, len(other), (num_resamples, len(other)))].mean(1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(other_means - reference_means, [tail, 1 - tail])
    return float(other.mean() - reference.mean()), float(low), float(high)


def final_value_rows(
    groups: dict[str, list[Run]],
    metrics: Iterable[str],
    reference: str,
    last_k: int = 10,
    num_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
    min_runs: int = MIN_RUNS_FOR_CI,
) -> list[FinalRow]:
    """Per metric and group: mean and standard error of the runs' final values, and each group's difference to the
    reference group with a bootstrap confidence interval when both groups have at least `min_runs` runs."""
    rows = []
    for metric in metrics:
        finals = {}
        for group, runs in groups.items():
            curves = [run.curves[metric] for run in runs if metric in run.curves]
            if curves:
                finals[group] = (
                    np.array([final_value(curve, last_k) for curve in curves]),
                    float(np.median([curve.episodes[-1] for curve in curves])),
                )
        for group, (values, episodes) in finals.items():
            stderr = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else math.nan
            row = FinalRow(metric, group, len(values), float(values.mean()), stderr, episodes)
            if group != reference and reference in finals:
                row.diff, row.ci_low, row.ci_high = bootstrap_mean_difference(
                    finals[reference][0], values, num_resamples, confidence, seed
                )
                if min(len(values), len(finals[reference][0])) < min_runs:
                    row.ci_low = row.ci_high = None
                    row.too_few_runs = True
            rows.append(row)
    return rows


def format_number(value: float | None) -> str:
    """A table cell: 4 significant digits, '—' for missing."""
    return "—" if value is None or not math.isfinite(value) else f"{value:.4g}"


def confidence_cell(row: FinalRow, min_runs: int = MIN_RUNS_FOR_CI) -> str:
    """The CI cell of a row: the interval, '—' for the reference group, or why there is none."""
    if row.too_few_runs:
        return f"none: < {min_runs} runs"
    return "—" if row.diff is None else f"[{format_number(row.ci_low)}, {format_number(row.ci_high)}]"


def markdown_table(
    rows: Sequence[FinalRow], reference: str, confidence: float = 0.95, min_runs: int = MIN_RUNS_FOR_CI
) -> str:
    """The final-value rows as a markdown table; differences are to the `reference` group."""
    percent = f"{100 * confidence:g}%"
    header = ["metric", "group", "runs", "episodes", "final (mean)", "stderr", f"diff vs {reference}", f"{percent} CI"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ci = confidence_cell(row, min_runs)
        diff = "—" if row.diff is None else f"{row.diff:+.4g}"
        cells = [row.metric, row.group, str(row.num_runs), f"{row.episodes:.0f}", format_number(row.mean)]
        lines.append("| " + " | ".join([*cells, format_number(row.stderr), diff, ci]) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- plotting
KL_METRIC = "objective/kl"
"""the panel that shows the KL controller's target"""


def kl_targets(groups: dict[str, list[Run]]) -> list[float]:
    """The distinct KL targets of the runs (from their args.json), smallest first."""
    return sorted({run.kl_target for runs in groups.values() for run in runs if run.kl_target is not None})


def curves_figure(
    groups: dict[str, list[Run]],
    metrics: Sequence[str],
    band: Band = "stderr",
    num_points: int = 256,
    title: str | None = None,
    targets: Sequence[float] = (),
):
    """One panel per metric, one color per group: mean over runs against episodes and a seed band; the objective/kl
    panel draws each KL target as a dashed line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    figure = Figure(figsize=(5 * ncols, 3.6 * nrows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = list(figure.subplots(nrows, ncols, squeeze=False).flat)
    handles = {}
    for ax, metric in zip(axes, metrics):
        for index, (group, runs) in enumerate(groups.items()):
            curves = [run.curves[metric] for run in runs if metric in run.curves]
            if not curves:
                continue
            grid = episode_grid(curves, num_points)
            mean, low, high = seed_band(np.stack([interpolate(curve, grid) for curve in curves]), band)
            (line,) = ax.plot(grid, mean, color=f"C{index}", linewidth=1.5)
            ax.fill_between(grid, low, high, color=f"C{index}", alpha=0.2, linewidth=0)
            handles.setdefault(group, (line, len(runs)))
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        if metric == KL_METRIC:
            for target in targets:
                ax.axhline(target, color="gray", linestyle="--", linewidth=1)
                ax.text(0.01, target, f"KL target {target:g} nats", transform=ax.get_yaxis_transform(),
                        va="bottom", fontsize=8, color="dimgray")  # fmt: skip
        ax.set_title(metric)
        ax.set_xlabel("episodes")
        ax.grid(alpha=0.3)
    for ax in axes[len(metrics) :]:
        ax.set_visible(False)
    band_text = "mean ± standard error" if band == "stderr" else "mean, min-max"
    if handles:
        labels = [f"{group} ({n} run{'s' * (n != 1)})" for group, (_, n) in handles.items()]
        figure.legend([line for line, _ in handles.values()], labels, loc="outside lower center", ncols=len(labels))
    figure.suptitle(f"{title + ': ' if title else ''}{band_text} over runs")
    return figure


def plot_curves(
    groups: dict[str, list[Run]],
    metrics: Sequence[str],
    path_stem: str,
    band: Band = "stderr",
    formats: Sequence[str] = ("png",),
    num_points: int = 256,
    title: str | None = None,
    targets: Sequence[float] = (),
) -> list[str]:
    """`curves_figure` written as `path_stem`.<format> for each format (png, svg, pdf); returns the paths."""
    figure = curves_figure(groups, metrics, band, num_points, title, targets)
    os.makedirs(os.path.dirname(path_stem) or ".", exist_ok=True)
    paths = [f"{path_stem}.{fmt}" for fmt in formats]
    for path in paths:
        figure.savefig(path, dpi=120)
    return paths
