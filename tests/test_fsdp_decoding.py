"""The captured decoding step of an --fsdp policy (`distributed.gathered`, `modeling.sample(..., compile=True)`): no
FSDP2 hook runs inside the captured step, and the graph is captured once over several updates. One gloo process
stands in for several: FSDP2 shards into one shard, registers the same hooks and frees and gathers the same storage."""

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from lm_human_preference_details import decoding_graph, distributed
from lm_human_preference_details.modeling import PolicyWithValueHead, sample
from lm_human_preference_details.optim import make_optimizer
from tests.conftest import SeveralProcesses, tiny_gpt2

PAD = 50257
UPDATES = 3

pytestmark = pytest.mark.usefixtures("single_thread")


class GraphBodies:
    """Replaces the step graphs by the eager stand-in and counts, while a captured step's body runs (the kernels a CUDA
    graph records), FSDP2's forward hooks; `captures` counts the captures."""

    def __init__(self, monkeypatch):
        self.captures = 0
        self.hooks_inside: list[str] = []
        self.bodies = 0
        inside = [False]
        for name in ("_pre_forward", "_post_forward"):
            original = getattr(FSDPState, name)

            def counted(state, *args, _original=original, _name=name, **kwargs):
                if inside[0]:
                    self.hooks_inside.append(_name)
                return _original(state, *args, **kwargs)

            monkeypatch.setattr(FSDPState, name, counted)  # before fully_shard registers them
        bodies = self

        class BodyGraph(decoding_graph.EagerStepGraph):
            def capture(self, step):
                bodies.captures += 1

                def body():
                    inside[0] = True
                    bodies.bodies += 1
                    try:
                        step()
                    finally:
                        inside[0] = False

                super().capture(body)

        monkeypatch.setattr(decoding_graph, "new_step_graph", BodyGraph)


def sharded_policy() -> tuple[PolicyWithValueHead, torch.nn.Module, PolicyWithValueHead]:
    """A tiny policy sharded by FSDP2 as `--fsdp` shards it, the module PPO runs through, and an unsharded twin."""
    policy = PolicyWithValueHead(tiny_gpt2()).eval()
    torch.nn.init.normal_(policy.value_head.weight)
    whole = PolicyWithValueHead(tiny_gpt2()).eval()
    whole.load_state_dict(policy.state_dict())
    return policy, distributed.data_parallel(policy, SeveralProcesses(), fsdp=True), whole


CONTEXTS = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11]])


def rollout(policy, seed: int, compile: bool = True):
    return sample(policy, CONTEXTS, 7, 0.7, PAD, torch.Generator().manual_seed(seed), compile=compile)


def ppo_step(trained: torch.nn.Module, optimizer, responses: torch.Tensor) -> None:
    """One optimizer step through the sharded module: its forward gathers and its backward frees each unit."""
    logits, values = trained(torch.cat([CONTEXTS, responses], 1), CONTEXTS.shape[1], PAD, 0.7)
    (logits.logsumexp(-1).mean() + values.square().mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_no_fsdp_hook_runs_inside_the_captured_decoding_step(monkeypatch, gloo_process_group):
    bodies = GraphBodies(monkeypatch)
    policy, trained, whole = sharded_policy()
    with distributed.gathered(trained):
        compiled = rollout(policy, 0)
    assert bodies.captures == 1 and bodies.bodies == 3  # 7 tokens: the prefill's, 3 warm-up steps, 3 graph steps
    assert bodies.hooks_inside == []
    for a, b in zip(compiled, rollout(whole, 0, compile=False)):
        assert torch.equal(a, b)


def test_fsdp_policy_decoding_graph_is_captured_once_over_several_updates(monkeypatch, gloo_process_group):
    bodies = GraphBodies(monkeypatch)
    policy, trained, whole = sharded_policy()
    held = distributed.hold_gathered_weights(trained, policy)
    assert held == sum(p.numel() * p.element_size() for p in whole.parameters())
    optimizer = make_optimizer(list(policy.parameters()), 1e-2, use_tensorflow_adam=True)
    whole_optimizer = make_optimizer(list(whole.parameters()), 1e-2, use_tensorflow_adam=True)
    for update in range(UPDATES):
        with distributed.gathered(trained):
            responses, logprobs, values = rollout(policy, update)
        expected = rollout(whole, update, compile=False)
        assert all(torch.equal(a, b) for a, b in zip((responses, logprobs, values), expected)), update
        ppo_step(trained, optimizer, responses)
        ppo_step(whole, whole_optimizer, responses)
    assert bodies.captures == 1


def test_without_held_weights_the_gathered_storage_moves(gloo_process_group):
    # the premise of hold_gathered_weights: FSDP2 frees the gathered weights when it shards them again, and the next
    # gather allocates them elsewhere
    policy, trained, _ = sharded_policy()
    optimizer = make_optimizer(list(policy.parameters()), 1e-2, use_tensorflow_adam=True)
    keys = []
    for update in range(2):
        with distributed.gathered(trained):
            keys.append(decoding_graph.storage_key(policy))
            responses = rollout(policy, update, compile=False)[0]
        ppo_step(trained, optimizer, responses)
    assert keys[0] != keys[1]
