"""TF32's numeric effect, emulated on CPU: what `--tf32` does to one GEMM, to the first minibatch's PPO ratio, and to
the log-probs against a float32 run.

    python benchmark/tf32_emulation.py --episodes 8

TF32 tensor cores (NVIDIA Ampere, Hopper) round each float32 input of a matmul to a 10-bit mantissa and accumulate
the products in float32. This script does the same on CPU: every matmul of a GPT-2 124M-shaped random policy (eager
attention, so that its matmuls are Python calls) gets its inputs rounded to nearest at 10 bits. The final layer norm's
scale is raised so that sampled tokens have a log-prob near a trained GPT-2's (about -2 at temperature 0.7).
GPU kernels also differ from CPU ones in accumulation order: the figures bound TF32's rounding, not a GPU run.
"""

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lm_human_preference_details import cli  # noqa: E402
from lm_human_preference_details.kernels import logprobs_from_logits  # noqa: E402
from lm_human_preference_details.modeling import PolicyWithValueHead, sample  # noqa: E402


@dataclass
class Args:
    episodes: int = 8
    """episodes of 64 query and 24 response tokens"""
    logit_scale: float = 6.0
    """factor on the final layer norm's scale (sharper next-token distributions than random init)"""
    temperature: float = 0.7
    """sampling temperature (OAI's books tasks)"""


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 `x` rounded to TF32's 10-bit mantissa (to nearest, ties away from zero); other dtypes unchanged."""
    if x.dtype != torch.float32:
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def emulated_tf32():
    """Every torch.addmm / matmul / bmm / F.linear call rounds its float32 inputs to TF32."""
    addmm, matmul, bmm, linear = torch.addmm, torch.matmul, torch.bmm, F.linear
    torch.addmm = lambda bias, x, w, **kw: addmm(bias, tf32(x), tf32(w), **kw)
    torch.matmul = lambda a, b, **kw: matmul(tf32(a), tf32(b), **kw)
    torch.bmm = lambda a, b, **kw: bmm(tf32(a), tf32(b), **kw)
    F.linear = lambda x, w, b=None: linear(tf32(x), tf32(w), b)
    try:
        yield
    finally:
        torch.addmm, torch.matmul, torch.bmm, F.linear = addmm, matmul, bmm, linear


def main(args: Args) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(512, 768), torch.randn(768, 3072) * 0.02
    exact = a.double() @ b.double()
    with emulated_tf32():
        rounded = torch.matmul(a, b)
    for name, product in (("float32", a @ b), ("TF32", rounded)):
        error = ((product.double() - exact).norm() / exact.norm()).item()
        worst = ((product.double() - exact).abs() / exact.abs().clamp_min(1e-3)).median().item()
        print(f"GEMM 512x768x3072, {name:7s}: relative error {error:.1e} (Frobenius), median per element {worst:.1e}")

    config = GPT2Config(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, attn_pdrop=0, embd_pdrop=0, resid_pdrop=0)
    config._attn_implementation = "eager"
    lm = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        lm.transformer.ln_f.weight.mul_(args.logit_scale)
    policy = PolicyWithValueHead(lm).eval()
    torch.nn.init.normal_(policy.value_head.weight, std=0.05)
    pad_id, context_length, response_length = 50257, 64, 24
    contexts = torch.randint(0, 50257, (args.episodes, context_length), generator=torch.Generator().manual_seed(1))

    def rollout(arithmetic) -> tuple[torch.Tensor, ...]:
        """Sampled responses, the sampler's log-probs, and those of the PPO forward on the same tokens."""
        with arithmetic, torch.no_grad():
            generator = torch.Generator().manual_seed(2)
            responses, logprobs, _ = sample(
                policy, contexts, response_length, args.temperature, pad_id, generator, check_first_token=False
            )
            logits, _ = policy(torch.cat([contexts, responses], 1), context_length, pad_id, args.temperature)
        return responses, logprobs, logprobs_from_logits(logits, responses)

    fp32, tf = rollout(contextlib.nullcontext()), rollout(emulated_tf32())
    print(f"mean log-prob of a sampled token: {fp32[1].mean():.2f}")
    for name, (_, old, new) in (("float32", fp32), ("TF32", tf)):
        deviation = ((new - old).exp() - 1).abs()
        print(f"first minibatch |ratio - 1|, {name:7s}: max {deviation.max():.1e}, mean {deviation.mean():.1e}")
    print(f"responses token for token equal to float32's: {(fp32[0] == tf[0]).float().mean():.2f}")
    with torch.no_grad(), emulated_tf32():
        logits, _ = policy(torch.cat([contexts, fp32[0]], 1), context_length, pad_id, args.temperature)
    shift = logprobs_from_logits(logits, fp32[0]) - fp32[2]
    print(
        f"log-probs of float32's tokens, TF32 - float32: max {shift.abs().max():.1e}, mean {shift.abs().mean():.1e} "
        f"per token, {shift.sum(1).abs().mean():.1e} per episode"
    )


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
