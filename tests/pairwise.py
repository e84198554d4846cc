"""A covering array of pairs: rows of factor values in which every pair of values of two factors occurs at least once
(pairwise or 2-way testing), built greedily and deterministically; pairs that the project refuses are never put in a
covering row (each is tested as a refusal of its own).

The greedy rule: each new row starts from the value that occurs in the most uncovered pairs (the first such in the
factors' and values' listed order), then gives every other factor, in a fill order, the value that covers the most
uncovered pairs with the values already chosen (the first such value on a tie), skipping values that would form a
refused pair; of the rows that each rotation of the factors' order fills, the one covering the most pairs is kept.
Rows are added until every allowed pair is covered; nothing is random, so the same factors give the same rows.
"""

import itertools
from collections.abc import Mapping, Sequence

Pair = tuple[tuple[str, object], tuple[str, object]]
"""((factor, value), (factor, value)), the two factors in their listed order"""


def pair(a: tuple[str, object], b: tuple[str, object], order: Sequence[str]) -> Pair:
    """The pair of two (factor, value)s with its factors in `order`'s order."""
    return (a, b) if order.index(a[0]) < order.index(b[0]) else (b, a)


def all_pairs(factors: Mapping[str, Sequence]) -> list[Pair]:
    """Every pair of values of two different factors, in the factors' and values' listed order."""
    names = list(factors)
    return [
        ((f, u), (g, v))
        for f, g in itertools.combinations(names, 2)
        for u, v in itertools.product(factors[f], factors[g])
    ]


def row_pairs(row: Mapping[str, object], order: Sequence[str]) -> set[Pair]:
    """The pairs a full or partial row holds."""
    chosen = [(name, row[name]) for name in order if name in row]
    return {pair(a, b, order) for a, b in itertools.combinations(chosen, 2)}


def covering_rows(factors: Mapping[str, Sequence], refused: set[Pair] = frozenset()) -> list[dict[str, object]]:
    """Rows (factor -> value) that cover every pair of `factors`' values except the `refused` ones, and hold none of
    those. ValueError when a refused pair names a factor or value that `factors` lacks."""
    order = list(factors)
    pairs = all_pairs(factors)
    unknown = refused - set(pairs)
    if unknown:
        raise ValueError(f"refused pairs of unknown factors or values: {sorted(map(str, unknown))}")
    uncovered = [p for p in pairs if p not in refused]
    rows = []
    while uncovered:
        # one candidate row per rotation of the factors' order; the one that covers the most pairs is kept
        candidates = [_greedy_row(factors, order[i:] + order[:i], uncovered, refused) for i in range(len(order))]
        row = max(candidates, key=lambda r: len(row_pairs(r, order) & set(uncovered)))
        held = row_pairs(row, order)
        uncovered = [p for p in uncovered if p not in held]
        rows.append(row)
    return rows


def _greedy_row(
    factors: Mapping[str, Sequence], fill_order: Sequence[str], uncovered: list[Pair], refused: set[Pair]
) -> dict[str, object]:
    """A row that starts from the value in the most uncovered pairs, then gives each factor in `fill_order` the value
    that covers the most uncovered pairs with those chosen before it (the first on a tie), never a refused pair."""
    order = list(factors)
    counts: dict[tuple[str, object], int] = {}
    for a, b in uncovered:
        counts[a] = counts.get(a, 0) + 1
        counts[b] = counts.get(b, 0) + 1
    seed = max(counts, key=counts.get)
    row = {seed[0]: seed[1]}
    open_pairs = set(uncovered)
    for name in fill_order:
        if name in row:
            continue
        best, best_gain = None, -1
        for value in factors[name]:
            new = {pair((name, value), (other, row[other]), order) for other in row}
            if new & refused:
                continue
            gain = len(new & open_pairs)
            if gain > best_gain:
                best, best_gain = value, gain
        if best_gain < 0:
            raise ValueError(f"no value of {name} fits a row with {row} without a refused pair")
        row[name] = best
    return {name: row[name] for name in order}
