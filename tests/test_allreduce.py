"""The gradient all-reduce of DistributedDataParallel, overlapped with the backward (spec O4): with 2 gloo processes,
the gradients each optimizer step of train_policy.py's PPO update and of train_reward.py's step sees are exactly
the mean of the processes' own gradients, with and without gradient accumulation, and every bucket's all-reduce started
during the last micro-batch's backward only; the gradients are DDP's buckets (no second copy)."""

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import train_policy
from lm_human_preference_details import distributed
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.sizes import derive_sizes
from tests.conftest import tiny_gpt2
from tests.memory import PeakAllocation
from tests.planted import REPO, free_port, without_gpus, write_policy_planted_labels, write_query_file

LAUNCHER = """
import contextlib, dataclasses, sys
import numpy as np, torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, {repo!r})
import train_policy as tp
import train_reward as tr
from lm_human_preference_details import distributed
from lm_human_preference_details.sizes import derive_sizes
from lm_human_preference_details.modeling import PolicyWithValueHead, reduce_training_memory
from lm_human_preference_details.optim import make_optimizer
from tests.conftest import tiny_gpt2
from tests.planted import books_task

torch.set_num_threads(1)
out, model_dir, labels, corpus = sys.argv[1:5]
records, pending, micros = [], [], []


class SmallBuckets(DistributedDataParallel):
    # DDP with buckets of 64 KiB: several in the tiny models (the embedding alone, then the blocks' weights)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, bucket_cap_mb=64 / 1024, **kwargs)


def recording_hook(state, bucket):
    # this process's own gradients, read before the all-reduce averages the bucket in place; then DDP's default
    pending.append(dict(index=bucket.index(), params=bucket.parameters(), local=bucket.buffer().clone()))
    return default_hooks.allreduce_hook(state, bucket)


def recording_data_parallel(module, accelerator, fsdp=False):
    trained = data_parallel(module, accelerator, fsdp)
    trained.register_comm_hook(None, recording_hook)
    return trained


@contextlib.contextmanager
def counting_averaging(trained, average):
    # the bucket all-reduces each micro-batch's forward and backward started
    before = len(pending)
    with averaging_gradients(trained, average):
        yield
    micros.append((average, len(pending) - before))


def recording_step(optimizer, args, kwargs):
    # the gradients the optimizer step sees, and the local ones of the all-reduces of this step
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    local = {{}}
    for call in pending:
        chunks = call["local"].split([p.numel() for p in call["params"]])
        local.update({{id(p): chunk.view_as(p) for p, chunk in zip(call["params"], chunks, strict=True)}})
    records.append(dict(local=[local.pop(id(p)) for p in params], averaged=[p.grad.clone() for p in params],
                        buckets=sorted(call["index"] for call in pending), micros=list(micros), left=len(local)))
    pending.clear()
    micros.clear()


data_parallel, averaging_gradients = distributed.data_parallel, distributed.averaging_gradients
distributed.DistributedDataParallel = SmallBuckets
distributed.data_parallel = recording_data_parallel
distributed.averaging_gradients = counting_averaging
register_optimizer_step_pre_hook(recording_step)
accelerator = distributed.make_accelerator()
rank, world = accelerator.process_index, accelerator.num_processes
runs = []
for accum in (1, 2):
    # train_policy.py: one PPO update of 2 optimizer steps on this process's own random 16 episodes
    args = tp.Args()
    args.ppo = dataclasses.replace(args.ppo, batch_size=32, nminibatches=2, noptepochs=1,
                                   gradient_accumulation_steps=accum)
    sizes = derive_sizes(args, world)
    gen = torch.Generator().manual_seed(rank)
    context_length, length = 5, 6
    rollout = tp.Rollout(torch.randint(0, 50257, (16, context_length + length), generator=gen), context_length,
                         -3 * torch.rand(16, length, generator=gen), torch.randn(16, length, generator=gen),
                         torch.randn(16, length, generator=gen))
    indices = torch.from_numpy(tp.minibatch_indices(tp.virtual_rank_rngs(1, rank, world, 1), 16, 2, 1))
    policy = PolicyWithValueHead(tiny_gpt2(seed=0))
    reduce_training_memory(policy, gradient_checkpointing=accum == 2, bf16=False)
    optimizer = make_optimizer(list(policy.parameters()), 1e-3, True)
    first = len(records)
    trained = distributed.data_parallel(policy, accelerator)
    tp.ppo_update(trained, optimizer, rollout, indices, sizes, args.ppo, 0.7, 50257)
    runs.append(("train_policy", accum, first, len(records)))
    # train_reward.py: 2 steps of 2 labels per process
    args = tr.Args(base_model=model_dir, label_dataset=labels,
                   task=books_task(query_dataset=corpus, query_length=8, response_length=4),
                   labels=tr.LabelHParams(num_train=8), batch_size=4, gradient_accumulation_steps=accum, lr=1e-3,
                   rollout_batch_size=2, normalize_samples=0)
    args.run.output_dir = f"{{out}}/rm{{accum}}"
    first = len(records)
    tr.main(args)
    runs.append(("train_reward", accum, first, len(records)))
torch.save(dict(records=records, runs=runs), f"{{out}}/rank{{rank}}.pt")
"""


@pytest.mark.slow
def test_overlapped_allreduce_gives_each_step_the_mean_of_the_processes_gradients(tmp_path, tokenizer, tiny_model_dir):
    corpus = write_query_file(tmp_path / "queries.txt", n=40)
    labels = write_policy_planted_labels(
        tmp_path / "labels.json", tiny_model_dir, tokenizer, corpus, 8, 8, 4, tokenizer.encode(" happy")[0]
    )
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(launcher), str(tmp_path), tiny_model_dir, str(labels)]
    run = subprocess.run([*command, str(corpus)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    runs = ranks[0]["runs"]
    assert [(script, accum, last - first) for script, accum, first, last in runs] == [
        ("train_policy", 1, 2), ("train_reward", 1, 2), ("train_policy", 2, 2), ("train_reward", 2, 2)
    ]  # fmt: skip
    for script, accum, first, last in runs:
        for step in range(first, last):
            mine, other = ranks[0]["records"][step], ranks[1]["records"][step]
            for record in (mine, other):
                # only the step's last micro-batch communicates: its backward starts every bucket's all-reduce, once
                assert [average for average, _ in record["micros"]] == [False] * (accum - 1) + [True], (script, accum)
                assert [calls for _, calls in record["micros"][:-1]] == [0] * (accum - 1), (script, accum)
                buckets = record["micros"][-1][1]
                assert record["buckets"] == list(range(buckets)), (script, accum, record["buckets"])
                # DDP's first step has one bucket; then it rebuilds them in the order the first backward produced
                # the gradients, with the bucket size cap
                assert buckets == 1 if step == first else buckets > 2, (script, accum, step, buckets)
                assert record["left"] == 0, "every bucketed gradient reaches the optimizer"
            assert any(not torch.equal(a, b) for a, b in zip(mine["local"], other["local"])), "equal local gradients"
            # OAI's semantics: the sum over processes, divided by their number
            expected = [(a + b) / 2 for a, b in zip(mine["local"], other["local"])]
            for record in (mine, other):
                for got, want in zip(record["averaged"], expected, strict=True):
                    assert torch.equal(got, want), (script, accum, step)


class _TwoProcesses:
    """An accelerator as `data_parallel` sees it in a 2-process run (a 1-process gloo group stands in for the 2)."""

    num_processes = 2
    device = torch.device("cpu")


@contextlib.contextmanager
def _one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Weights(torch.nn.Module):
    """8 parameters of 1 MiB; the loss weighs parameter i by i + 1 (its gradient)."""

    def __init__(self):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(2**18)) for _ in range(8))

    def forward(self) -> torch.Tensor:
        return sum((p * (i + 1)).sum() for i, p in enumerate(self.weights))


def test_ddp_gradients_are_its_buckets_and_a_step_allocates_no_second_copy():
    # GPU memory proxy: with gradient_as_bucket_view every gradient is a view of DDP's all-reduce buckets, and
    # clear_gradients zeroes them in place (not None), so they stay the buckets: the gradients take their size once.
    # DDP rebuilds its buckets in the first backward's order at the second forward; from then on the gradients keep
    # their addresses and a step's backward allocates only one temporary gradient at a time (8 MiB of gradients)
    with _one_process_group():
        model = _Weights()
        trained = distributed.data_parallel(model, _TwoProcesses())
        assert isinstance(trained, DistributedDataParallel)
        buffers = {}

        def bucket_buffer(state, bucket):
            buffers[bucket.index()] = bucket.buffer()
            return default_hooks.allreduce_hook(state, bucket)

        trained.register_comm_hook(None, bucket_buffer)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        peaks, addresses = [], []
        for step in range(4):
            loss = trained()
            with PeakAllocation() as memory:
                loss.backward()
            peaks.append(memory.peak)
            grads = [p.grad for p in model.parameters()]
            assert all(torch.equal(g, torch.full_like(g, i + 1)) for i, g in enumerate(grads)), step
            bucket_storages = {b.untyped_storage().data_ptr() for b in buffers.values()}
            assert {g.untyped_storage().data_ptr() for g in grads} == bucket_storages, step
            assert sum(b.nbytes for b in buffers.values()) == 8 * 2**20, "one bucket byte per gradient byte"
            addresses.append([g.data_ptr() for g in grads])
            optimizer.step()
            distributed.clear_gradients(optimizer, trained)
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters()), "zeroed in place"
    assert addresses[1] == addresses[2] == addresses[3]
    assert max(peaks[2:]) <= 2**20 + 1024, peaks  # one gradient's temporary (and the loss's, a scalar)


def _ppo_update_params(trained: torch.nn.Module, policy: torch.nn.Module) -> list[torch.Tensor]:
    """The policy's parameters after one PPO update through `trained`: 2 optimizer steps of 2 micro-batches each."""
    args = train_policy.Args()
    ppo = dict(batch_size=16, nminibatches=2, noptepochs=1, gradient_accumulation_steps=2)
    args.ppo = dataclasses.replace(args.ppo, **ppo)
    sizes = derive_sizes(args, 1)
    gen = torch.Generator().manual_seed(0)
    context_length, length = 5, 6
    rollout = train_policy.Rollout(
        torch.randint(0, 50257, (16, context_length + length), generator=gen),
        context_length,
        -3 * torch.rand(16, length, generator=gen),
        torch.randn(16, length, generator=gen),
        torch.randn(16, length, generator=gen),
    )
    indices = torch.from_numpy(train_policy.minibatch_indices(train_policy.virtual_rank_rngs(1, 0, 1, 1), 16, 2, 1))
    optimizer = make_optimizer(list(policy.parameters()), 1e-3, True)
    train_policy.ppo_update(trained, optimizer, rollout, indices, sizes, args.ppo, 0.7, 50257)
    return [p.detach().clone() for p in policy.parameters()]


def test_ddp_steps_with_gradients_zeroed_in_place_equal_steps_with_gradients_set_to_none(one_thread, monkeypatch):
    # clear_gradients zeroes DDP's gradients in place (0 + g is g): train_policy's PPO update through DDP (a 1-process
    # group: the mean is the process's own gradient, no_sync for the first micro-batch) moves the policy bit for bit
    # as the update on the module itself with its gradients freed after each step
    alone = PolicyWithValueHead(tiny_gpt2(seed=0))
    with monkeypatch.context() as patch:
        patch.setattr(distributed, "clear_gradients", lambda optimizer, trained: optimizer.zero_grad(set_to_none=True))
        expected = _ppo_update_params(alone, alone)
    with _one_process_group():
        policy = PolicyWithValueHead(tiny_gpt2(seed=0))
        trained = distributed.data_parallel(policy, _TwoProcesses())
        assert isinstance(trained, DistributedDataParallel)
        got = _ppo_update_params(trained, policy)
    assert any(not torch.equal(p, q) for p, q in zip(expected, PolicyWithValueHead(tiny_gpt2(seed=0)).parameters()))
    assert all(torch.equal(p, q) for p, q in zip(got, expected, strict=True))
