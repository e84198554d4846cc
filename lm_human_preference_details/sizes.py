"""Size arithmetic as OAI does it: a division that must be exact names the sizes that do not divide."""


def exact_div(a: int, b: int, what: str) -> int:
    """a // b, raising ValueError when b does not divide a (OAI derives every per-rank size this way)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L116-L124
    if b == 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}; choose sizes so that {a} is a multiple of {b}.")
    return a // b


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L127-L128
    return -(-a // b)
