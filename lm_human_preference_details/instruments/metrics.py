"""Every name the scripts log: formula, OAI's name and healthy values; the glossary of docs/metrics.md is rendered here.

`python -m lm_human_preference_details.instruments.metrics` prints the glossary; `--write docs/metrics.md` rewrites its
block there.
OAI's names are from train_policy.py#L199-L261 and train_reward.py#L124-L146 (spec §4.1, §4.2); in OAI's public W&B
project every policy tag carries an extra `ppo/` prefix.
"""

import argparse
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    names: tuple[str, ...]
    """logged names sharing this row"""
    script: str
    """who logs them: policy (train_policy.py), reward (train_reward.py) or both"""
    formula: str
    """what the value is (sums over t run over the L response tokens; means over episodes of the global batch)"""
    oai: str
    """OAI's name: the W&B tag of OAI's policy runs, the TensorBoard tag of its reward runs, "" when OAI had none"""
    healthy: str
    """what a healthy run shows"""
    when: str = ""
    """the condition under which the names are logged ("" = always)"""


def _policy(name: str, formula: str, healthy: str, oai: bool = True, when: str = "") -> Metric:
    """A train_policy.py metric; OAI's W&B name is `ppo/` + the name."""
    return Metric((name,), "policy", formula, f"ppo/{name}" if oai else "", healthy, when)


GLOSSARY: tuple[Metric, ...] = (
    # ---------------------------------------------------------------- policy: OAI's statistics (spec §4.1)
    _policy(
        "objective/kl",
        "mean Σ_t (logprob_t − ref_logprob_t), both at the sampling temperature",
        "≈ 0 at the first update (the policy is the reference), then rises to the adaptive controller's target "
        "(6 nats for sentiment/descriptiveness) and stays near it",
    ),
    _policy(
        "objective/kl_coef",
        "β of this update's rewards",
        "adaptive: changes by at most ±20%·batch_size/horizon per update (±1% for the books tasks), falling while "
        "objective/kl is below the target; fixed for tldr/cnndm",
    ),
    _policy(
        "objective/entropy",
        "mean Σ_t −logprob_t of the sampled tokens",
        "falls slowly; a fast fall towards 0 means the policy collapses onto few responses",
    ),
    _policy(
        "objective/score",
        "mean reward-model score, −1 (penalty_reward_value) for responses that fail the filter",
        "at first near 0 (the reward is normalized to mean 0 on the pretrained policy's samples), lowered by the "
        "penalties; then rises",
    ),
    _policy(
        "objective/score_total",
        "objective/score + mean Σ_t −β·(logprob_t − ref_logprob_t)",
        "rises: this is the return PPO maximizes",
    ),
    _policy(
        "objective/gold_score",
        "mean score of the held-out judge on the same truncated responses; never trains the policy",
        "rises with objective/score; falling while objective/score still rises is reward over-optimization",
        oai=False,
        when="--rewards.gold_model",
    ),
    _policy(
        "ppo/loss/policy",
        "mean_t max(−A·ratio, −A·clip(ratio, 1 ± cliprange)), ratio = exp(logprob − old_logprob)",
        "small and near 0 (advantages are whitened), usually slightly negative",
    ),
    _policy(
        "ppo/loss/value",
        "0.5·mean_t max((vpred − R)², (clip(vpred, V ± cliprange_value) − R)²)",
        "largest at first (the value head starts at 0), then falls",
    ),
    _policy("ppo/loss/total", "ppo/loss/policy + vf_coef·ppo/loss/value", "follows ppo/loss/value"),
    _policy(
        "ppo/policy/entropy",
        "mean entropy of the full tempered next-token distribution",
        "falls slowly, like objective/entropy",
    ),
    _policy(
        "ppo/policy/approxkl",
        "0.5·mean_t (logprob − old_logprob)²",
        "0 in the first minibatch and small over the update; a steady rise means too large steps (lower the lr)",
    ),
    _policy(
        "ppo/policy/clipfrac",
        "fraction of tokens where the clipped policy term is the larger",
        "small; large fractions mean too large steps",
    ),
    _policy("ppo/returns/mean", "mean of the returns R = A + V", "follows the score"),
    _policy("ppo/returns/var", "population variance of the returns", "> 0"),
    _policy("ppo/val/vpred", "mean value prediction of the PPO forward", "tracks ppo/returns/mean"),
    _policy("ppo/val/error", "mean_t (vpred − R)²", "falls as the value head learns"),
    _policy(
        "ppo/val/clipfrac",
        "fraction of tokens where the clipped value loss is the larger",
        "falls as the value head settles",
    ),
    _policy("ppo/val/mean", "mean of the rollout values V", "tracks ppo/returns/mean"),
    _policy("ppo/val/var", "population variance of the rollout values", "0 at first (zero-initialised head)"),
    _policy(
        "ppo/val/var_explained",
        "1 − ppo/val/error / ppo/returns/var",
        "near or below 0 at first (the value head starts at 0), then rises towards 1",
    ),
    _policy("elapsed/updates", "update + 1", "counts 1, 2, 3, ..."),
    _policy("elapsed/steps/serial", "(update + 1)·response_length", "counter"),
    _policy("elapsed/steps/total", "(update + 1)·batch_size·response_length", "counter"),
    _policy("elapsed/episodes", "(update + 1)·batch_size", "counter; plot against it to overlay OAI's runs"),
    _policy("elapsed/fps", "int(batch_size·response_length / seconds since the previous update)", "steady"),
    _policy("elapsed/time", "seconds since the start", "grows linearly"),
    # ---------------------------------------------------------------- policy: diagnostics OAI did not log
    Metric(
        ("debug/ratio_mean", "debug/ratio_min", "debug/ratio_max"),
        "policy",
        "PPO probability ratio exp(logprob − old_logprob) over all minibatch steps: mean; min and max over processes",
        "",
        "mean ≈ 1; min and max far outside 1 ± cliprange mean too large steps",
    ),
    _policy(
        "debug/first_minibatch_ratio_max_abs_dev",
        "max |ratio − 1| in the first minibatch of the update",
        "≈ 0 (float rounding, < 1e-4): rollout and training forwards agree; larger values are a bug",
        oai=False,
    ),
    _policy(
        "debug/num_eos",
        "mean number of EOS tokens per response",
        "task dependent; sampling never stops at EOS",
        oai=False,
    ),
    _policy(
        "debug/filter_pass_rate",
        "fraction of responses that pass the filter (truncate_token at index ≥ truncate_after)",
        "stays high or rises; a fall means the penalty dominates the score",
        oai=False,
    ),
    Metric(
        ("debug/time/rollout", "debug/time/scoring", "debug/time/optimisation"),
        "policy",
        "seconds of each phase of the update (sampling + reference forward; scoring + rewards; PPO epochs)",
        "",
        "steady; optimisation usually dominates",
    ),
    Metric(
        ("debug/lr",),
        "both",
        "learning rate of the update (policy: lr·(1 − update/nupdates)) or step (reward: lr·(1 − start/num_train))",
        "",
        "falls linearly towards 0",
    ),
    Metric(
        ("samples",),
        "policy",
        "table of the first print_samples episodes every log_interval updates: query, truncated response, score, "
        "kl, score − β₀·kl",
        "",
        "responses read better as the score rises",
    ),
    # ---------------------------------------------------------------- reward model (spec §4.2 and R4)
    Metric(
        ("train_reward/minibatch/loss", "train_reward/minibatch/error"),
        "reward",
        "mean over the step's labels of the label type's loss: −log softmax(r_0..r_{N−1})[best] (best-of-N), "
        "(score − r)² (scalar_rating) or (difference − (r_1 − r_0))² (scalar_compare); loss and error are the same",
        "train_reward/minibatch/loss, train_reward/minibatch/error",
        "best-of-4: at or above ln 4 ≈ 1.39 (chance) at first, then falls below it; scalar types: falls",
    ),
    Metric(
        ("train_reward/minibatch/label_mean", "train_reward/minibatch/label_var", "train_reward/minibatch/corr"),
        "reward",
        "the step's scores: mean, population variance, and the Pearson correlation of score and reward",
        "train_reward/minibatch/label_mean, train_reward/minibatch/label_var, train_reward/minibatch/corr",
        "corr rises from ≈ 0 towards 1",
        "--labels.type scalar_rating",
    ),
    Metric(
        ("debug/accuracy",),
        "reward",
        "fraction of the step's labels whose best sample gets the highest reward",
        "",
        "starts near 0.25 (chance for best-of-4) and rises",
        "--labels.type best_of_N",
    ),
    Metric(
        ("eval/loss",),
        "reward",
        "the label type's loss on the label rows after num_train (held out), before and after training",
        "",
        "lower after training",
        "the label file has rows after num_train",
    ),
    Metric(
        ("eval/accuracy",),
        "reward",
        "best-of-N accuracy on the held-out label rows, before and after training",
        "",
        "well above chance after training, close to debug/accuracy",
        "--labels.type best_of_N and rows after num_train",
    ),
    Metric(
        tuple(
            f"normalize_{when}/{key}"
            for when in ("before", "after")
            for key in ("mean", "std", "target_mean", "target_std", "gain", "bias")
        ),
        "reward",
        "mean and population std of the rewards of pretrained-policy samples measured before normalizing; the "
        "target: 0 and 1, or before training the scale of the labels (mean and population std of scalar_rating "
        "scores, of scalar_compare differences / 2); the new gain = target_std / std, bias = target_mean − gain·mean",
        "",
        "std > 0 and finite; after normalization fresh samples score the target mean and std",
        "--normalize_before / --normalize_after",
    ),
    Metric(
        tuple(f"normalize_{when}/{key}" for when in ("before", "after") for key in ("debug_mean", "debug_std")),
        "reward",
        "mean and population std of the rewards of debug_normalize fresh samples under the new gain and bias (OAI "
        "prints them as 'after normalize')",
        "",
        "close to the target mean and std",
        "--debug_normalize N > 0",
    ),
    Metric(
        ("normalize_before/samples", "normalize_after/samples"),
        "reward",
        "number of samples: ceil(normalize_samples / rollout_batch_size)·rollout_batch_size",
        "",
        "as configured",
        "--normalize_before / --normalize_after",
    ),
)

GLOSSARY_DOC = "docs/metrics.md"
"""The page that shows the glossary, relative to the repository root."""
GLOSSARY_START = (
    "<!-- metrics glossary: generated by "
    f"`python -m lm_human_preference_details.instruments.metrics --write {GLOSSARY_DOC}` -->"
)
GLOSSARY_END = "<!-- end of metrics glossary -->"


def glossary_names(script: str | None = None) -> set[str]:
    """Every name of the glossary, or only those `script` logs ("policy" or "reward"; "both" counts for each)."""
    return {name for metric in GLOSSARY if script is None or metric.script in (script, "both") for name in metric.names}


def render_glossary() -> str:
    """The glossary as a markdown table."""
    lines = [
        "| name | script | formula | OAI's name | healthy values |",
        "|---|---|---|---|---|",
    ]
    for metric in GLOSSARY:
        names = ", ".join(f"`{name}`" for name in metric.names)
        when = f" (only with {metric.when})" if metric.when else ""
        oai = ", ".join(f"`{name}`" for name in metric.oai.split(", ")) if metric.oai else "—"
        cells = [names + when, metric.script, metric.formula, oai, metric.healthy]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _block_span(page_text: str) -> re.Match:
    """The glossary block of a page, markers included (ValueError when they are missing)."""
    match = re.search(re.escape(GLOSSARY_START) + r"(.*?)" + re.escape(GLOSSARY_END), page_text, re.DOTALL)
    if match is None:
        raise ValueError(f"the page lacks the metrics glossary markers {GLOSSARY_START!r} ... {GLOSSARY_END!r}")
    return match


def glossary_block(page_text: str) -> str:
    """The text between the glossary markers of a page."""
    return _block_span(page_text).group(1).strip("\n")


def write_glossary(path: str) -> None:
    """Replace the glossary block of the page at `path` with the rendered glossary."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    span = _block_span(text).span()
    block = f"{GLOSSARY_START}\n{render_glossary()}\n{GLOSSARY_END}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[: span[0]] + block + text[span[1] :])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help=f"rewrite the glossary block of this page (e.g. {GLOSSARY_DOC}), not print it")
    cli_args = parser.parse_args()
    if cli_args.write:
        write_glossary(cli_args.write)
    else:
        print(render_glossary())
