"""Speed tricks, each equal to a plain formula that its docstring gives (and a test checks, values and gradients).

A reader can skip this file: the scripts would compute the same numbers with the plain formulas, only slower or with
more memory.
"""

import torch


def _exp_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """max, exp(z - max) and sum(exp(z - max)) over the last axis (keepdim); exp(z - max) is the one (..., V) tensor."""
    maxes = logits.amax(dim=-1, keepdim=True)
    exps = (logits - maxes).exp_()
    return maxes, exps, exps.sum(dim=-1, keepdim=True)


ENTROPY_CHUNK = 4096
"""vocabulary columns per step of the entropy's sum: one (..., 4096) buffer instead of a second (..., V) tensor"""


def _entropy_from_exp_stats(
    logits: torch.Tensor, maxes: torch.Tensor, exps: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """logsumexp(z) - sum(softmax(z) * z) = log(total) - sum(exps * (z - max)) / total, keepdim.

    The sum runs over z - max <= 0, so nothing cancels against max (float32 logits near -100 lose 2e-5 to it in the
    plain formula), with torch's pairwise sum (a (1 x V) @ (V x 1) dot accumulates 10x the rounding error of the plain
    formula); chunks of ENTROPY_CHUNK columns keep the memory to one small buffer.
    """
    shifted_sum = torch.zeros_like(total)
    buffer = logits.new_empty((*logits.shape[:-1], min(ENTROPY_CHUNK, logits.shape[-1])))
    for start in range(0, logits.shape[-1], ENTROPY_CHUNK):
        chunk = slice(start, start + ENTROPY_CHUNK)
        products = buffer[..., : exps[..., chunk].shape[-1]]
        torch.sub(logits[..., chunk], maxes, out=products).mul_(exps[..., chunk])
        shifted_sum += products.sum(dim=-1, keepdim=True)
    return total.log() - shifted_sum / total


class _TokenLogprob(torch.autograd.Function):
    """log softmax(z)[token] = (z[token] - max) - log(sum(exp(z - max))) and, optionally, the (non-differentiable)
    entropy, from one (..., V) buffer; the backward allocates one more, the gradient."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        maxes, exps, total = _exp_stats(logits)
        logprobs = logits.gather(-1, tokens.unsqueeze(-1)) - maxes - total.log()  # (..., 1)
        entropy = None
        if with_entropy:
            entropy = _entropy_from_exp_stats(logits, maxes, exps, total).squeeze(-1)
            ctx.mark_non_differentiable(entropy)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(exps.div_(total), tokens)  # softmax(z)
        return logprobs.squeeze(-1), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor, grad_entropy: None) -> tuple[torch.Tensor, None, None]:
        # d logp[token] / dz = onehot(token) - softmax(z); the saved softmax stays intact for retained graphs
        probs, tokens = ctx.saved_tensors
        grad = grad.unsqueeze(-1)  # (..., 1)
        return (probs * -grad).scatter_add_(-1, tokens.unsqueeze(-1), grad), None, None


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Plain formula: `log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]`, for logits (..., V).

    Equal in value and gradient, without materializing the (..., V) log-softmax.
    """
    # gather(logits) - logsumexp(logits), computed as (z - max)[token] - log(sum(exp(z - max))); one (..., V) tensor
    # is allocated (autograd through gather and logsumexp allocates five, forward and backward)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L295-L296
    return _TokenLogprob.apply(logits, tokens, False)[0]


def logprobs_and_entropy_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` (differentiable) and the entropy (detached) from one pass over the logits.

    Plain formula of the entropy: `logsumexp(z) - (softmax(z) * z).sum(-1)` over the last axis (OAI utils/core.py).
    """
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L290-L292
    logprobs, entropy = _TokenLogprob.apply(logits, tokens, True)
    return logprobs, entropy


def categorical_uniforms(rows: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The (rows, 1) float64 uniforms in [0, 1) of one sampling step, drawn from `generator` (`sample` draws every
    step's before decoding, so that a fixed-shape step draws nothing)."""
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=device)


def sample_categorical(logits: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of (B, V) logits and its log-probability, (B,), (B,), from the row's uniform in `uniform`
    (B, 1) (`categorical_uniforms`): no random draw, so a fixed-shape step can run it.

    Plain formula: `tokens = torch.multinomial(softmax(logits), 1)`, `logprobs = log_softmax(logits).gather(tokens)`.
    Drawn by inverse-CDF sampling instead: one uniform per row (torch.multinomial draws B*V exponentials), and the
    CDF's total gives the logsumexp for the log-prob.
    """
    # tf.random.categorical's kernel samples the same way: exp(logits - max) summed into a CDF in float64, then the
    # first index whose CDF exceeds uniform * total
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (B, V), <= 0
    cdf = shifted.exp().cumsum(dim=-1, dtype=torch.float64)  # (B, V), unnormalised
    total = cdf[:, -1:]  # (B, 1)
    # strictly below the total: the index stays in range and never lands on a probability-0 token (flat CDF step)
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True)  # (B, 1)
    logprobs = shifted.gather(-1, tokens) - total.log().to(shifted.dtype)  # (B, 1)
    return tokens[:, 0], logprobs[:, 0]


def use_fused_gelu(config) -> None:
    """Plain formula: GPT-2's gelu 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) ("gelu_new"); run it fused instead.

    HF's "gelu_new" is seven elementwise ops that each keep a tensor for the backward; "gelu_pytorch_tanh" is PyTorch's
    fused kernel of the same formula, equally accurate (both within 4.4e-7 of float64), 4x faster forward + backward,
    one saved tensor instead of seven (the 124M policy's PPO backward at batch 64 needs ~5 GB less).
    """
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L35-L37
    if getattr(config, "activation_function", None) == "gelu_new":
        config.activation_function = "gelu_pytorch_tanh"
