"""The elementwise steps of an --fsdp run on its DTensor shards: TF-style Adam and the non-finite checks run on each
process's local shards as plain tensors, dispatching no operator on a DTensor (DTensor's sharding propagation is
Python work per operator and tensor), and compute what they compute on unsharded tensors, bit for bit. The host time
they save is measured by benchmark/shard_step.py, not here."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lm_human_preference_details import distributed, validation
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.optim import make_optimizer
from tests.conftest import SeveralProcesses, tiny_gpt2

PAD = 50257

pytestmark = pytest.mark.usefixtures("single_thread")


class Dispatches(TorchDispatchMode):
    """The operators dispatched, each with whether a DTensor is among its arguments."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((str(func), any(isinstance(x, DTensor) for x in tree_leaves((args, kwargs)))))
        return func(*args, **kwargs)


def backward(module: torch.nn.Module, seed: int) -> None:
    tokens = torch.randint(0, 50000, (2, 10), generator=torch.Generator().manual_seed(seed))
    logits, values = module(tokens, 6, PAD, 0.7)
    (logits.logsumexp(-1).mean() + values.square().mean()).backward()


def checks_and_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list, list, list[int]]:
    """The operators of the non-finite checks of the gradients and weights, those of the optimizer step, the counts."""
    params = list(module.parameters())
    with Dispatches() as checks:
        counts = [validation.nonfinite_tensors(p.grad for p in params), validation.nonfinite_tensors(params)]
    with Dispatches() as step:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return checks.ops, step.ops, [c.item() for c in counts]


@pytest.mark.parametrize("use_tensorflow_adam", [True, False])
def test_adam_and_nonfinite_checks_on_shards_dispatch_what_plain_tensors_do_and_equal_the_unsharded_step(
    gloo_process_group, use_tensorflow_adam
):
    policy = PolicyWithValueHead(tiny_gpt2()).eval()
    whole = PolicyWithValueHead(tiny_gpt2()).eval()
    whole.load_state_dict(policy.state_dict())
    trained = distributed.data_parallel(policy, SeveralProcesses(), fsdp=True)
    assert all(isinstance(p, DTensor) for p in policy.parameters())
    optimizers = [make_optimizer(list(m.parameters()), 1e-2, use_tensorflow_adam) for m in (policy, whole)]
    for step in range(3):
        backward(trained, step)
        backward(whole, step)
        sharded_checks, sharded_step, sharded_counts = checks_and_step(policy, optimizers[0])
        plain_checks, plain_step, plain_counts = checks_and_step(whole, optimizers[1])
        # the same operators on the shards, none of them on a DTensor (no sharding propagation)
        assert sharded_checks == plain_checks and sharded_counts == plain_counts == [0, 0]
        if use_tensorflow_adam and step > 0:  # the first step makes the moments, DTensors like the weights
            assert sharded_step == plain_step and not any(on_dtensor for _, on_dtensor in sharded_step), step
    for (name, p), q in zip(policy.named_parameters(), whole.parameters()):
        assert torch.equal(p.full_tensor(), q), name


def test_nonfinite_checks_on_shards_find_a_nan_in_a_shard(gloo_process_group):
    policy = PolicyWithValueHead(tiny_gpt2()).eval()
    distributed.data_parallel(policy, SeveralProcesses(), fsdp=True)
    params = list(policy.parameters())
    with torch.no_grad():
        params[3].to_local().view(-1)[0] = float("nan")
        params[5].to_local().view(-1)[-1] = float("inf")
    assert validation.nonfinite_tensors(params).item() == 2
