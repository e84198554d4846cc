"""The gradient all-reduce overlapped with the backward (spec O4): with 2 gloo processes, the gradients each optimizer
step of train_policy.py's PPO update and of train_reward.py's step sees are exactly the mean of the processes' own
gradients, with and without gradient accumulation, and every bucket's all-reduce started during the last backward."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lm_human_preference_details import distributed
from tests.memory import PeakAllocation
from tests.planted import REPO, free_port, without_gpus, write_policy_planted_labels, write_query_file

LAUNCHER = """
import dataclasses, sys
import numpy as np, torch
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
# several buckets in the tiny models: the embedding alone, then the blocks' weights
distributed.BUCKET_BYTES = 64 * 1024
records, arms, local = [], [], {{}}
average, launch = distributed.GradientAverager.average, distributed.GradientAverager.launch_in_next_backward
start_bucket = distributed.GradientAverager._launch


def recording_launch(self):
    arms.append(len(records))  # the step whose backward it arms
    launch(self)


def recording_start_bucket(self, index):
    # the process's own gradients, read before the bucket's all-reduce starts summing them in place
    local.update({{id(p): p.grad.clone() for p in self.buckets[index]}})
    start_bucket(self, index)


def recording_average(self):
    params = [p for bucket in self.buckets for p in bucket]
    started = len(self.in_flight)  # buckets the backward started
    average(self)
    records.append(dict(local=[local.pop(id(p)) for p in params], averaged=[p.grad.clone() for p in params],
                        started=started, buckets=len(self.buckets)))


distributed.GradientAverager.average = recording_average
distributed.GradientAverager.launch_in_next_backward = recording_launch
distributed.GradientAverager._launch = recording_start_bucket
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
    tp.ppo_update(policy, optimizer, accelerator, rollout, indices, sizes, args.ppo, 0.7, 50257)
    runs.append(("train_policy", accum, first, len(records)))
    # train_reward.py: 2 steps of 2 labels per process
    args = tr.Args(base_model=model_dir, label_dataset=labels, output_dir=f"{{out}}/rm{{accum}}",
                   task=books_task(query_dataset=corpus, query_length=8, response_length=4),
                   labels=tr.LabelHParams(num_train=8), batch_size=4, gradient_accumulation_steps=accum, lr=1e-3,
                   rollout_batch_size=2, normalize_samples=0)
    first = len(records)
    tr.main(args)
    runs.append(("train_reward", accum, first, len(records)))
torch.save(dict(records=records, arms=arms, runs=runs), f"{{out}}/rank{{rank}}.pt")
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
    for rank in ranks:
        # one armed backward per optimizer step: only the last micro-batch's backward starts the all-reduces
        assert rank["arms"] == list(range(len(rank["records"])))
    for script, accum, first, last in runs:
        for step in range(first, last):
            mine, other = ranks[0]["records"][step], ranks[1]["records"][step]
            assert mine["buckets"] > 2 and mine["started"] == mine["buckets"], (script, accum)
            assert any(not torch.equal(a, b) for a, b in zip(mine["local"], other["local"])), "equal local gradients"
            # today's semantics (OAI's): the sum over processes, divided by their number
            expected = [(a + b) / 2 for a, b in zip(mine["local"], other["local"])]
            for record in (mine, other):
                for got, want in zip(record["averaged"], expected, strict=True):
                    assert torch.equal(got, want), (script, accum, step)


class _TwoProcesses:
    """An accelerator as GradientAverager sees it in a 2-process run."""

    num_processes = 2


def test_gradient_averaging_holds_one_bucket_beyond_the_gradients():
    # GPU memory proxy: each bucket's gradients are copied into its all-reduce buffer and then are views of it, so
    # the averaging holds the gradients plus one bucket at a time, not a second copy of all of them (8 MiB of
    # gradients, 1 MiB each, buckets of 2 MiB; a 1-process gloo group stands in for the 2 processes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        params = [torch.nn.Parameter(torch.zeros(2**18)) for _ in range(8)]
        averager = distributed.GradientAverager(params, _TwoProcesses(), bucket_bytes=2 * 2**20)
        averager.launch_in_next_backward()
        loss = sum((p * (i + 1)).sum() for i, p in enumerate(params))
        with PeakAllocation() as memory:
            loss.backward()  # the backward allocates the gradients and starts the buckets
            averager.average()
        averager.close()
    finally:
        dist.destroy_process_group()
    assert len(averager.buckets) == 4
    assert all(torch.equal(p.grad, torch.full_like(p, (i + 1) / 2)) for i, p in enumerate(params))
    assert memory.peak <= 8 * 2**20 + 2 * 2**20 + 1024, memory.peak  # and the loss's gradient, a scalar
