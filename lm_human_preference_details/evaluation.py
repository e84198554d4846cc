"""Evaluation of a trained policy against its base model: fresh samples on held-out queries, scored by the reward (the
proxy PPO maximised: a reward model or a programmatic reward) and a gold judge (never trained on), their KL to the base
model, and win rates.

Each episode is processed exactly as one of train_policy.py's rollouts (OAI train_policy.py#L281-L316): the policy
samples a response to prefix ⊕ query ⊕ suffix at the task temperature; the KL is the sum over the raw response's tokens
of logprob(policy) - logprob(base), tempered, as `objective/kl` (spec P4, G6); the response is truncated; the reward
scores raw query and truncated response (with the training run's normalization, spec RS1), and responses failing the
filter get `task.penalty_reward_value` as `objective/score` (spec P2, P3; with `task.penalty_mode` subtract, their score
plus it); a gold judge sees the same truncated response, as `objective/gold_score`. With `task.end_at_eos` a response
ends at its first EOS (nplus N19-N21): the KL sums its tokens up to that EOS only, as the training run's.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L281-L316
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.data import QueryStream
from lm_human_preference_details.kernels import logprobs_from_logits
from lm_human_preference_details.labelers import Labeler, decode_without_pad
from lm_human_preference_details.modeling import PolicyWithValueHead, sample
from lm_human_preference_details.rewards import Reward, is_programmatic
from lm_human_preference_details.tasks import (
    TaskHParams,
    check_truncation_resolved,
    encode_context_affixes,
    format_contexts,
    passes_filter,
    response_ends,
    truncate_response,
)

SCORE, GOLD, KL, PASS = "score", "gold_score", "kl", "filter_pass_rate"
"""per-episode metrics, named as train_policy.py's objective/score, objective/gold_score, objective/kl and
debug/filter_pass_rate"""
BASE_RUN = "base"
"""run name of the base model's point in a gold-vs-KL curve"""
JUDGES = (SCORE, GOLD)
"""metrics that judge a response (higher is better): win rates are computed for these"""
METRIC_TITLES = {
    SCORE: "reward-model score",
    GOLD: "gold score",
    KL: "KL to the base model, nats",
    PASS: "filter pass rate",
}


@dataclass
class Episodes:
    """One policy's episodes on the evaluation queries, on the CPU; row i of every tensor belongs to query i."""

    responses: torch.Tensor
    """(n, L) sampled tokens, as PPO trains on them"""
    truncated: torch.Tensor
    """(n, L) responses after truncation (PAD after the truncation point), what the judges see"""
    metrics: dict[str, torch.Tensor]
    """(n,) float per metric: score (filter penalty applied), gold_score (with a gold judge), kl, filter_pass_rate"""


# ---------------------------------------------------------------- episodes


def heldout_queries(
    texts, tokenizer: PreTrainedTokenizerBase, task: TaskHParams, data_seed: int, skip: int, n: int
) -> tuple[torch.Tensor, bool, Callable, int]:
    """Queries skip .. skip+n-1 of the task's query stream (n, Lq), whether the stream wrapped around before or
    inside them (then they repeat earlier queries of the stream, e.g. those a training run consumed), the stream's
    `conversation_of` (a query's chat messages, for a reward model with its own chat template), and how many distinct
    texts the n queries come from (fewer than n when the texts that give a query are fewer than n: the stream then
    repeats them within the n)."""
    # one process reads the stream in OAI's global order: the training run's ranks together drew its first
    # nupdates * batch_size queries (spec D3)
    stream = QueryStream(texts, tokenizer, task, 0, 1, data_seed)
    for start in range(0, skip, 1024):
        stream.next_batch(min(1024, skip - start))
    queries = stream.next_batch(n)
    distinct = len(set(stream.last_batch_texts()))
    return queries, stream.state_dict()["cursor"] > len(texts), stream.conversation_of, distinct


@torch.no_grad()
def sample_and_score(
    policy: PolicyWithValueHead,
    ref_policy: PolicyWithValueHead,
    queries: torch.Tensor,
    task: TaskHParams,
    tokenizer: PreTrainedTokenizerBase,
    reward: Reward,
    judges: dict[str, Labeler],
    generator: torch.Generator,
    batch_size: int = 64,
) -> Episodes:
    """Sample one response per query (n, Lq) and score it as train_policy.py's rollout does, in batches."""
    check_truncation_resolved(task)
    pad_id = tokenizer.pad_token_id
    prefix, suffix = encode_context_affixes(tokenizer, task)
    device = next(policy.parameters()).device
    parts = []
    for batch in queries.split(batch_size):
        batch = batch.to(device)
        contexts = format_contexts(batch, prefix, suffix)  # (b, C)
        responses, logprobs, _ = sample(policy, contexts, task.response_length, task.temperature, pad_id, generator)
        # the base model's tempered log-probs of the same tokens, from one forward (spec G6, P4)
        ref_logits = ref_policy(torch.cat([contexts, responses], 1), contexts.shape[1], pad_id, task.temperature)[0]
        token_kl = logprobs - logprobs_from_logits(ref_logits, responses)  # (b, L)
        # truncate -> the reward of raw query and truncated response -> filter penalty (spec P2, P3, RS1)
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L378-L390
        truncated = truncate_response(responses, task.truncate_token, task.truncate_after, pad_id)
        if task.end_at_eos:  # no KL after a response's first EOS, as in training (nplus N20)
            token_kl = token_kl.masked_fill(after_end(truncated, task.truncate_token), 0.0)
        kl = token_kl.sum(1)  # (b,)
        scores = reward(batch, truncated)
        passed = passes_filter(truncated, task.truncate_token, task.truncate_after)
        if task.penalty_mode == "subtract":  # TRL's missing_eos_penalty (nplus N19)
            # https://github.com/huggingface/trl/blob/14ef1aba152fddbc5a58f3a8a712b6e509e7e69d/trl/trainer/ppo_trainer.py#L414-L418
            metrics = {SCORE: torch.where(passed, scores, scores + task.penalty_reward_value)}
        else:
            metrics = {SCORE: torch.where(passed, scores, task.penalty_reward_value)}
        for name, judge in judges.items():
            metrics[name] = judge.scores(batch, truncated[:, None])[:, 0].to(device)
        metrics.update({KL: kl, PASS: passed.float()})
        parts.append((responses, truncated, metrics))
    return Episodes(
        responses=torch.cat([p[0] for p in parts]).cpu(),
        truncated=torch.cat([p[1] for p in parts]).cpu(),
        metrics={k: torch.cat([p[2][k] for p in parts]).float().cpu() for k in parts[0][2]},
    )


def after_end(truncated: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(b, L) bool: the positions after each response's first EOS (nplus N20)."""
    positions = torch.arange(truncated.shape[1], device=truncated.device)
    return positions > response_ends(truncated, eos_id)[:, None]


# ---------------------------------------------------------------- statistics


def mean_and_stderr(values: torch.Tensor) -> dict[str, float]:
    """Sample mean and its standard error, std (n - 1 in the denominator) / sqrt(n); needs n >= 2."""
    if values.numel() < 2:
        raise ValueError(f"a standard error needs at least 2 episodes, got {values.numel()}; raise --num_queries.")
    values = values.double()
    return {"mean": values.mean().item(), "stderr": (values.std(correction=1) / math.sqrt(values.numel())).item()}


def win_rate(candidate: torch.Tensor, baseline: torch.Tensor) -> float:
    """Fraction of paired episodes (same query) where candidate > baseline; ties count 1/2."""
    if candidate.shape != baseline.shape:
        raise ValueError(
            f"win rate needs paired scores of equal shape, got {tuple(candidate.shape)} and {tuple(baseline.shape)}."
        )
    return ((candidate > baseline).double() + 0.5 * (candidate == baseline).double()).mean().item()


def summarize(base: Episodes, trained: Episodes) -> dict:
    """Mean ± stderr of every metric for base and trained, and the win rate of trained over base per judge."""
    metrics = {
        name: {"base": mean_and_stderr(base.metrics[name]), "trained": mean_and_stderr(trained.metrics[name])}
        for name in trained.metrics
    }
    wins = {name: win_rate(trained.metrics[name], base.metrics[name]) for name in JUDGES if name in trained.metrics}
    return {"metrics": metrics, "win_rate": wins}


def curve_point(run: str, name: str, episodes: Episodes) -> dict:
    """One point of the gold-vs-KL plot: mean ± stderr of every metric of one policy (checkpoint) of a run."""
    return {"run": run, "policy": name, **{k: mean_and_stderr(v) for k, v in episodes.metrics.items()}}


def examples(
    tokenizer: PreTrainedTokenizerBase, queries: torch.Tensor, base: Episodes, trained: Episodes, n: int
) -> list[dict]:
    """The first n queries with the base and the trained response (truncated) side by side, with their metrics."""
    pad_id = tokenizer.pad_token_id

    def side(episodes: Episodes) -> list[dict]:
        texts = decode_without_pad(tokenizer, episodes.truncated[:n], pad_id)
        return [
            {"response": text, **{k: v[i].item() for k, v in episodes.metrics.items()}} for i, text in enumerate(texts)
        ]

    query_texts = decode_without_pad(tokenizer, queries[:n], pad_id)
    return [{"query": q, "base": b, "trained": t} for q, b, t in zip(query_texts, side(base), side(trained))]


# ---------------------------------------------------------------- output


def _fmt(stat: dict[str, float]) -> str:
    """'mean ± stderr' with 3 decimals (a mean that rounds to 0 is "+0.000", never "-0.000")."""
    mean = stat["mean"] if abs(stat["mean"]) >= 5e-4 else 0.0
    return f"{mean:+.3f} ± {stat['stderr']:.3f}"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.strip().replace("|", "\\|").replace("\n", "⏎")


def reward_label(spec: str) -> str:
    """A programmatic reward's name, short: python:FILE.py:FUNCTION names the file without its directory."""
    if not spec.startswith("python:"):
        return spec
    path, _, function = spec.removeprefix("python:").rpartition(":")
    return f"python:{os.path.basename(path)}:{function}"


def score_title(report: dict) -> str:
    """What the score metric is: the reward-model score, or the programmatic reward's; ', normalized' with a gain and
    bias."""
    spec = report.get("reward_model")
    title = f"reward score ({reward_label(spec)})" if spec and is_programmatic(spec) else METRIC_TITLES[SCORE]
    return title + (", normalized" if report.get("reward_normalization") else "")


def normalization_note(report: dict) -> str:
    """One sentence on the gain and bias applied to the reward, or '' when none was."""
    n = report.get("reward_normalization")
    if not n:
        return ""
    return (
        f"The reward is normalized as in training ({n['args_json']}): gain {n['gain']:.6g} * score + "
        f"bias {n['bias']:.6g}, measured on {n['samples']} samples of the initial policy (mean {n['mean']:.4g}, std "
        f"{n['std']:.4g}); the filter penalty is not normalized."
    )


def metric_rows(report: dict) -> list[tuple[str, str, str, str]]:
    """(metric, base, trained, win rate) rows of the report's comparison table."""
    rows = []
    for name, stats in report["metrics"].items():
        title = score_title(report) if name == SCORE else METRIC_TITLES.get(name, name)
        if name == GOLD and report.get("gold"):
            title = f"gold score ({report['gold']})"
        win = report["win_rate"].get(name)
        rows.append((title, _fmt(stats["base"]), _fmt(stats["trained"]), "" if win is None else f"{win:.3f}"))
    return rows


def markdown(report: dict) -> str:
    """The report as markdown: the comparison table, the gold-vs-KL points and example texts (those it holds)."""
    q = report["queries"]
    lines = [
        f"# Evaluation of `{report['policy'] or 'checkpoints'}` against `{report['base_model']}`",
        "",
        f"{q['num']} queries of `{q['dataset']}` (split {q['split']}, data_seed {q['data_seed']}, from query "
        f"{q['skip']}; held out from training: {q['held_out']}), sampled with seed {report['seed']} at temperature "
        f"{report['task']['temperature']}. Mean ± standard error over queries; win rate = fraction of queries where "
        "the trained policy's response scores higher than the base model's (ties count 1/2).",
    ]
    lines += [line for warning in report.get("warnings", []) for line in ("", f"**Warning:** {warning}")]
    if note := normalization_note(report):
        lines += ["", note]
    if report.get("metrics"):
        lines += ["", "| metric | base | trained | win rate (trained > base) |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in metric_rows(report)]
    if report.get("curve"):
        lines += ["", "## Gold score vs KL", "", "| run | policy | sqrt(KL) | KL | score | gold score |"]
        lines += ["|---|---|---|---|---|---|"]
        for p in report["curve"]:
            gold = _fmt(p[GOLD]) if GOLD in p else ""
            sqrt_kl = math.sqrt(max(p[KL]["mean"], 0.0))
            lines.append(f"| {p['run']} | {p['policy']} | {sqrt_kl:.3f} | {_fmt(p[KL])} | {_fmt(p[SCORE])} | {gold} |")
    if report.get("examples"):
        judged = [k for k in JUDGES if k in report["examples"][0]["base"]]
        short = [{SCORE: "score", GOLD: "gold"}[k] for k in judged]
        header = ["query", "base", *short, "trained", *short]
        lines += ["", "## Examples", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for e in report["examples"]:
            cells = [_cell(e["query"])]
            for side in ("base", "trained"):
                cells += [_cell(e[side]["response"]), *(f"{e[side][k]:+.3f}" for k in judged)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def print_report(console: Console, report: dict) -> None:
    """The comparison table (and the gold-vs-KL points) on the console."""
    if report.get("metrics"):
        table = Table(title=f"{report['queries']['num']} queries: base vs trained", title_justify="left")
        for column in ("metric", "base", "trained", "win rate (trained > base)"):
            table.add_column(column)
        for row in metric_rows(report):
            table.add_row(*row)
        console.print(table)
    if note := normalization_note(report):
        console.print(note)
    for warning in report.get("warnings", []):
        console.print(f"warning: {warning}", style="bold yellow", markup=False)
    if report.get("curve"):
        curve = Table(title="gold score vs KL", title_justify="left")
        for column in ("run", "policy", "sqrt(KL)", "score", "gold score"):
            curve.add_column(column)
        for p in report["curve"]:
            gold = _fmt(p[GOLD]) if GOLD in p else ""
            curve.add_row(p["run"], p["policy"], f"{math.sqrt(max(p[KL]['mean'], 0.0)):.3f}", _fmt(p[SCORE]), gold)
        console.print(curve)


FINAL_POLICY = "final"
"""name of the evaluated policy's own point in a gold-vs-KL curve (its checkpoints are named update<N>)"""
_LABEL_OFFSETS = [(6, 4), (6, -12), (-6, 4), (-6, -12), (8, -4), (-8, -4), (6, 14), (6, -22), (-6, 14), (-6, -22)]
"""where a point's label may go, in points from the point, tried in order until it overlaps no other label"""


def point_label(name: str) -> str:
    """A point's label on the plot: the number of updates for a checkpoint named update<N>, else its name."""
    return name[len("update") :] if name.startswith("update") and name[len("update") :].isdigit() else name


def place_labels(ax, xs, ys, errors, labels) -> list:
    """Annotate each point with its label at the first offset whose text overlaps no marker, no error bar and no label
    placed before it."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    lows = ax.transData.transform(np.column_stack([xs, np.subtract(ys, errors)]))
    highs = ax.transData.transform(np.column_stack([xs, np.add(ys, errors)]))
    boxes = [Bbox.from_extents(lo[0] - 5, lo[1] - 5, hi[0] + 5, hi[1] + 5) for lo, hi in zip(lows, highs)]
    placed = []
    for x, y, label in zip(xs, ys, labels):
        for dx, dy in _LABEL_OFFSETS:
            ha = "left" if dx >= 0 else "right"
            text = ax.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=7, ha=ha)
            box = text.get_window_extent(renderer).expanded(1.05, 1.1)
            if not any(box.overlaps(other) for other in boxes) or (dx, dy) == _LABEL_OFFSETS[-1]:
                break
            text.remove()
        placed.append(text)
        boxes.append(box)
    return placed


def gold_vs_kl_figure(points: list[dict], title: str, score_label: str = METRIC_TITLES[SCORE]):
    """The gold-vs-KL figure: one panel per judge, one line per run, each point labelled, error bars explained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # sqrt(KL) on the x-axis, as in the reward over-optimisation literature (Gao et al. 2022, arXiv:2210.10760)
    wrap = " " if len(score_label) < 25 else "\n"  # a programmatic reward's longer name
    proxy = f"{score_label}{wrap}(the proxy PPO maximises)"
    panels = [(SCORE, proxy), (GOLD, "gold score (never trained on)")]
    panels = [(key, label) for key, label in panels if all(key in p for p in points)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    base = [p for p in points if p["run"] == BASE_RUN]
    runs = list(dict.fromkeys(p["run"] for p in points if p["run"] != BASE_RUN))
    labelled = base + [p for p in points if p["run"] != BASE_RUN]  # every point once
    for ax, (key, label) in zip(axes[0], panels):
        for run in runs:
            line = base + [p for p in points if p["run"] == run]
            x = np.sqrt(np.maximum([p[KL]["mean"] for p in line], 0.0))
            y = [p[key]["mean"] for p in line]
            ax.errorbar(x, y, yerr=[p[key]["stderr"] for p in line], marker="o", capsize=3, label=f"run {run}")
        fig.canvas.draw()
        place_labels(
            ax,
            np.sqrt(np.maximum([p[KL]["mean"] for p in labelled], 0.0)),
            [p[key]["mean"] for p in labelled],
            [p[key]["stderr"] for p in labelled],
            ["base" if p["run"] == BASE_RUN else point_label(p["policy"]) for p in labelled],
        )
        ax.set_xlabel("sqrt(KL(policy || base)), sqrt(nats)")
        ax.set_ylabel("mean over the queries; bars: ± 1 standard error")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="point labels: PPO updates done", title_fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_gold_vs_kl(points: list[dict], path: str, title: str, score_label: str = METRIC_TITLES[SCORE]) -> None:
    """Gold and proxy score (titled `score_label`) against sqrt(KL to the base model), one line per run (PNG via
    matplotlib Agg).

    A point of run BASE_RUN (the base model, KL 0) starts every run's line; a line joins its points in the order
    given (training order for checkpoints named by update), so a KL that falls back shows as the line turning back.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the gold-vs-KL plot needs matplotlib: pip install matplotlib") from e
    fig = gold_vs_kl_figure(points, title, score_label)
    tmp = f"{path}.tmp.png"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
