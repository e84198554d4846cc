"""Unit guards of single OAI details, each against values derived independently (NumPy or closed form)."""

import math

import numpy as np
import pytest
import torch

import train_policy
from lm_human_preference_details import ppo_plumbing
from lm_human_preference_details.optim import make_optimizer
from tests.fidelity import np_whiten


def test_make_optimizer_is_tf1_adam_with_oai_eps():
    # spec O1, O2: the scripts' optimizer is TF1 Adam (eps 1e-5 added after the bias correction, betas 0.9/0.999);
    # at gradients ~1e-6 PyTorch's Adam (eps scaled by sqrt(1 - b2^t)) would step ~3x further
    lr, eps, b1, b2 = 1e-2, 1e-5, 0.9, 0.999
    grads = [1e-6, 3e-6, -2e-6, 1e-6]
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = make_optimizer([param], lr, use_tensorflow_adam=True)
    theta, m, v = 0.0, 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        param.grad = torch.tensor([g], dtype=torch.float64)
        optimizer.step()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        theta -= lr * math.sqrt(1 - b2**t) / (1 - b1**t) * m / (math.sqrt(v) + eps)
        assert param.item() == pytest.approx(theta, rel=1e-9, abs=1e-15), t


def test_ppo_losses_match_numpy_rederivation():
    # spec P8-P11: clipped value loss 0.5 * mean(max(...)), clipped policy loss mean(max(...)), total = pg + 0.1 vf,
    # approxkl = 0.5 * mean(dlogp^2), clip fractions, vpred and error means; on random inputs where every clip occurs
    rng = np.random.RandomState(0)
    shape = (6, 5)
    logprobs, values, returns = rng.randn(*shape), rng.randn(*shape), rng.randn(*shape)
    new_logprobs, vpred = logprobs + 0.4 * rng.randn(*shape), values + 0.5 * rng.randn(*shape)
    advantages = np_whiten(rng.randn(*shape))
    out = train_policy.ppo_losses(
        *map(torch.from_numpy, (new_logprobs, vpred, logprobs, values, advantages, returns)), 0.2, 0.2, 0.1
    )
    vpred_clipped = np.clip(vpred, values - 0.2, values + 0.2)
    vf1, vf2 = (vpred - returns) ** 2, (vpred_clipped - returns) ** 2
    ratio = np.exp(new_logprobs - logprobs)
    pg1, pg2 = -advantages * ratio, -advantages * np.clip(ratio, 0.8, 1.2)
    expected = {
        "loss/value": 0.5 * np.maximum(vf1, vf2).mean(),
        "val/clipfrac": (vf2 > vf1).mean(),
        "loss/policy": np.maximum(pg1, pg2).mean(),
        "policy/clipfrac": (pg2 > pg1).mean(),
        "policy/approxkl": 0.5 * ((new_logprobs - logprobs) ** 2).mean(),
        "val/vpred": vpred.mean(),
        "val/error": vf1.mean(),
    }
    expected["loss/total"] = expected["loss/policy"] + 0.1 * expected["loss/value"]
    assert 0 < expected["val/clipfrac"] < 1 and 0 < expected["policy/clipfrac"] < 1
    for key, value in expected.items():
        assert out[key].item() == pytest.approx(value, rel=1e-6, abs=1e-12), key


def test_sample_table_rows_total_is_score_minus_kl_coef_times_kl(tokenizer):
    # spec P19: (query, truncated response, score, kl, score - kl_coef * kl) for the first n episodes, PADs dropped
    pad = tokenizer.pad_token_id
    queries = torch.tensor([tokenizer.encode(" The cat") + [pad] * 2, tokenizer.encode(" A dog sat down")])
    responses = torch.tensor([tokenizer.encode(" ran off.") + [pad], tokenizer.encode(" ran away home.")])
    rows = ppo_plumbing.sample_table_rows(
        tokenizer, pad, queries, responses, torch.tensor([0.5, -1.0]), torch.tensor([2.0, 4.0]), 0.15, 2
    )
    assert [row[:2] for row in rows] == [[" The cat", " ran off."], [" A dog sat down", " ran away home."]]
    assert [float(row[4]) for row in rows] == pytest.approx([0.5 - 0.15 * 2.0, -1.0 - 0.15 * 4.0])
    assert [float(row[3]) for row in rows] == pytest.approx([2.0, 4.0])


def test_adaptive_kl_defaults_are_oai_on_settings():
    # spec H1, P14: rewards.adaptive_kl='on' builds horizon 10000; launch.py sets target 6 and kl_coef 0.15
    args = train_policy.Args()
    assert args.rewards.adaptive_kl.enabled
    assert (args.rewards.adaptive_kl.target, args.rewards.adaptive_kl.horizon, args.rewards.kl_coef) == (
        6.0,
        10000,
        0.15,
    )
