"""Adam with TensorFlow 1's update rule (OAI trains every model with `tf.train.AdamOptimizer`)."""

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

STEP_BUCKET_BYTES = 64 * 2**20
"""Parameter bytes that one Adam update of fused kernels covers: its temporaries (g^2, then sqrt(v) + eps) are those
of one bucket (or of one larger parameter), not of the whole model (2 x 6 GB at GPT-2 1.5B)."""


def local_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor, or for a DTensor (an --fsdp run's weights, gradients and Adam moments) this process's shard, which
    shares its storage: elementwise operations on the shards update the DTensors in place without DTensor's sharding
    propagation, Python work per operator and tensor (measured on CPU at 150 parameters: the Adam step 1.8x and the
    non-finite checks 9-10x their time on plain tensors; benchmark/shard_step.py). Call without gradients: the shard
    is what `DTensor.to_local()` returns then, which for a parameter adds a view (a dispatch) per call."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


def _buckets(params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of `params` in consecutive groups of at most STEP_BUCKET_BYTES (a larger parameter alone)."""
    buckets, size = [[]], 0
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > STEP_BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _tf_adam_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step_sizes: list[float],
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """TF1's ApplyAdam on a bucket of parameters, in place: m += (g - m) * (1 - b1); v += (g^2 - v) * (1 - b2);
    p += step_size * m / (sqrt(v) + eps). The temporaries g^2 and sqrt(v) + eps are freed in turn: one bucket's
    worth."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_lerp_(exp_avg_sqs, torch._foreach_mul(grads, grads), 1.0 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)


def _tf_adam_fused(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: torch.Tensor,
    t: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """TF1's ApplyAdam on parameters at step `t` (on one device, of one dtype) as one fused kernel, torch's fused Adam:
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps') with eps' = eps / sqrt(1 - b2^t) is TF1's
    p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps) in exact arithmetic; in float32 the operations run in
    another order (about an ulp per step). `step`: a device scalar the kernel reads t from. No temporaries."""
    step.fill_(t)
    torch._fused_adam_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step] * len(params),
        amsgrad=False,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=0.0,
        eps=eps / math.sqrt(1.0 - beta2**t),
        maximize=False,
    )


class AdamTensorFlowStyle(torch.optim.Optimizer):
    """Adam as TF1's AdamOptimizer computes it: epsilon is added after the bias correction, not before.

    TF-PARITY: TF1 folds the bias corrections into the step size, lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t), and updates
    p -= lr_t * m / (sqrt(v) + eps). torch.optim.Adam uses p -= lr * m_hat / (sqrt(v_hat) + eps), i.e. an effective
    epsilon of eps * sqrt(1 - b2^t), which is 30x smaller at t=1 and makes early steps of rarely-updated weights much
    larger. OAI: AdamOptimizer(lr, epsilon=1e-5), default betas, no weight decay, no clipping.
    https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L621-L629
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-5,
        fused: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}: pass lr >= 0.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: both must lie in [0, 1).")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}: pass eps >= 0.")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.fused = fused
        """--fused_adam: each update one fused kernel per device, dtype and step count (`_tf_adam_fused`); not in the
        state dict, so a checkpoint resumes with or without it"""
        self._fused_steps: dict[torch.device, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One TF1 Adam update of every parameter that has a gradient; reads lr/betas/eps from its group each call."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("AdamTensorFlowStyle does not support sparse gradients; use dense gradients.")
            grads = local_tensors(p.grad for p in params)
            exp_avgs, exp_avg_sqs, step_sizes = [], [], []
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                # TF-PARITY: the bias corrections scale the step size, so eps below is not bias-corrected
                # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L627
                t = state["step"]
                step_sizes.append(-group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t))
            # --fsdp: the update is elementwise, so each process updates its shards as plain tensors
            params, exp_avgs, exp_avg_sqs = local_tensors(params), local_tensors(exp_avgs), local_tensors(exp_avg_sqs)
            if self.fused:
                self._fused_step(group, params, grads, exp_avgs, exp_avg_sqs)
                continue
            for bucket in _buckets(params):
                _tf_adam_update(
                    [params[i] for i in bucket],
                    [grads[i] for i in bucket],
                    [exp_avgs[i] for i in bucket],
                    [exp_avg_sqs[i] for i in bucket],
                    [step_sizes[i] for i in bucket],
                    beta1,
                    beta2,
                    group["eps"],
                )
        return loss

    def _fused_step(
        self,
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
    ) -> None:
        """`_tf_adam_fused` on the group's parameters, by device, dtype and step count (in a run, one of each)."""
        steps = [state["step"] for state in (self.state[p] for p in group["params"] if p.grad is not None)]
        batches: dict[tuple, list[int]] = {}
        for i, (p, t) in enumerate(zip(params, steps)):
            batches.setdefault((p.device, p.dtype, t), []).append(i)
        beta1, beta2 = group["betas"]
        for (device, _, t), batch in batches.items():
            step = self._fused_steps.setdefault(device, torch.zeros((), device=device))
            _tf_adam_fused(
                [params[i] for i in batch],
                [grads[i] for i in batch],
                [exp_avgs[i] for i in batch],
                [exp_avg_sqs[i] for i in batch],
                step,
                t,
                group["lr"],
                beta1,
                beta2,
                group["eps"],
            )


def check_weight_decay(weight_decay: float, use_tensorflow_adam: bool) -> None:
    """ValueError unless --weight_decay is a finite number >= 0, and 0 with the TF-style Adam (OAI has no weight decay,
    spec O1)."""
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"--weight_decay must be a finite number >= 0, got {weight_decay!r}; pass 0 or e.g. 0.01.")
    if weight_decay and use_tensorflow_adam:
        raise ValueError(
            f"--weight_decay {weight_decay} needs --no_use_tensorflow_adam: OAI's TF1 Adam has no weight decay; pass "
            "--no_use_tensorflow_adam for torch AdamW's decoupled decay, or --weight_decay 0."
        )


def check_eps(eps: float) -> None:
    """ValueError unless --eps is a finite number > 0."""
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"--eps must be a finite number > 0, got {eps!r}; OAI uses 1e-5, TRL 1e-8.")


def make_optimizer(
    params: list[torch.nn.Parameter],
    lr: float,
    use_tensorflow_adam: bool,
    weight_decay: float = 0.0,
    eps: float = 1e-5,
    fused: bool = False,
) -> torch.optim.Optimizer:
    """OAI's optimizer, TF1-style Adam with eps 1e-5 (spec O1-O3); or torch.optim.Adam with the same eps (ablation);
    with a `weight_decay` (not OAI's), torch.optim.AdamW with eps 1e-5 and that decoupled decay (nplus N8: the
    successor recipe's AdamW, weight decay 0.01). `eps`: another epsilon for any of them (TRL's AdamW: 1e-8). Frozen
    parameters (requires_grad off: LoRA's base weights) get no optimizer state. `fused` (--fused_adam): each step one
    fused kernel (torch's fused Adam; TF1's update rewritten in its form), the same update up to float32 rounding."""
    check_weight_decay(weight_decay, use_tensorflow_adam)
    check_eps(eps)
    params = [p for p in params if p.requires_grad]  # frozen ones (LoRA's base weights) get no state
    if weight_decay:
        # p <- p * (1 - lr * weight_decay), then Adam's step (nplus N8)
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L497-L500
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=fused or None)
    # OAI's optimizer
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L621-L629
    if use_tensorflow_adam:
        return AdamTensorFlowStyle(params, lr=lr, eps=eps, fused=fused)
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=fused or None)  # None: torch's default (foreach)
