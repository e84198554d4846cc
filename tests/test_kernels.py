"""kernels.py: every speed trick equals the plain formula its docstring gives, in values and in gradients."""

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lm_human_preference_details.kernels import (
    categorical_uniforms,
    logprobs_and_entropy_from_logits,
    logprobs_from_logits,
    sample_categorical,
    use_fused_gelu,
)
from tests.conftest import tiny_gpt2, tiny_gpt2_config


def plain_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits).gather(tokens): what logprobs_from_logits must equal."""
    return torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]


def plain_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp(z) - sum(softmax(z) * z): OAI's entropy formula."""
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


entropy_from_logits = plain_entropy
"""the plain entropy formula, under the name of OAI's function (utils/core.py#L290)"""


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_logprobs_from_logits_matches_log_softmax_gather(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 50, generator=generator, dtype=dtype)
    tokens = torch.randint(0, 50, (3, 7), generator=generator)
    expected = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    out = logprobs_from_logits(logits, tokens)
    assert out.shape == (3, 7)
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


def test_logprobs_from_logits_gradient_matches_log_softmax_gather():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, 50, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 50, (3, 7), generator=generator)
    weights = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    (grad,) = torch.autograd.grad((logprobs_from_logits(logits, tokens) * weights).sum(), logits)
    expected_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (expected,) = torch.autograd.grad((expected_logprobs * weights).sum(), logits)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    small = logits[:1, :2, :6].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, tokens[:1, :2] % 6), (small,))


def test_logprobs_and_entropy_from_logits_match_separate_functions():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 40, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 40, (2, 5), generator=generator)
    logprobs, entropy = logprobs_and_entropy_from_logits(logits, tokens)
    torch.testing.assert_close(logprobs, logprobs_from_logits(logits, tokens), rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach()), rtol=0, atol=1e-12)
    assert logprobs.requires_grad and not entropy.requires_grad


def test_logprobs_from_logits_leaves_input_unchanged_under_no_grad():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    with torch.no_grad():
        out = logprobs_from_logits(logits, torch.tensor([0, 5, 29, 7]))
    assert torch.equal(logits, before)
    torch.testing.assert_close(out, torch.log_softmax(before, -1)[torch.arange(4), [0, 5, 29, 7]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_entropy_from_logits_matches_definition(dtype, atol):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 50, generator=generator, dtype=dtype)
    logp = torch.log_softmax(logits, dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    out = entropy_from_logits(logits)
    assert out.shape == (3, 7)
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


def test_entropy_from_logits_uniform_is_log_vocab():
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 16)), torch.full((2,), float(np.log(16))))


def test_fused_logprobs_and_entropy_equal_the_plain_formulas_in_values_and_gradients():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=generator, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 64, (3, 5), generator=generator)
    weights = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    fused, entropy = logprobs_and_entropy_from_logits(logits, tokens)
    plain = plain_logprobs(logits, tokens)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, plain_entropy(logits).detach(), rtol=0, atol=1e-12)
    (grad_fused,) = torch.autograd.grad((fused * weights).sum(), logits)
    (grad_plain,) = torch.autograd.grad((plain * weights).sum(), logits)
    torch.testing.assert_close(grad_fused, grad_plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(logprobs_from_logits(logits, tokens), plain, rtol=0, atol=1e-12)


def test_fused_entropy_on_full_vocabulary_float32_logits_is_as_accurate_as_the_plain_formula():
    # GPT-2-like float32 logits over the 50257 tokens (around -100 / temperature 0.7, a few likely tokens), N(0, 1)
    # logits and logits around +50, against a float64 reference. Measured max errors: plain formula 2.7e-5, 1.4e-6,
    # 5.4e-4; this kernel 2.4e-7, 1.0e-6, 1.1e-6; the former (1 x V) @ (V x 1) dot of exps and z 1.1e-4, 1.9e-5, 7.5e-3
    generator = torch.Generator().manual_seed(0)
    shape = (1, 8, 50257)
    peaked = -100 + 4 * torch.randn(shape, generator=generator)
    peaked[..., :50] += 25 * torch.rand((*shape[:-1], 50), generator=generator)
    tokens = torch.zeros(shape[:-1], dtype=torch.long)
    for logits in (
        peaked / 0.7,
        torch.randn(shape, generator=generator),
        50 + 3 * torch.randn(shape, generator=generator),
    ):
        reference = plain_entropy(logits.double())
        plain_error = (plain_entropy(logits).double() - reference).abs().max().item()
        _, entropy = logprobs_and_entropy_from_logits(logits, tokens)
        error = (entropy.double() - reference).abs().max().item()
        assert error <= max(plain_error, 2e-6), (error, plain_error)


def test_inverse_cdf_sampler_draws_like_multinomial_and_returns_plain_logprobs():
    logits = torch.tensor([[0.3, -1.0, 2.0, 0.0, 1.5]]).expand(20000, -1)
    uniforms = categorical_uniforms(logits.shape[0], torch.Generator().manual_seed(1), logits.device)
    tokens, logprobs = sample_categorical(logits, uniforms)
    reference = torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(1))[:, 0]
    ours, theirs = torch.bincount(tokens, minlength=5).double(), torch.bincount(reference, minlength=5).double()
    probs = torch.softmax(logits[0], -1).double()
    sigma = (20000 * probs * (1 - probs)).sqrt()
    assert bool(((ours - theirs).abs() <= 5 * 2**0.5 * sigma).all()), (ours, theirs)
    torch.testing.assert_close(logprobs, plain_logprobs(logits, tokens), rtol=0, atol=1e-6)


def test_fused_gelu_equals_gpt2_gelu_in_values_and_gradients():
    reference = tiny_gpt2(seed=0).double()
    config = tiny_gpt2_config()
    use_fused_gelu(config)
    assert config.activation_function == "gelu_pytorch_tanh"
    torch.manual_seed(0)  # tiny_gpt2's weights, built with the fused activation
    fused = GPT2LMHeadModel(config).eval().double()
    tokens = torch.tensor([[23073, 11, 339, 561], [7091, 1807, 546, 340]])
    out_ref, out_fused = reference(tokens).logits, fused(tokens).logits
    torch.testing.assert_close(out_fused, out_ref, rtol=0, atol=1e-9)
    out_ref.square().sum().backward()
    out_fused.square().sum().backward()
    for (name, a), b in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-9, msg=name)
    untouched = GPT2Config(activation_function="relu")
    use_fused_gelu(untouched)
    assert untouched.activation_function == "relu"


def test_inverse_cdf_sampler_never_draws_a_token_whose_probability_underflows_to_zero():
    # the sampler of every decoding step (modeling.sample) at the uniforms' two ends: float32 exp() of a logit 200
    # below the top is 0, so tokens 0 and 3 have probability 0; a uniform of 0 must not land on token 0 (the CDF's
    # first flat step), and one whose product with the total rounds up to the total (1.0 here) must neither leave
    # the vocabulary nor land on token 3 (its last flat step)
    from lm_human_preference_details.kernels import sample_categorical

    logits = torch.tensor([[-200.0, 0.0, 0.0, -200.0]]).expand(3, -1)
    uniforms = torch.tensor([[0.0], [0.5], [1.0]], dtype=torch.float64)
    tokens, logprobs = sample_categorical(logits, uniforms)
    assert tokens.tolist() == [1, 2, 2]
    torch.testing.assert_close(logprobs, torch.full((3,), -torch.log(torch.tensor(2.0)).item()))
