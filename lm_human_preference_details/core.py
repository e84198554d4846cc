"""Small numerics and plumbing shared by the training scripts: sizes, whitening, log-probs, seeding, sync, logging."""

import os
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import wandb
from accelerate import Accelerator
from torch.utils.tensorboard import SummaryWriter



def make_accelerator() -> Accelerator:
    """An Accelerator that also runs several processes on CPUs (gloo) when torchrun/accelerate start them without GPUs."""
    multi_process = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(cpu=multi_process and not torch.cuda.is_available())

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


def whiten(values: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalize by the mean and variance over all elements; keep the mean when shift_mean is False."""
    # TF-PARITY: tf.nn.moments gives the population variance (divide by N, not N - 1)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L336-L341
    var, mean = torch.var_mean(values, correction=0)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _exp_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """max, exp(z - max) and sum(exp(z - max)) over the last axis (keepdim); exp(z - max) is the one (..., V) tensor."""
    maxes = logits.amax(dim=-1, keepdim=True)
    exps = (logits - maxes).exp_()
    return maxes, exps, exps.sum(dim=-1, keepdim=True)


def _entropy_from_exp_stats(
    logits: torch.Tensor, maxes: torch.Tensor, exps: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """logsumexp(z) - sum(softmax(z) * z) = max + log(total) - (exps . z) / total, keepdim."""
    # the sum of products is a batched dot product: no (..., V) product tensor
    expected_logit = (exps.unsqueeze(-2) @ logits.unsqueeze(-1)).squeeze(-1) / total
    return maxes + total.log() - expected_logit


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
    """log softmax(logits)[tokens] for logits (..., V) and tokens (...), without materializing the log-softmax."""
    # gather(logits) - logsumexp(logits), computed as (z - max)[token] - log(sum(exp(z - max))); one (..., V) tensor
    # is allocated (autograd through gather and logsumexp allocates five, forward and backward)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L295-L296
    return _TokenLogprob.apply(logits, tokens, False)[0]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp(z) - sum(softmax(z) * z)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L290-L292
    return _entropy_from_exp_stats(logits, *_exp_stats(logits)).squeeze(-1)


def logprobs_and_entropy_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` (differentiable) and `entropy_from_logits` (detached) from one pass over the logits."""
    logprobs, entropy = _TokenLogprob.apply(logits, tokens, True)
    return logprobs, entropy


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's legacy global RNG and torch (CPU and all GPUs)."""
    # OAI seeds NumPy's global RNG with seed + rank * 100003 (the caller adds the rank offset)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _coalesced(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Run `collective` in place on one flat buffer per dtype, then copy the results back into `tensors`."""
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        group = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in group])
        collective(flat)
        chunks = flat.split([t.numel() for t in group])
        torch._foreach_copy_(group, [chunk.view_as(t) for chunk, t in zip(chunks, group)])


def allreduce_gradients(params: Sequence[torch.nn.Parameter], accelerator: Any) -> None:
    """Average `.grad` over all processes in one all-reduce; parameters without a gradient are skipped.

    Every rank must have gradients for the same parameters (true when all ranks run the same model and loss).
    """
    # OAI averages gradients over MPI ranks (allreduce-sum, then times 1 / size) before the Adam update
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L485-L489
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L626
    world_size = accelerator.num_processes
    grads = [p.grad for p in params if p.grad is not None]
    if world_size == 1 or not grads:
        return

    def mean_over_ranks(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)

    with torch.no_grad():
        _coalesced(grads, mean_over_ranks)


def broadcast_parameters(module: torch.nn.Module, accelerator: Any) -> None:
    """Overwrite every rank's parameters with rank 0's, so all ranks start from identical weights."""
    # OAI loads checkpoints on rank 0, then broadcasts all variables to the other ranks
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L482-L485
    params = list(module.parameters())
    if accelerator.num_processes == 1 or not params:
        return
    with torch.no_grad():
        _coalesced(params, lambda flat: dist.broadcast(flat, src=0))


def _markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table, which TensorBoard's text plugin renders."""
    lines = ["|" + "|".join(str(c) for c in columns) + "|", "|" + "|".join("-" for _ in columns) + "|"]
    lines += ["|" + "|".join(str(v).replace("|", "\\|").replace("\n", " ") for v in row) + "|" for row in rows]
    return "\n".join(lines)


class Tracker:
    """TensorBoard logging under output_dir/tb, plus Weights & Biases when `track`; a no-op on non-main processes."""

    def __init__(
        self,
        output_dir: str,
        track: bool,
        project: str,
        entity: str | None,
        run_name: str,
        config: dict[str, Any],
        is_main: bool,
    ) -> None:
        self.writer: SummaryWriter | None = None
        self.run: Any = None
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        if track:
            self.run = wandb.init(
                project=project, entity=entity, name=run_name, config=config, dir=output_dir, sync_tensorboard=False
            )
        self.writer = SummaryWriter(os.path.join(output_dir, "tb"))
        self.writer.add_text("hyperparameters", _markdown_table(["param", "value"], sorted(config.items())))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalars at `step`."""
        if self.writer is None:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """Log a table: a wandb.Table, and a markdown text entry in TensorBoard."""
        if self.writer is None:
            return
        self.writer.add_text(key, _markdown_table(columns, rows), step)
        if self.run is not None:
            self.run.log({key: wandb.Table(columns=columns, rows=rows)}, step=step)

    def close(self) -> None:
        """Flush and close the writers."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.run is not None:
            self.run.finish()
            self.run = None
