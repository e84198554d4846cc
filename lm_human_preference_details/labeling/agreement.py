"""Agreement between human labelers: the figures used to screen them (as OAI and InstructGPT did).

Labels are compared as categories: the chosen response's index (best_of_N), the rating (scalar_rating) or the
comparison (scalar_compare). Rows labelled by one person only do not enter any agreement figure.
- pairwise agreement of two labelers: the share of the rows both labelled on which they gave the same label;
- Cohen's kappa of two labelers: (p_o - p_e) / (1 - p_e), p_o their agreement, p_e the agreement expected by chance
  from each one's label frequencies on those rows (None when p_e = 1);
- Fleiss' kappa over the rows labelled by two or more people (Fleiss 1971):
  P_i = (sum_k n_ik^2 - n_i) / (n_i (n_i - 1)), P = mean P_i, p_k = sum_i n_ik / sum_i n_i, P_e = sum_k p_k^2,
  kappa = (P - P_e) / (1 - P_e). Fleiss defined it for a fixed number of raters per row; with n_i varying, this is the
  generalisation that keeps both formulas with each row's own n_i: every row weighs the same in P, and chance agreement
  comes from the pooled label counts (Gwet's generalisation instead averages each row's label shares for p_k);
- Krippendorff's alpha for nominal data (Krippendorff 2011, "Computing Krippendorff's alpha-reliability"), made for a
  varying number of raters per row: from the coincidence matrix o_ck = sum_u n_uc n_uk / (m_u - 1) (c != k; m_u the
  row's labels), alpha = 1 - D_o / D_e with D_o = sum_{c!=k} o_ck / n and D_e = sum_{c!=k} n_c n_k / (n (n - 1)):
  rows weigh by their number of labels, and chance has the small-sample correction n - 1;
- agreement with the majority: per labeler, the share of their rows (labelled by others too) on which their label
  equals the majority of the *other* labelers (labelstore.MAJORITY_RULE; leaving them out avoids counting them twice).
"""

from collections import Counter

from lm_human_preference_details.labeling.labelstore import Judgement


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


def krippendorff_alpha(rows: list[list]) -> float | None:
    """Krippendorff's alpha for nominal data of rows with any number of labels (rows with one label do not count);
    None when there are no pairable labels or every label is the same value (no expected disagreement)."""
    observed = 0.0  # sum over rows of the disagreeing ordered pairs / (m_u - 1): the off-diagonal coincidences
    totals: Counter = Counter()
    for labels in rows:
        m = len(labels)
        if m < 2:
            continue
        counts = Counter(labels)
        observed += (m * m - sum(c * c for c in counts.values())) / (m - 1)
        totals.update(counts)
    n = sum(totals.values())
    expected = (n * n - sum(c * c for c in totals.values())) / (n - 1) if n > 1 else 0.0
    return None if expected == 0 else 1.0 - observed / expected


def _others_majority(judgements: list[Judgement]) -> dict[str, int | float]:
    """Per labeler of one row, the majority label of the row's *other* labelers (labelstore.MAJORITY_RULE), in time
    linear in the row's labelers: leaving one labeler out only changes the count (and first seq) of their label."""
    counts: Counter = Counter(j.label for j in judgements)
    firsts: dict = {}  # label -> its two earliest seqs
    for j in sorted(judgements, key=lambda j: j.seq):
        seqs = firsts.setdefault(j.label, [])
        if len(seqs) < 2:
            seqs.append(j.seq)
    out = {}
    for j in judgements:
        best = None
        for label, count in counts.items():
            first = firsts[label][0]
            if label == j.label:
                count -= 1
                first = firsts[label][1] if first == j.seq and count else first
            if count and (best is None or (count, -first) > best[0]):
                best = ((count, -first), label)
        out[j.labeler] = best[1]
    return out


def pairwise_agreement(shared: dict[int, list[Judgement]]) -> list[dict]:
    """Agreement and Cohen's kappa of every two labelers who labelled a row in common, ordered by their names; time
    proportional to the sum over rows of (labelers of the row)^2."""
    common: dict[tuple[str, str], tuple[list, list]] = {}
    for row in sorted(shared):
        js = sorted(shared[row], key=lambda j: j.labeler)
        for i, a in enumerate(js):
            for b in js[i + 1 :]:
                la, lb = common.setdefault((a.labeler, b.labeler), ([], []))
                la.append(a.label)
                lb.append(b.label)
    return [
        {
            "labelers": list(names),
            "rows": len(la),
            "agreement": sum(x == y for x, y in zip(la, lb)) / len(la),
            "cohen_kappa": cohen_kappa(la, lb),
        }
        for names, (la, lb) in sorted(common.items())
    ]


def agreement_report(
    judgements: list[Judgement], skips: dict[str, int] | None = None, max_pair_labelers: int | None = None
) -> dict:
    """Per-labeler counts, pairwise agreement and Cohen's kappa, Fleiss' kappa, Krippendorff's alpha, agreement with
    the majority. Time linear in the judgements, except the pairs (quadratic in the labelers of a row): they are left
    out (`pairs_left_out` says why) when more than `max_pair_labelers` labelers labelled shared rows."""
    skips = skips or {}
    rows = _by_row(judgements)
    shared = {row: js for row, js in rows.items() if len(js) >= 2}  # one judgement per labeler and row
    names = sorted({j.labeler for j in judgements} | set(skips))
    label_counts = Counter(j.labeler for j in judgements)
    shared_counts = Counter(j.labeler for js in shared.values() for j in js)
    labelers = {
        name: {"labels": label_counts[name], "skipped": skips.get(name, 0), "shared_rows": shared_counts[name]}
        for name in names
    }
    hits: dict[str, list[bool]] = {}
    for js in shared.values():
        majority = _others_majority(js)
        for j in js:
            hits.setdefault(j.labeler, []).append(j.label == majority[j.labeler])
    with_majority = {
        name: {"rows": len(h), "agreement": sum(h) / len(h) if h else None}
        for name in names
        for h in [hits.get(name, [])]
    }
    pair_labelers = len(shared_counts)
    left_out = max_pair_labelers is not None and pair_labelers > max_pair_labelers
    shared_labels = [[j.label for j in js] for js in shared.values()]
    return {
        "labelers": labelers,
        "rows_labelled": len(rows),
        "shared_rows": len(shared),
        "pairs": [] if left_out else pairwise_agreement(shared),
        "pairs_left_out": (
            f"{pair_labelers} labelers share rows, {pair_labelers * (pair_labelers - 1) // 2} pairs: the pairs are "
            f"listed up to {max_pair_labelers} labelers; `label_generation.py agreement` lists them all"
            if left_out
            else None
        ),
        "fleiss_kappa": fleiss_kappa(shared_labels),
        "krippendorff_alpha": krippendorff_alpha(shared_labels),
        "majority_agreement": with_majority,
    }


def format_figure(value: float | None) -> str:
    """A figure with 3 decimals, or 'n/a' when undefined."""
    return "n/a" if value is None else f"{value:.3f}"
