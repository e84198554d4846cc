"""Agreement between human labelers: the figures used to screen them (as OAI and InstructGPT did).

Labels are compared as categories: the chosen response's index (best_of_N), the rating (scalar_rating) or the
comparison (scalar_compare). Rows labelled by one person only do not enter any agreement figure.
- pairwise agreement of two labelers: the share of the rows both labelled on which they gave the same label;
- Cohen's kappa of two labelers: (p_o - p_e) / (1 - p_e), p_o their agreement, p_e the agreement expected by chance
  from each one's label frequencies on those rows (None when p_e = 1);
- Fleiss' kappa over the rows labelled by two or more people (any number of raters per row, Fleiss 1971):
  P_i = (sum_k n_ik^2 - n_i) / (n_i (n_i - 1)), P = mean P_i, p_k = sum_i n_ik / sum_i n_i, P_e = sum_k p_k^2,
  kappa = (P - P_e) / (1 - P_e);
- agreement with the majority: per labeler, the share of their rows (labelled by others too) on which their label
  equals the majority of the *other* labelers (labelstore.MAJORITY_RULE; leaving them out avoids counting them twice).
"""

from collections import Counter
from itertools import combinations

from lm_human_preference_details.labelstore import Judgement, majority_label


def _by_row(judgements: list[Judgement]) -> dict[int, list[Judgement]]:
    """Judgements grouped by row."""
    rows: dict[int, list[Judgement]] = {}
    for j in judgements:
        rows.setdefault(j.row, []).append(j)
    return rows


def cohen_kappa(a: list, b: list) -> float | None:
    """Cohen's kappa of two labelers' labels on the same rows; None when chance agreement is 1 (or no rows)."""
    n = len(a)
    if n == 0:
        return None
    observed = sum(x == y for x, y in zip(a, b)) / n
    count_a, count_b = Counter(a), Counter(b)
    expected = sum(count_a[k] * count_b[k] for k in count_a) / n**2
    return None if expected == 1 else (observed - expected) / (1 - expected)


def fleiss_kappa(rows: list[list]) -> float | None:
    """Fleiss' kappa of rows of labels (each with >= 2 labels); None when there are none or P_e = 1."""
    rows = [labels for labels in rows if len(labels) >= 2]
    if not rows:
        return None
    agreement = []
    totals: Counter = Counter()
    for labels in rows:
        counts = Counter(labels)
        n = len(labels)
        agreement.append((sum(c * c for c in counts.values()) - n) / (n * (n - 1)))
        totals.update(counts)
    total = sum(totals.values())
    expected = sum((c / total) ** 2 for c in totals.values())
    mean = sum(agreement) / len(agreement)
    return None if expected == 1 else (mean - expected) / (1 - expected)


def agreement_report(judgements: list[Judgement], skips: dict[str, int] | None = None) -> dict:
    """Per-labeler counts, pairwise agreement and Cohen's kappa, Fleiss' kappa, agreement with the majority."""
    skips = skips or {}
    rows = _by_row(judgements)
    shared = {row: js for row, js in rows.items() if len({j.labeler for j in js}) >= 2}
    names = sorted({j.labeler for j in judgements} | set(skips))
    labels = {(j.labeler, j.row): j.label for j in judgements}
    labelers = {
        name: {
            "labels": sum(1 for j in judgements if j.labeler == name),
            "skipped": skips.get(name, 0),
            "shared_rows": sum(1 for js in shared.values() if any(j.labeler == name for j in js)),
        }
        for name in names
    }
    pairs = []
    for a, b in combinations(names, 2):
        common = sorted(row for row in shared if (a, row) in labels and (b, row) in labels)
        if not common:
            continue
        la, lb = [labels[a, r] for r in common], [labels[b, r] for r in common]
        pairs.append(
            {
                "labelers": [a, b],
                "rows": len(common),
                "agreement": sum(x == y for x, y in zip(la, lb)) / len(common),
                "cohen_kappa": cohen_kappa(la, lb),
            }
        )
    with_majority = {}
    for name in names:
        hits = [
            labels[name, row] == majority_label([j for j in js if j.labeler != name])
            for row, js in shared.items()
            if (name, row) in labels
        ]
        with_majority[name] = {"rows": len(hits), "agreement": sum(hits) / len(hits) if hits else None}
    return {
        "labelers": labelers,
        "rows_labelled": len(rows),
        "shared_rows": len(shared),
        "pairs": pairs,
        "fleiss_kappa": fleiss_kappa([[j.label for j in js] for js in shared.values()]),
        "majority_agreement": with_majority,
    }


def format_figure(value: float | None) -> str:
    """A figure with 3 decimals, or 'n/a' when undefined."""
    return "n/a" if value is None else f"{value:.3f}"
