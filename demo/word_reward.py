"""A programmatic reward for train_policy.py: responses score one point per use of a word (docs/rewards.md).

python train_policy.py --rewards.trained_model python:demo/word_reward.py:word_count ...
"""

import re

WORD = "happy"


def word_count(queries: list[str], responses: list[str]) -> list[float]:
    """One float per episode: how often WORD occurs as a whole word in the (truncated) response."""
    pattern = re.compile(rf"\b{re.escape(WORD)}\b", re.IGNORECASE)
    return [float(len(pattern.findall(response))) for response in responses]
