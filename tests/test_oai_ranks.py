"""OAI's 8 ranks by default (spec D4): on 1, 2, 4 or 8 processes the policy run whitens, permutes and averages its
statistics as OAI's 8 ranks did, with no flag; --ppo.whiten_group_size 0 opts out."""

import dataclasses
import json
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest

from lm_human_preference_details.sizes import OAI_RANKS, derive_sizes
from tests.conftest import one_intra_op_thread
from tests.fidelity import np_gae, np_whiten
from tests.planted import REPO, free_port, without_gpus
from train_policy import Args, main, task_presets


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_default_sizes_are_oai_ranks_on_any_process_count(world):
    books, tldr = task_presets()["sentiment"], task_presets()["tldr"]
    sizes = derive_sizes(books, world)  # OAI: 8 ranks of 64 episodes, whitened together (1 minibatch)
    assert (sizes.group, sizes.virtual_ranks, sizes.whiten_group) == (64, OAI_RANKS // world, 64)
    assert sizes.not_oai_ranks is None
    sizes = derive_sizes(tldr, world)  # OAI: 8 ranks of 4 episodes (rewards not whitened, advantages are)
    assert (sizes.group, sizes.virtual_ranks, sizes.whiten_group) == (4, OAI_RANKS // world, 4)


def test_whiten_group_size_zero_whitens_each_process_batch():
    args = task_presets()["sentiment"]
    args.ppo.whiten_group_size = 0
    sizes = derive_sizes(args, 2)
    assert (sizes.group, sizes.virtual_ranks, sizes.whiten_group, sizes.not_oai_ranks) == (256, 1, 256, None)


@pytest.mark.parametrize(
    "world, ppo, reason",
    [
        (16, {}, "16 processes"),  # 32 episodes per process: fewer than one OAI rank's 64
        (1, dict(batch_size=36), "not a multiple of 8"),
        (1, dict(batch_size=64), "too small to whiten"),  # OAI's 8 ranks would whiten 8 / 2 = 4 episodes
    ],
)
def test_sizes_that_rule_out_oai_ranks_whiten_per_process_with_the_reason(world, ppo, reason):
    args = task_presets()["sentiment"]
    args.ppo = dataclasses.replace(args.ppo, nminibatches=2 if "whiten" in reason else 1, **ppo)
    sizes = derive_sizes(args, world)
    assert (sizes.group, sizes.virtual_ranks) == (sizes.batch, 1)
    assert reason in sizes.not_oai_ranks


def test_dry_run_prints_oai_ranks_and_warns_when_it_cannot(tmp_path, capsys):
    args = task_presets()["sentiment"]
    args.run.output_dir, args.run.dry_run = str(tmp_path), True
    args.rewards.trained_model = "vader"  # a dry run checks its inputs: a reward with none to check
    assert main(args) == []
    out = capsys.readouterr().out
    assert "8 x 64 episodes (8 ranks in all), whitened in minibatches of 64" in " ".join(out.split())
    assert "warning" not in out
    args.ppo.batch_size = 36
    main(args)
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: each process whitens its 36 episodes as one rank" in out and "--ppo.whiten_group_size 0" in out


_LAUNCHER = """
import json, sys
import numpy as np, torch
sys.path.insert(0, {repo!r})
import train_policy as tp
from lm_human_preference_details import distributed
from lm_human_preference_details.sizes import derive_sizes
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.optim import make_optimizer
from tests.conftest import tiny_gpt2

torch.set_num_threads(1)
out = sys.argv[1]
accelerator = distributed.make_accelerator()
rank, world = accelerator.process_index, accelerator.num_processes
args = tp.Args()  # no whitening flag
args.ppo.batch_size, args.ppo.nminibatches, args.ppo.noptepochs = 128, 2, 2
sizes = derive_sizes(args, world)
# one global rollout batch of 8 OAI ranks: rows [k * 16, (k + 1) * 16) are the episodes of rank k
gen = torch.Generator().manual_seed(0)
context_length, length = 4, 5
query_responses = torch.randint(0, 50257, (128, context_length + length), generator=gen)
logprobs = -3 * torch.rand(128, length, generator=gen)
values = torch.randn(128, length, generator=gen)
rewards = 0.1 * torch.randn(128, length, generator=gen) + torch.arange(128.0)[:, None] / 32
# virtual rank g of this process stands for OAI rank rank + world * g
local = torch.cat([torch.arange(k * 16, (k + 1) * 16) for k in range(rank, 8, world)])
rollout = tp.Rollout(query_responses[local], context_length, logprobs[local], values[local], rewards[local])
rngs = tp.virtual_rank_rngs(args.seed, rank, world, sizes.virtual_ranks)
indices = tp.minibatch_indices(rngs, sizes.group, args.ppo.nminibatches, args.ppo.noptepochs)
whitened = np.zeros((2, 2, 128, 2, length))  # epoch, minibatch, episode, (reward, advantage), token
for epoch in range(2):
    for k in range(2):
        rows = torch.from_numpy(indices[epoch, k])
        w_rewards, w_advantages, _ = tp.minibatch_advantages(rollout.rewards[rows], rollout.values[rows], args.ppo,
                                                             sizes.whiten_group)
        whitened[epoch, k, local[rows], 0], whitened[epoch, k, local[rows], 1] = w_rewards, w_advantages
policy = PolicyWithValueHead(tiny_gpt2(seed=0))
optimizer = make_optimizer(list(policy.parameters()), 1e-3, True)
trained = distributed.data_parallel(policy, accelerator)
stats = tp.ppo_update(trained, optimizer, rollout, torch.from_numpy(indices), sizes, args.ppo, 0.7, 50257)
stats = tp.reduce_stats(stats.local(), accelerator)
np.save(f"{{out}}/whitened{{rank}}.npy", whitened)
json.dump(stats, open(f"{{out}}/stats{{rank}}.json", "w"))
if rank == 0:
    np.save(f"{{out}}/rewards.npy", rewards.numpy())
    np.save(f"{{out}}/values.npy", values.numpy())
"""


def oai_ranks_reference(rewards: np.ndarray, values: np.ndarray, seed: int) -> tuple[np.ndarray, dict]:
    """What OAI's 8 ranks of 16 episodes compute (2 epochs x 2 minibatches): each rank permutes its own rows with
    NumPy seeded seed + rank * 100003, whitens each minibatch alone; moments averaged over ranks and steps."""
    whitened = np.zeros((2, 2, 128, 2, rewards.shape[1]))
    moments = {"ppo/returns/mean": 0.0, "ppo/returns/var": 0.0, "ppo/val/mean": 0.0, "ppo/val/var": 0.0}
    for rank in range(8):
        rng = np.random.RandomState(seed + rank * 100003)
        for epoch in range(2):
            order = rank * 16 + rng.permutation(16)
            for k in range(2):
                rows = order[k * 8 : (k + 1) * 8]
                w_rewards = np_whiten(rewards[rows], shift_mean=False)
                advantages, returns = np_gae(w_rewards, values[rows], 1.0, 0.95)
                whitened[epoch, k, rows, 0], whitened[epoch, k, rows, 1] = w_rewards, np_whiten(advantages)
                for name, x in (("returns", returns), ("val", values[rows].astype(np.float64))):
                    moments[f"ppo/{name}/mean"] += x.mean() / 32
                    moments[f"ppo/{name}/var"] += x.var() / 32
    return whitened, moments


@pytest.mark.slow
def test_one_two_and_four_processes_log_oai_eight_rank_whitening(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(_LAUNCHER.format(repo=str(REPO)))
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    env.pop("WORLD_SIZE", None)
    runs = {}
    for world in (1, 2, 4):
        out = tmp_path / str(world)
        out.mkdir()
        if world == 1:  # one process: in this one (its imports are done)
            with one_intra_op_thread(), pytest.MonkeyPatch.context() as mp:
                mp.setattr(sys, "argv", [str(launcher), str(out)])
                runpy.run_path(str(launcher), run_name="__main__")
        else:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
            command = [*torchrun, "--master_port", str(free_port()), str(launcher), str(out)]
            run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            assert run.returncode == 0, run.stderr[-5000:]
        stats = [json.loads((out / f"stats{r}.json").read_text()) for r in range(world)]
        assert all(s == stats[0] for s in stats)  # every process logs the reduced statistics
        runs[world] = {"whitened": sum(np.load(out / f"whitened{r}.npy") for r in range(world)), "stats": stats[0]}
    rewards, values = np.load(tmp_path / "1" / "rewards.npy"), np.load(tmp_path / "1" / "values.npy")
    whitened, moments = oai_ranks_reference(rewards, values, Args().seed)
    for world, run in runs.items():
        # every episode whitened with the same 7 others as in OAI's rank, at every PPO step
        np.testing.assert_allclose(run["whitened"], whitened, rtol=0, atol=2e-5, err_msg=f"{world} processes")
        for key, value in moments.items():
            assert run["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (world, key)
        # the whole update (losses, clip fractions, entropy) agrees across process counts: the same gradient steps
        for key, value in runs[1]["stats"].items():
            assert run["stats"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (world, key)
