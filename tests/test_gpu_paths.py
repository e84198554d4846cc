"""CPU proxies of the GPU code paths: host syncs per update, bf16 rollout statistics, the compiled decoding step."""

import dataclasses
import gc
import json
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import StaticCache

import train_policy
import train_reward
from benchmark import memory_estimate
from benchmark.shapes import gpt2_config
from lm_human_preference_details import decoding_graph, tracking
from lm_human_preference_details.devices import to_device
from lm_human_preference_details.instruments.host_syncs import HostSyncCounter
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    reduce_training_memory,
    sample,
    training_logprobs_and_values,
)
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.tasks import TASKS, PassRateAlarm
from tests.conftest import tiny_gpt2, write_queries
from tests.planted import books_task, write_query_file
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task

PAD = 50259
HOST_SYNC_BUDGET = 2
"""host syncs allowed per PPO update and per reward-training step"""

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- the counter


def test_counter_counts_each_read_of_device_values_once():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()  # .item()
        if (x > 2).any():  # bool()
            pass
        x.tolist()
        torch.nonzero(x)
        x[x > 2]  # boolean-mask indexing: value-dependent shape
        torch.equal(x, x)
        x.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]))
        float(x[1])
    assert syncs.count == 8, syncs.events


def test_counter_ignores_device_work_and_values_already_on_the_host():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        y = (x * 2).cumsum(0).where(x > 1, 0.0)  # device work only
        x.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]), output_size=6)  # shape given: no read
        host = torch.stack([y.max(), y.min()]).cpu()  # one device-to-host copy
        _ = [column.item() for column in host] + host.tolist() + [bool(host[0] > 0)]
    assert syncs.count == 1 and syncs.events[0].startswith("cpu"), syncs.events


def test_counter_counts_host_to_device_copies_that_wait_for_the_device():
    device = torch.device("cpu")  # the run's device: on a CPU run the counter follows which tensors are host memory
    on_device = torch.zeros(6)  # made before the counted block: a device tensor
    with HostSyncCounter() as syncs:
        host = torch.tensor([1.0, 2.0])  # a factory without a device: pageable host memory
        (host * 2).to(device)  # computed from host memory alone
        on_device[:2] = host  # an indexed assignment of host memory
        torch.from_numpy(np.ones(6, dtype=np.float32)).to(device)
        on_device.copy_(torch.zeros(6))
        host.to(device)  # on a CPU run the same tensor comes back, now taken for a device tensor
        assert syncs.count == 5, syncs.events
        to_device(torch.ones(2), device)  # pinned on CUDA and asynchronous: no wait
        made_there = torch.zeros(3, device=device)
        made_there.to(device), on_device.to(device), host.to(device)  # on the device already
        torch.ones(2).to(torch.float64), torch.ones(2).to("cpu", copy=True)  # a dtype change; a copy to the host
    assert syncs.count == 5 and all("host-to-device" in e for e in syncs.events), syncs.events


def test_counter_does_not_count_a_copy_of_no_elements():
    """torch's `copy_` returns before it copies when there are no elements, so nothing waits; an empty tensor is not
    pinned by `pin_memory()`, so the pinned-memory test alone took `to_device` of an empty prefix for a waiting copy."""
    counter = HostSyncCounter()
    cuda = torch.device("cuda")  # the target device only: no GPU is needed to ask whether the copy waits
    empty = torch.tensor([], dtype=torch.long).pin_memory() if torch.cuda.is_available() else torch.tensor([])
    assert not empty.is_pinned()
    assert not counter._copy_waits(empty, cuda, True, None)  # `to_device` of an empty prefix
    assert not counter._copy_waits(empty, cuda, False, None)
    assert not counter._copy_waits(torch.ones(1), cuda, False, torch.empty(0))  # into an empty destination
    assert counter._copy_waits(torch.ones(1), cuda, True, None)  # one element from pageable memory still waits
    with HostSyncCounter() as syncs:
        torch.tensor([], dtype=torch.long).to(torch.device("cpu"))  # a CPU run: empty pageable memory, blocking
        torch.tensor([1]).to(torch.device("cpu"))
    assert syncs.count == 1, syncs.events


def test_sampling_copies_nothing_from_the_host():
    policy = PolicyWithValueHead(tiny_gpt2())
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340]])
    with HostSyncCounter() as syncs:
        sample(policy, contexts, 4, 0.7, PAD, torch.Generator().manual_seed(0), check_first_token=False)
    # measured: one copy per layer before (transformers' StaticCache made each layer's position counter on the host)
    assert syncs.count == 0, syncs.events


# ---------------------------------------------------------------- host syncs per update of the real scripts


def syncs_between_calls(monkeypatch, owner, name: str, run) -> list[int]:
    """Host syncs between consecutive calls of `owner.name` (one per PPO update / reward step) while `run()` runs."""
    marks = []
    method = getattr(owner, name)

    def marking(*args, **kwargs):
        marks.append(syncs.count)
        return method(*args, **kwargs)

    monkeypatch.setattr(owner, name, marking)
    with HostSyncCounter() as syncs:
        run()
    return [later - earlier for earlier, later in zip(marks, marks[1:])]


def test_ppo_update_stays_within_the_host_sync_budget(monkeypatch, tmp_path, tiny_model_dir):
    query_file = tmp_path / "queries.txt"
    write_queries(query_file)
    reward_model_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(str(query_file)))
    args = tiny_args(tmp_path / "policy", tiny_model_dir, reward_model_dir, str(query_file), total_episodes=16)
    # the flags' code paths include the plain one's; the sample table is printed at update 0 only
    args = with_run(args, log_interval=1000, gradient_checkpointing=True, bf16=True)
    # marked after each update's sample table
    per_update = syncs_between_calls(monkeypatch, PassRateAlarm, "update", lambda: train_policy.main(args))
    # measured: 14 per update before the 4-D masks (12 attention-mask tests, 1 in the prefill, 1 statistics copy),
    # then 1, the statistics copy (also without the flags); counting host-to-device copies from pageable memory: 5
    # (the minibatch order, the queries, the sampler's cache set-up in each of the 2 layers), now 1 again
    assert len(per_update) == 1 and per_update[0] <= HOST_SYNC_BUDGET, per_update


def test_successor_recipe_update_stays_within_the_host_sync_budget(monkeypatch, tmp_path, tiny_model_dir):
    # the successor recipe's options add no host sync: responses that end at EOS (masks, score index, masked means),
    # a separate critic from the reward model (its own forward in the rollout), the k3 estimator, a subtracted penalty
    query_file = tmp_path / "queries.txt"
    write_queries(query_file)
    reward_model_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(str(query_file)))
    args = tiny_args(tmp_path / "policy", tiny_model_dir, reward_model_dir, str(query_file), total_episodes=16)
    task = dataclasses.replace(
        args.task, end_at_eos=True, truncate_text=None, truncate_token=None, penalty_mode="subtract"
    )
    args = dataclasses.replace(
        with_run(args, log_interval=1000),
        task=task,
        rewards=dataclasses.replace(args.rewards, kl_estimator="k3", allow_task_mismatch=True),
        ppo=dataclasses.replace(args.ppo, value_model="reward"),
    )
    per_update = syncs_between_calls(monkeypatch, PassRateAlarm, "update", lambda: train_policy.main(args))
    # measured: 1, the statistics copy, as without these options (HOST_SYNC_BUDGET leaves room for one more)
    assert per_update == [1], per_update


@pytest.mark.parametrize("flags", [{}, {"gradient_checkpointing": True, "bf16": True}], ids=["plain", "ckpt-bf16"])
def test_reward_step_stays_within_the_host_sync_budget(monkeypatch, tmp_path, tiny_model_dir, flags):
    rng = np.random.default_rng(0)
    rows = [
        {"query": rng.integers(0, 50000, 16).tolist(), "best": int(rng.integers(4))}
        | {f"sample{i}": rng.integers(0, 50000, 8).tolist() for i in range(4)}
        for _ in range(40)
    ]
    (tmp_path / "labels.json").write_text(json.dumps(rows))
    task = books_task(query_dataset=str(write_query_file(tmp_path / "q.txt", n=50)), query_length=16, response_length=8)
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(tmp_path / "labels.json"),
        task=task,
        labels=train_reward.LabelHParams(num_train=24),
        batch_size=8,
        rollout_batch_size=8,
        normalize_samples=8,
        normalize_before=False,
        normalize_after=False,
    )
    args = with_run(args, output_dir=str(tmp_path / "rm"), **flags)
    # logged: the held-out evaluation, steps 0, 1 and 2, the evaluation after training
    per_step = syncs_between_calls(monkeypatch, tracking.Tracker, "log", lambda: train_reward.main(args))[1:-1]
    # measured: 3 per step before (the attention-mask test, 2 when a row holds a PAD; the leading-PAD check; both per
    # micro-batch; the statistics copy), then 1: the statistics copy; counting host-to-device copies from pageable
    # memory: 4 (the labels, then queries and samples in each micro-batch), now 1 again
    assert len(per_step) == 2 and max(per_step) <= HOST_SYNC_BUDGET, per_step


# ---------------------------------------------------------------- --bf16: rollout statistics of the loss forward


def test_bf16_rollout_statistics_equal_the_loss_forwards():
    policy = PolicyWithValueHead(tiny_gpt2())
    torch.nn.init.normal_(policy.value_head.weight)
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11], [11, 12, 13, 14]])
    responses, sampled_logprobs, _ = sample(policy, contexts, 5, 0.7, PAD, torch.Generator().manual_seed(0))
    query_responses = torch.cat([contexts, responses], 1)
    reduce_training_memory(policy, gradient_checkpointing=False, bf16=True)
    logprobs, values = training_logprobs_and_values(policy, query_responses, 4, PAD, 0.7, micro_batch=2)
    for rows in (slice(0, 2), slice(2, 4)):  # the PPO loss forward, with gradients, on a micro-batch
        logits, vpred = policy(query_responses[rows], 4, PAD, 0.7)
        loss_logprobs = torch.log_softmax(logits, -1).gather(-1, responses[rows, :, None])[..., 0]
        torch.testing.assert_close(logprobs[rows], loss_logprobs.detach(), atol=1e-6, rtol=0)
        assert torch.equal(values[rows], vpred.detach())
    # the float32 sampler's log-probs differ by bf16 rounding: what put the first ratio ~1.5e-3 off 1
    assert (logprobs - sampled_logprobs).abs().max() > 1e-4


# ---------------------------------------------------------------- the compiled decoding step


def test_sample_draws_one_uniform_per_row_and_step_in_order():
    policy = PolicyWithValueHead(tiny_gpt2())
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11]])
    responses, _, _ = sample(policy, contexts, 6, 1.0, PAD, torch.Generator().manual_seed(5))
    # the draws of a sampler that draws inside each step: torch.rand((B, 1), float64) per step, then the inverse CDF
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        logits, _ = policy(torch.cat([contexts, responses], 1), 4, PAD, 1.0)  # (B, L, V)
    for t in range(responses.shape[1]):
        uniform = torch.rand((3, 1), generator=generator, dtype=torch.float64)
        cdf = torch.softmax(logits[:, t].double(), -1).cumsum(-1)
        assert torch.equal(torch.searchsorted(cdf, uniform, right=True)[:, 0], responses[:, t]), t


@pytest.mark.floor
def test_compiled_decoding_samples_exactly_what_eager_decoding_samples():
    policy = PolicyWithValueHead(tiny_gpt2(n_layer=1))
    torch.nn.init.normal_(policy.value_head.weight)
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11]])
    for seed in (0, 1):  # the second call replays the compiled step on the emptied cache of the first
        eager = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(seed))
        compiled = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(seed), compile=True)
        for name, a, b in zip(("responses", "logprobs", "values"), eager, compiled):
            assert torch.equal(a, b), (seed, name)


class OpRecorder(TorchDispatchMode):
    """Every aten operator run outside the step graph's replays: its name, the bytes `copy_` writes, and the storages
    of its tensor arguments; `between_replays` groups them by the gaps between consecutive replays."""

    def __init__(self):
        super().__init__()
        self.gaps: list[list[tuple[str, int, set[int]]]] = [[]]
        self.replays = 0
        self.paused = False

    def __enter__(self):
        self.gaps, self.replays = [[]], 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            written = args[0].numel() * args[0].element_size() if func is torch.ops.aten.copy_.default else 0
            self.gaps[-1].append((str(func), written, {t.untyped_storage().data_ptr() for t in tensors}))
        return func(*args, **kwargs)

    def replayed(self) -> None:
        self.replays += 1
        self.gaps.append([])

    def between_replays(self) -> list[list[tuple[str, int, set[int]]]]:
        return self.gaps[1:-1]


def recording_step_graphs(monkeypatch, policy, recorder: OpRecorder | None = None) -> list:
    """Replace the step graphs by the eager stand-in, recording each capture; a replay checks, as a CUDA graph needs,
    that the policy's tensors are where they were at the capture, and is hidden from `recorder`."""
    captures = []
    policy_ref = weakref.ref(policy)

    class RecordingGraph(decoding_graph.EagerStepGraph):
        def capture(self, step):
            super().capture(step)
            self.storage = decoding_graph.storage_key(policy_ref())
            captures.append(self)

        def replay(self):
            assert decoding_graph.storage_key(policy_ref()) == self.storage, "replayed with the weights moved"
            if recorder is None:
                return super().replay()
            recorder.paused = True
            try:
                super().replay()
            finally:
                recorder.paused = False
            recorder.replayed()

    monkeypatch.setattr(decoding_graph, "new_step_graph", RecordingGraph)
    return captures


def check_compiled_equals_eager(policy, contexts, seed: int, response_length: int = 7):
    eager = sample(policy, contexts, response_length, 0.7, PAD, torch.Generator().manual_seed(seed))
    compiled = sample(policy, contexts, response_length, 0.7, PAD, torch.Generator().manual_seed(seed), compile=True)
    for name, a, b in zip(("responses", "logprobs", "values"), eager, compiled):
        assert torch.equal(a, b), (seed, name)


def test_decoding_graph_copies_only_the_step_inputs_and_outputs():
    """CPU proxy of the CUDA graph's copies: between two replays the host copies the step's uniforms in and its
    tokens, log-probs and values out, nothing else; the weights and the KV cache stay where the graph reads them."""
    policy = PolicyWithValueHead(tiny_gpt2(n_layer=1))
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11]])
    recorder = OpRecorder()
    with pytest.MonkeyPatch.context() as monkeypatch:
        recording_step_graphs(monkeypatch, policy, recorder)
        sample(policy, contexts, 8, 0.7, PAD, torch.Generator().manual_seed(0), compile=True)  # warm-up and capture
        with recorder:
            sample(policy, contexts, 8, 0.7, PAD, torch.Generator().manual_seed(1), compile=True)
    graph = decoding_graph.GRAPHS.get(policy, (3, 12, "cpu", PAD, 0.7, False), lambda: None)
    weights = {t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()]}
    cache = {t.untyped_storage().data_ptr() for layer in graph.cache.layers for t in (layer.keys, layer.values)}
    gaps = recorder.between_replays()
    assert recorder.replays == 7 and len(gaps) == 6
    batch = contexts.shape[0]
    for ops in gaps:
        # out: token (int64), log-prob and value (float32); in: the next step's uniform (float64)
        assert sum(written for _, written, _ in ops) == batch * (8 + 4 + 4 + 8), ops
        assert not any(storages & (weights | cache) for _, _, storages in ops), ops


def test_decoding_graph_is_captured_once_per_shape_and_weight_storage(monkeypatch):
    policy = PolicyWithValueHead(tiny_gpt2(n_layer=1))
    torch.nn.init.normal_(policy.value_head.weight)
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11]])
    captures = recording_step_graphs(monkeypatch, policy)
    for seed in (0, 1):  # 6 decoding steps: 3 eager warm-ups, the capture and replays; then replays only
        check_compiled_equals_eager(policy, contexts, seed)
    assert len(captures) == 1
    # Adam updates the weights in place: the same graph replays on the new values
    optimizer = make_optimizer(list(policy.parameters()), 1e-2, use_tensorflow_adam=True)
    query_responses = torch.cat([contexts, sample(policy, contexts, 3, 0.7, PAD)[0]], 1)
    logits, values = policy(query_responses, 4, PAD, 0.7)
    (logits.logsumexp(-1).mean() + values.square().mean()).backward()
    optimizer.step()
    check_compiled_equals_eager(policy, contexts, 2)
    assert len(captures) == 1
    # tensors replaced (a load that assigns them): the old graph would read freed memory, so a new capture
    policy.load_state_dict({k: v.clone() for k, v in policy.state_dict().items()}, assign=True)
    check_compiled_equals_eager(policy, contexts, 3)
    assert len(captures) == 2
    check_compiled_equals_eager(policy, contexts[:2], 4)  # a new batch shape
    check_compiled_equals_eager(policy, contexts, 5, response_length=9)  # a new cache length
    assert len(captures) == 4
    # the graphs, kept by policy, do not keep it alive
    policy_ref = weakref.ref(policy)
    del policy, optimizer, logits, values
    gc.collect()
    assert policy_ref() is None


# ---------------------------------------------------------------- the rollout in chunks (--rollout_micro_batch_size)


@pytest.mark.parametrize("compile", [False, True])
def test_sampling_in_chunks_gives_every_episode_the_samples_of_one_batch(compile):
    # each episode keeps the uniforms of its row in the whole batch's draws (step after step over all rows), so
    # decoding 2 rows at a time (the last chunk 1 row) gives the same tokens; log-probs and values differ only by
    # float rounding (a matmul's kernel depends on its row count)
    policy = PolicyWithValueHead(tiny_gpt2(n_layer=1))
    torch.nn.init.normal_(policy.value_head.weight)
    contexts = torch.tensor([[23073, 11, PAD, 13], [7091, 1807, 546, 340], [13, PAD, PAD, 11], [11, 13, 546, PAD]])
    contexts = torch.cat([contexts, contexts[:1]])  # 5 rows; rows 0 and 4 share a context, not their draws
    whole = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(2), compile=compile)
    chunked = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(2), compile=compile, max_rows=2)
    assert torch.equal(whole[0], chunked[0])
    for a, b in zip(whole[1:], chunked[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not torch.equal(whole[0][0], whole[0][4])


# ---------------------------------------------------------------- benchmark/memory_estimate.py


def test_memory_estimate_counts_the_kv_cache_the_sampler_allocates_and_suggests_chunks_that_fit():
    args = memory_estimate.Args(shapes=("tiny",), batch_size=64, processes=8, gpu_gib=80.0)
    rows, tokens = 8, TASKS["sentiment"].query_length + TASKS["sentiment"].response_length
    cache = StaticCache(config=gpt2_config("tiny"), max_cache_len=tokens)
    cache.early_initialization(rows, 2, 16, torch.float32, torch.device("cpu"))  # heads, head size of the tiny shape
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert memory_estimate.estimate(args, "tiny", None)["KV cache"] == allocated
    # one process decoding 512 episodes of 1.5B (PPO in micro-batches of 8): the rollout is the peak; on a GPU with
    # room for the PPO phase only, the largest divisor of the batch that fits is suggested, and it fits
    args = memory_estimate.Args(processes=1, gradient_accumulation_steps=64)
    whole = memory_estimate.estimate(args, "gpt2-1.5b", None)
    assert whole["peak"] == whole["rollout"] > whole["PPO"]
    args.gpu_gib = (whole["PPO"] + whole["rollout"]) / 2 / 2**30 + args.headroom_gib
    assert not memory_estimate.fits(args, whole["peak"])
    rows = memory_estimate.rollout_rows_that_fit(args, "gpt2-1.5b", whole["batch"])
    assert rows is not None and 512 % rows == 0 and rows < 512
    assert memory_estimate.fits(args, memory_estimate.estimate(args, "gpt2-1.5b", rows)["peak"])
    assert not memory_estimate.fits(args, memory_estimate.estimate(args, "gpt2-1.5b", 2 * rows)["peak"])
