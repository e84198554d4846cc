"""Responses that end at EOS (--task.end_at_eos, nplus N20-N24): where each response ends, and the whitening and the
loss means over its tokens only. OAI's recipe never builds them: train_policy.py's update reads OAI's functions as
they are, and calls these in their place when a rollout carries masks.

`nplus NX` is docs/nplus-details.md#nx.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lm_human_preference_details.tasks import response_ends

INVALID_LOGPROB = 1.0
"""the log-prob of every token after its response's EOS (nplus N20), in the rollout, the reference and the loss: the
same on both sides of each difference, so the KL and the PPO ratio's log are 0 there"""

Gae = Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]
"""GAE(rewards, values, gamma, lam) -> advantages, returns: train_policy.py's compute_advantages"""


@dataclass
class ResponseMasks:
    """Where each response ends under --task.end_at_eos (nplus N20): s = the index of its first EOS, L - 1 without
    one. Nothing after s trains the policy; the value is trained up to s + 1, the position that reads the EOS."""

    ends: torch.Tensor
    """(B,) s of each response"""
    after_end: torch.Tensor
    """(B, L) t > s: log-probs INVALID_LOGPROB (no KL), advantages 0, outside the policy loss"""
    after_value_end: torch.Tensor
    """(B, L) t > s + 1: values 0, outside the value loss"""

    @classmethod
    def of(cls, truncated: torch.Tensor, eos_id: int) -> "ResponseMasks":
        """The masks of (B, L) responses truncated after their first EOS."""
        # padding_mask = t > s, padding_mask_p1 = t > s + 1 (nplus N20)
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L670-L674
        ends = response_ends(truncated, eos_id)  # (B,)
        positions = torch.arange(truncated.shape[1], device=truncated.device)
        return cls(ends, positions > ends[:, None], positions > ends[:, None] + 1)

    def rows(self, indices: Any) -> "ResponseMasks":
        """The masks of the episodes `indices` (a minibatch's index tensor or a micro-batch's slice)."""
        return ResponseMasks(self.ends[indices], self.after_end[indices], self.after_value_end[indices])

    def score_index(self) -> torch.Tensor:
        """(B,) where the score is added: s + 1 (the step after EOS), or s when that is the last token (nplus N21)."""
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L683-L685
        length = self.after_end.shape[1]
        return torch.where(self.ends + 1 < length, self.ends + 1, self.ends)

    def invalidate(self, logprobs: torch.Tensor) -> torch.Tensor:
        """(B, L) log-probs with INVALID_LOGPROB after each response's end (nplus N20)."""
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L675-L676
        return logprobs.masked_fill(self.after_end, INVALID_LOGPROB)

    def zero_values(self, values: torch.Tensor) -> torch.Tensor:
        """(B, L) values with 0 after s + 1 (nplus N20)."""
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L677
        return values.masked_fill(self.after_value_end, 0.0)

    def minibatch_advantages(
        self,
        rewards: torch.Tensor,
        values: torch.Tensor,
        whiten_rewards: bool,
        gamma: float,
        lam: float,
        whiten_group: int,
        gae: Gae,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """train_policy.py's `minibatch_advantages` for these responses: rewards whitened over t <= s + 1 and 0 after
        (nplus N22); `gae` over all L positions (values are 0 after s + 1); advantages whitened over t <= s, mean
        shifted, and 0 after (nplus N23); returns from the unwhitened advantages."""
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L687-L704
        if whiten_rewards:
            rewards = masked_whiten(rewards, ~self.after_value_end, shift_mean=False, group_size=whiten_group)
            rewards = rewards.masked_fill(self.after_value_end, 0.0)
        advantages, returns = gae(rewards, values, gamma, lam)
        advantages = masked_whiten(advantages, ~self.after_end, group_size=whiten_group)
        return rewards, advantages.masked_fill(self.after_end, 0.0), returns

    def loss_means(self, micro: slice, micro_batches: int) -> "LossMeans":
        """The means of micro-batch `micro`'s policy and value losses (nplus N24), each its share of the minibatch's
        mean over the minibatch's tokens up to s (policy) and s + 1 (value)."""
        micro_masks = self.rows(micro)
        return LossMeans(
            ~micro_masks.after_end,
            ~micro_masks.after_value_end,
            (~self.after_end).sum() / micro_batches,
            (~self.after_value_end).sum() / micro_batches,
        )


def masked_whiten(
    values: torch.Tensor, keep: torch.Tensor, shift_mean: bool = True, group_size: int | None = None
) -> torch.Tensor:
    """train_policy.py's `whiten` with the moments over the `keep` elements of each group only (nplus N22, N23):
    population variance, eps 1e-8; every element is transformed, those outside `keep` too."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L235-L241
    rows = group_size or values.shape[0]
    groups = values.reshape(-1, rows, *values.shape[1:])  # (G, rows, ...)
    weights = keep.reshape(groups.shape).to(values.dtype)
    dims = tuple(range(1, groups.dim()))
    count = weights.sum(dims, keepdim=True)
    mean = (groups * weights).sum(dims, keepdim=True) / count
    var = ((groups - mean) ** 2 * weights).sum(dims, keepdim=True) / count
    whitened = (groups - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened.reshape(values.shape)


@dataclass
class LossMeans:
    """The tokens a micro-batch's PPO losses and clip fractions average over (nplus N24): t <= s (policy) and t <= s + 1
    (value), divided by the minibatch's count of them per micro-batch, so that the micro-batches' mean is the
    minibatch's masked mean (the update does not depend on --ppo.gradient_accumulation_steps)."""

    policy: torch.Tensor
    """(b, L) bool, t <= s"""
    value: torch.Tensor
    """(b, L) bool, t <= s + 1"""
    policy_tokens: torch.Tensor
    """() the minibatch's t <= s tokens / its micro-batches"""
    value_tokens: torch.Tensor
    """() the minibatch's t <= s + 1 tokens / its micro-batches"""

    def policy_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the minibatch's mean of x over t <= s."""
        return torch.where(self.policy, x, 0.0).sum() / self.policy_tokens

    def value_mean(self, x: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the minibatch's mean of x over t <= s + 1."""
        return torch.where(self.value, x, 0.0).sum() / self.value_tokens
