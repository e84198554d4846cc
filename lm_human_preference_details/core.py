"""Whitening of rewards and advantages (spec P5, P6), per group of rows standing for OAI's ranks (spec D4)."""

import torch


def whiten(values: torch.Tensor, shift_mean: bool = True, group_size: int | None = None) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over all elements of each group of `group_size` rows (None: one group of all rows).

    The mean is added back when shift_mean is False. Groups stand for OAI's ranks when fewer processes run the same
    batch ("virtual ranks", spec D4): OAI whitens each rank's tensor on its own.
    """
    # TF-PARITY: tf.nn.moments gives the population variance (divide by N, not N - 1)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L336-L341
    groups = values.reshape(-1, group_size or values.shape[0], *values.shape[1:])  # (G, group_size, ...)
    dims = tuple(range(1, groups.dim()))
    var, mean = torch.var_mean(groups, dim=dims, correction=0, keepdim=True)
    whitened = (groups - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.reshape(values.shape)
