"""train_policy.py: the inline algorithm (rewards, GAE, whitening, PPO losses, KL control) and tiny runs. The
response truncation and filter (tasks.py) are tested in tests/test_tasks.py."""

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import train_policy
from lm_human_preference_details import distributed
from lm_human_preference_details.cli import parse_args
from lm_human_preference_details.modeling import PolicyWithValueHead, RewardModel
from lm_human_preference_details.ppo_plumbing import (
    DivergenceWatch,
    check_reward_model_task,
    print_summary,
    progress_text,
    run_summary,
)
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.sizes import derive_sizes
from lm_human_preference_details.tasks import TaskHParams, truncate_response
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.planted import REPO, free_port, without_gpus
from train_policy import (
    AdaptiveKLController,
    Args,
    FixedKLController,
    PpoHParams,
    RewardHParams,
    compute_advantages,
    compute_rewards,
    main,
    minibatch_advantages,
    minibatch_indices,
    ppo_losses,
    task_presets,
    virtual_rank_rngs,
    whiten,
)

PAD = 50257

# spec §4.1: OAI's policy metric names (train_policy.py#L199-L261)
OAI_POLICY_METRICS = {
    "objective/kl",
    "objective/kl_coef",
    "objective/entropy",
    "objective/score",
    "objective/score_total",
    "ppo/loss/policy",
    "ppo/loss/value",
    "ppo/loss/total",
    "ppo/policy/entropy",
    "ppo/policy/approxkl",
    "ppo/policy/clipfrac",
    "ppo/returns/mean",
    "ppo/returns/var",
    "ppo/val/vpred",
    "ppo/val/error",
    "ppo/val/clipfrac",
    "ppo/val/mean",
    "ppo/val/var",
    "ppo/val/var_explained",
    "elapsed/updates",
    "elapsed/steps/serial",
    "elapsed/steps/total",
    "elapsed/episodes",
    "elapsed/fps",
    "elapsed/time",
}


pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------- algorithm helpers (spec §5 test vectors)


def test_compute_rewards_matches_tv5():
    ref_logprobs = torch.tensor([[-3.3213, -4.9980, -3.8690]])
    logprobs = torch.tensor([[-3.6528, -5.0406, -3.2339]])
    last_token = torch.tensor([2])  # the score goes to the last token (spec P4)
    rewards, non_score_reward, kl = compute_rewards(torch.tensor([0.4]), logprobs, ref_logprobs, 0.15, "k1", last_token)
    torch.testing.assert_close(kl, torch.tensor([[-0.3315, -0.0426, 0.6351]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(non_score_reward, torch.tensor([[0.049725, 0.00639, -0.095265]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rewards, torch.tensor([[0.049725, 0.00639, 0.304735]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kl, expected", [(0.0, 0.148464), (3.0, 0.148464), (6.0, 0.15), (7.0, 0.15128), (12.0, 0.151536), (100.0, 0.151536)]
)
def test_adaptive_kl_controller_matches_tv7(kl, expected):
    controller = AdaptiveKLController(0.15, target=6.0, horizon=10000)
    controller.update(kl, n_steps=512)
    assert controller.value == pytest.approx(expected, abs=1e-6)


def test_adaptive_kl_controller_compounds_over_updates():
    controller = AdaptiveKLController(0.15, target=6.0, horizon=10000)
    for _ in range(3):
        controller.update(12.0, n_steps=512)
    assert controller.value == pytest.approx(0.15465534698, abs=1e-9)


def test_fixed_kl_controller_keeps_value():
    controller = FixedKLController(0.03)
    controller.update(100.0, n_steps=32)
    assert controller.value == 0.03


def test_compute_advantages_matches_tv9():
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.2, 0.3]])
    advantages, returns = compute_advantages(rewards, values, 1.0, 0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.82675, 0.765, 0.7]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.tensor([[0.92675, 0.965, 1.0]]), atol=1e-6, rtol=0)


def test_compute_advantages_matches_discounted_loop_per_row():
    rewards, values = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    advantages, _ = compute_advantages(rewards, values, gamma, lam)
    # A_t = sum_k (gamma*lam)^k delta_{t+k}, delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], 1)
    deltas = rewards + gamma * next_values - values
    expected = torch.stack([sum((gamma * lam) ** (k - t) * deltas[:, k] for k in range(t, 5)) for t in range(5)], 1)
    torch.testing.assert_close(advantages, expected)


def test_closing_table_and_progress_text_name_the_figures_and_where_the_outputs_went():
    history = [
        {"objective/score": -1.0, "objective/kl": 0.0, "objective/kl_coef": 0.15, "elapsed/episodes": 32},
        {"objective/score": 0.5, "objective/kl": 2.25, "objective/kl_coef": 0.14, "elapsed/episodes": 64},
    ]
    history[1]["elapsed/time"] = 6.2
    args = task_presets()["sentiment"]
    console = Console(record=True, width=160)
    print_summary(console, args, run_summary(history, 0, 2, 0.1234, None), "me/policy")
    text = console.export_text()
    assert "policy training done" in text and "2 (64 episodes, 6 s)" in text
    assert "objective/score (update 0 -> 1) │ -1.000 -> 0.500" in text and "0.000 -> 2.250" in text
    assert "kl_coef (update 0 -> after 1)   │ 0.1500 -> 0.1234" in text and "diverged" not in text
    assert args.run.output_dir in text and f"{args.run.output_dir}/tb" in text and "me/policy" in text
    # resumed at update 5: every start value is the resume point's (kl_coef too, not --rewards.kl_coef)
    history[0]["objective/kl_coef"] = 0.1444
    summary = run_summary(history, 5, 10, 0.1234, {"update": 6, "reason": "objective/kl stayed above 60 nats"})
    console = Console(record=True, width=200)
    print_summary(console, args, summary, None)
    text = console.export_text()
    assert "2 of 10, resumed at update 5" in text and "objective/score (update 5 -> 6)" in text
    assert "kl_coef (update 5 -> after 6)" in text and "0.1444 -> 0.1234" in text and "0.1500" not in text
    assert "at update 6: objective/kl stayed above 60 nats" in text
    assert progress_text({"objective/score": 0.5, "objective/kl": -0.0001}) == "score 0.500 kl 0.000"  # never -0.000
    assert progress_text({"objective/score": 0.5, "objective/kl": 1.0, "objective/gold_score": 0.25}).endswith(
        "kl 1.000 gold 0.250"
    )


def test_divergence_watch_reports_a_kl_or_a_pass_rate_collapse_that_lasts():
    args = task_presets()["sentiment"]  # limit: 10 x the KL target 6 = 60 nats
    args.run.divergence_updates, args.ppo.lr = 3, 0.1
    watch = DivergenceWatch(args)

    def run(kls: list[float], rates: list[float]) -> dict[int, str]:
        lines = {
            u: watch.update({"objective/kl": kl, "debug/filter_pass_rate": r}, u)
            for u, (kl, r) in enumerate(zip(kls, rates))
        }
        return {u: line for u, line in lines.items() if line}

    # a 2-update spike is not divergence; 3 updates above 60 nats are, reported once
    fired = run([5, 70, 80, 10, 61, 62, 120, 130], [0.6] * 8)
    assert list(fired) == [6] and watch.diverged["update"] == 6
    assert "objective/kl stayed above 60 nats (10 x the KL target 6) for 3 updates (now 120.0)" in fired[6]
    assert "--ppo.lr 0.1" in fired[6] and "--rewards.kl_coef 0.15" in fired[6] and "exit status 3" in fired[6]
    # a pass rate at 0 from the start is the filter's flags (the pass-rate warning), not divergence
    watch = DivergenceWatch(args)
    assert run([1.0] * 6, [0.0] * 6) == {}
    # a pass rate that falls to 0 and stays there for 3 updates is a collapse
    watch = DivergenceWatch(args)
    fired = run([1.0] * 7, [0.5, 0.7, 0.0, 0.0, 0.2, 0.0, 0.0])
    assert fired == {} and watch.update({"objective/kl": 1.0, "debug/filter_pass_rate": 0.0}, 7)
    assert (
        "no response passed the truncation filter for 3 updates (after a pass rate of 0.700 at update 1)"
        in (watch.diverged["reason"])
    )
    # --divergence_kl sets the limit; --divergence_updates 0 turns detection off
    args.run.divergence_kl = 20.0
    watch = DivergenceWatch(args)
    assert list(run([25, 25, 25], [0.5] * 3)) == [2] and "above 20 nats (--divergence_kl)" in watch.diverged["reason"]
    args.run.divergence_updates = 0
    watch = DivergenceWatch(args)
    assert run([1e6] * 20, [0.0] * 20) == {} and watch.diverged is None


TV6_INPUT = [[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]]
TV6_KEEP_MEAN = [
    [0.05080712, 0.4381051, 0.8254035],
    [1.2127019, 1.6000004, 1.9872988],
    [2.3745968, 2.7618952, 3.1491938],
]
TV6_SHIFT_MEAN = [
    [-1.5491932, -1.1618949, -0.7745966],
    [-0.3872983, 0.0, 0.3872983],
    [0.7745966, 1.1618949, 1.5491932],
]
TV6_UNBIASED_KEEP_MEAN = [[0.1394, 0.5046, 0.8697], [1.2349, 1.6000, 1.9651], [2.3303, 2.6954, 3.0606]]


def test_whiten_keep_mean_matches_tv6():
    out = whiten(torch.tensor(TV6_INPUT), shift_mean=False)
    torch.testing.assert_close(out, torch.tensor(TV6_KEEP_MEAN), rtol=0, atol=1e-5)


def test_whiten_shift_mean_matches_tv6():
    out = whiten(torch.tensor(TV6_INPUT), shift_mean=True)
    torch.testing.assert_close(out, torch.tensor(TV6_SHIFT_MEAN), rtol=0, atol=1e-5)
    assert abs(out.mean().item()) < 1e-6
    assert abs(out.var(correction=0).item() - 1.0) < 1e-5


def test_whiten_uses_population_not_unbiased_variance():
    values = torch.tensor(TV6_INPUT)
    unbiased = (values - values.mean()) * torch.rsqrt(values.var(correction=1) + 1e-8) + values.mean()
    torch.testing.assert_close(unbiased, torch.tensor(TV6_UNBIASED_KEEP_MEAN), rtol=0, atol=1e-4)
    out = whiten(values, shift_mean=False)
    assert (out - torch.tensor(TV6_UNBIASED_KEEP_MEAN)).abs().max().item() > 0.05


def test_whiten_constant_input_is_finite():
    out = whiten(torch.full((4, 3), 2.5))
    assert torch.equal(out, torch.zeros(4, 3))


def test_whiten_groups_use_population_moments_per_group():
    values = torch.randn(8, 3, dtype=torch.float64) * 3 + torch.arange(8, dtype=torch.float64)[:, None]
    whitened = whiten(values, group_size=4)
    for rows in (slice(0, 4), slice(4, 8)):
        group = values[rows].numpy()
        expected = (group - group.mean()) / np.sqrt(group.var() + 1e-8)  # numpy var: population (ddof=0)
        np.testing.assert_allclose(whitened[rows].numpy(), expected, atol=1e-10)
    kept = whiten(values, group_size=4, shift_mean=False)
    torch.testing.assert_close(kept[:4].mean(), values[:4].mean())
    torch.testing.assert_close(kept[4:].mean(), values[4:].mean())
    # one group = OAI's whiten over the whole per-rank tensor
    torch.testing.assert_close(whiten(values, group_size=8), whiten(values))


def test_whiten_group_matches_tv6():
    values = torch.tensor([[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]])
    expected = torch.tensor(
        [[0.05080712, 0.4381051, 0.8254035], [1.2127019, 1.6000004, 1.9872988], [2.3745968, 2.7618952, 3.1491938]]
    )
    torch.testing.assert_close(whiten(values, group_size=3, shift_mean=False), expected, atol=1e-5, rtol=0)


def test_ppo_losses_hand_computed_example():
    # ratio [1.5, 0.5], advantages 1: the first ratio is clipped to 1.2, the second (0.5 < 0.8) is not, since
    # max(-A*ratio, -A*clip) keeps the pessimistic -0.5. Value: vpred 0.5 clipped to 0.2 (loss 0.64 > 0.25).
    logprobs = torch.zeros(1, 2)
    new_logprobs = torch.log(torch.tensor([[1.5, 0.5]]))
    values, vpred = torch.zeros(1, 2), torch.tensor([[0.5, 0.1]])
    advantages, returns = torch.ones(1, 2), torch.ones(1, 2)
    out = ppo_losses(new_logprobs, vpred, logprobs, values, advantages, returns, 0.2, 0.2, 0.1)
    expected = {
        "loss/policy": (-1.2 - 0.5) / 2,
        "policy/clipfrac": 0.5,
        "loss/value": 0.5 * (0.64 + 0.81) / 2,
        "val/clipfrac": 0.5,
        "loss/total": (-1.2 - 0.5) / 2 + 0.1 * 0.5 * (0.64 + 0.81) / 2,
        "policy/approxkl": 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2,
        "val/vpred": 0.3,
        "val/error": (0.25 + 0.81) / 2,
    }
    for key, value in expected.items():
        assert out[key].item() == pytest.approx(value, abs=1e-6), key
    torch.testing.assert_close(out["ratio"], torch.tensor([[1.5, 0.5]]))


def test_ppo_losses_gradient_vanishes_when_ratio_clipped():
    new_logprobs = torch.log(torch.tensor([[1.5]])).requires_grad_()
    out = ppo_losses(
        new_logprobs,
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.zeros(1, 1),
        0.2,
        0.2,
        0.1,
    )
    out["loss/total"].backward()
    assert new_logprobs.grad.abs().item() == 0.0


# ---------------------------------------------------------------- virtual ranks (spec D4)


def test_minibatch_indices_deal_each_virtual_rank_its_own_permutations():
    # process 1 of 2 with 3 virtual ranks of 8 episodes stands for OAI ranks 1, 3, 5 of 6; 2 minibatches, 2 epochs
    indices = minibatch_indices(virtual_rank_rngs(5, 1, 2, 3), group_size=8, nminibatches=2, noptepochs=2)
    assert indices.shape == (2, 2, 12)
    state = np.random.get_state()
    for g, oai_rank in enumerate((1, 3, 5)):
        # OAI rank r: NumPy seeded seed + r * 100003, one permutation of its own batch per epoch, cut in two
        np.random.seed(5 + oai_rank * 100003)
        for epoch in range(2):
            permutation = np.random.permutation(8)
            for k in range(2):
                block = indices[epoch, k, 4 * g : 4 * (g + 1)]
                assert block.tolist() == (8 * g + permutation[4 * k : 4 * (k + 1)]).tolist(), (g, epoch, k)
    np.random.set_state(state)
    for epoch in range(2):  # each epoch's minibatches use every row once
        assert sorted(indices[epoch].ravel().tolist()) == list(range(24))


def test_one_virtual_rank_draws_one_permutation_of_the_batch_per_epoch():
    # the default (whiten_group_size None): as before and as OAI, np.random.permutation(batch) per epoch
    indices = minibatch_indices(virtual_rank_rngs(1, 0, 1, 1), group_size=16, nminibatches=2, noptepochs=3)
    rng = np.random.RandomState(1)
    assert [epoch.ravel().tolist() for epoch in indices] == [rng.permutation(16).tolist() for _ in range(3)]


def test_virtual_rank_whitens_the_same_episodes_every_epoch():
    generator = torch.Generator().manual_seed(0)
    # the episodes' reward levels differ, so which episodes share a whitening group changes the result
    rewards = torch.randn(16, 5, generator=generator, dtype=torch.float64) + torch.arange(16.0)[:, None] / 4
    values = torch.randn(16, 5, generator=generator, dtype=torch.float64)
    ppo = PpoHParams()

    def per_episode(orders):
        """Whitened advantages of every episode in each epoch, with minibatch rows `orders[epoch]`."""
        results = []
        for order in orders:
            order = torch.as_tensor(order)
            _, advantages, _ = minibatch_advantages(rewards[order], values[order], ppo, whiten_group=8)
            results.append(torch.empty_like(advantages).index_copy_(0, order, advantages))
        return results

    # 2 virtual ranks of 8 episodes, 1 minibatch, 4 epochs: each epoch whitens rows 0-7 and 8-15 apart
    epochs = per_episode(minibatch_indices(virtual_rank_rngs(1, 0, 1, 2), 8, 1, 4)[:, 0])
    for later in epochs[1:]:
        torch.testing.assert_close(later, epochs[0])
    # independently: OAI's whiten (population moments, reward mean kept) on each block, GAE, whiten advantages
    for block in (slice(0, 8), slice(8, 16)):
        r = rewards[block].numpy()
        r = (r - r.mean()) / np.sqrt(r.var() + 1e-8) + r.mean()
        a = compute_advantages(torch.from_numpy(r), values[block], 1.0, 0.95)[0].numpy()
        np.testing.assert_allclose(epochs[0][block].numpy(), (a - a.mean()) / np.sqrt(a.var() + 1e-8), atol=1e-10)
    # the old grouping, consecutive rows of a permutation of the whole batch, regroups episodes every epoch
    rng = np.random.RandomState(1)
    regrouped = per_episode([rng.permutation(16) for _ in range(2)])
    assert not torch.allclose(regrouped[0], regrouped[1])


def test_derive_sizes_virtual_ranks_reproduce_oai_rank_sizes():
    args = Args()
    args.ppo = dataclasses.replace(args.ppo, batch_size=512, nminibatches=2, whiten_group_size=64)
    one_gpu = derive_sizes(args, world=1)
    assert (one_gpu.batch, one_gpu.virtual_ranks, one_gpu.group, one_gpu.whiten_group) == (512, 8, 64, 32)
    args.ppo.whiten_group_size = 0
    oai = derive_sizes(args, world=8)  # OAI: 8 ranks of 64 episodes, minibatches of 32
    assert (oai.batch, oai.virtual_ranks, oai.group, oai.whiten_group) == (64, 1, 64, 32)


_VIRTUAL_RANKS_LAUNCHER = """
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
out, group = sys.argv[1], 16
accelerator = distributed.make_accelerator()
rank, world = accelerator.process_index, accelerator.num_processes
args = tp.Args()
args.ppo.batch_size, args.ppo.nminibatches, args.ppo.noptepochs, args.ppo.gradient_accumulation_steps = 32, 2, 3, 2
args.ppo.whiten_group_size = group if world == 1 else 0  # 1 process: 2 virtual ranks; 2 processes: one rank each
sizes = derive_sizes(args, world)
# one global rollout batch; rows [r * 16, (r + 1) * 16) are the episodes of (virtual) rank r
gen = torch.Generator().manual_seed(0)
context_length, length = 5, 6
query_responses = torch.randint(0, 50257, (32, context_length + length), generator=gen)
logprobs = -3 * torch.rand(32, length, generator=gen)
values = torch.randn(32, length, generator=gen)
rewards = 0.1 * torch.randn(32, length, generator=gen) + torch.arange(32.0)[:, None] / 16
local = torch.arange(rank * sizes.batch, (rank + 1) * sizes.batch)
rollout = tp.Rollout(query_responses[local], context_length, logprobs[local], values[local], rewards[local])
indices = tp.minibatch_indices(tp.virtual_rank_rngs(args.seed, rank, world, sizes.virtual_ranks), group, 2, 3)
whitened = np.zeros((3, 2, 32, 2, length))  # epoch, minibatch, episode, (reward, advantage), token
for epoch in range(3):
    for k in range(2):
        rows = torch.from_numpy(indices[epoch, k])
        w_rewards, w_advantages, _ = tp.minibatch_advantages(rewards[local][rows], values[local][rows], args.ppo,
                                                             sizes.whiten_group)
        whitened[epoch, k, local[rows], 0], whitened[epoch, k, local[rows], 1] = w_rewards, w_advantages
policy = PolicyWithValueHead(tiny_gpt2(seed=0))
optimizer = make_optimizer(list(policy.parameters()), 1e-3, True)
trained = distributed.data_parallel(policy, accelerator)
stats = tp.ppo_update(trained, optimizer, rollout, torch.from_numpy(indices), sizes, args.ppo, 0.7, 50257)
stats = tp.reduce_stats(stats.local(), accelerator)
np.save(f"{{out}}/whitened{{rank}}.npy", whitened)
json.dump(stats, open(f"{{out}}/stats{{rank}}.json", "w"))
torch.save(policy.state_dict(), f"{{out}}/policy{{rank}}.pt")
"""


@pytest.mark.slow
def test_one_process_with_two_virtual_ranks_reproduces_two_processes(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(_VIRTUAL_RANKS_LAUNCHER.format(repo=str(REPO)))
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    env.pop("WORLD_SIZE", None)
    results = {}
    for name, prefix in (("one", [sys.executable]), ("two", [sys.executable, "-m", "torch.distributed.run"])):
        out = tmp_path / name
        out.mkdir()
        if name == "two":
            prefix = [*prefix, "--nproc_per_node", "2", "--master_port", str(free_port())]
        run = subprocess.run([*prefix, str(launcher), str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-5000:]
        ranks = 1 if name == "one" else 2
        results[name] = {
            "whitened": sum(np.load(out / f"whitened{r}.npy") for r in range(ranks)),
            "stats": [json.loads((out / f"stats{r}.json").read_text()) for r in range(ranks)],
            "policy": torch.load(out / "policy0.pt"),
        }
    one, two = results["one"], results["two"]
    # the same episodes whitened together at every PPO step: rewards and advantages equal episode by episode
    np.testing.assert_allclose(one["whitened"], two["whitened"], rtol=0, atol=1e-6)
    in_minibatch = np.abs(one["whitened"][:, :, :, 1]).sum(-1) > 0  # (epoch, minibatch, episode)
    assert (in_minibatch.sum(1) == 1).all()  # every epoch trains every episode in exactly one minibatch
    # the update's statistics (losses, clip fractions, per-rank moments averaged) and the trained weights
    assert two["stats"][0] == two["stats"][1]
    for key, value in two["stats"][0].items():
        assert one["stats"][0][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for key, value in two["policy"].items():
        torch.testing.assert_close(one["policy"][key], value, rtol=1e-5, atol=1e-6, msg=key)


# ---------------------------------------------------------------- configuration and CLI


def test_oai_presets_match_launch_settings():
    presets = task_presets()
    for name in ("sentiment", "descriptiveness"):
        args = presets[name]
        rewards, ppo = args.rewards, args.ppo
        assert (rewards.kl_coef, rewards.adaptive_kl.enabled, rewards.adaptive_kl.target) == (0.15, True, 6.0)
        assert (ppo.batch_size, ppo.lr, ppo.whiten_rewards, args.task.query_length) == (512, 1e-5, True, 64)
    for name, kl_coef in (("tldr", 0.03), ("cnndm", 0.01)):
        args = presets[name]
        assert (args.rewards.kl_coef, args.rewards.adaptive_kl.enabled) == (kl_coef, False)
        assert (args.ppo.batch_size, args.ppo.lr, args.ppo.whiten_rewards) == (32, 2e-6, False)
        assert args.task.response_length == 75 and args.task_id == name
    assert presets["cnndm"].task.temperature == 0.5
    assert presets["sentiment"].task is not presets["descriptiveness"].task


def test_cli_task_preset_can_be_overridden():
    task, args = parse_args(Args, task_presets(), "sentiment", "", argv=["--task", "tldr", "--rewards.kl_coef", "0.05"])
    assert task == "tldr" and args.task_id == "tldr"
    assert args.rewards.kl_coef == 0.05 and not args.rewards.adaptive_kl.enabled and args.task.query_length == 500
    argv = ["--ppo.whiten_group_size", "64", "--no_use_tensorflow_adam"]
    _, args = parse_args(Args, task_presets(), "sentiment", "", argv=argv)
    assert args.ppo.whiten_group_size == 64 and not args.use_tensorflow_adam and args.rewards.adaptive_kl.enabled


def test_args_every_field_has_a_docstring():
    with open(os.path.join(os.path.dirname(__file__), "..", "train_policy.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {"AdaptiveKLParams", "RewardHParams", "PpoHParams", "Args"}
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in names]
    assert len(classes) == 4
    for cls in classes:
        for field, following in zip(cls.body, cls.body[1:] + [None]):
            if isinstance(field, ast.AnnAssign):
                is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                assert is_doc, f"{cls.name}.{field.target.id} has no docstring (tyro --help text)"


# ---------------------------------------------------------------- tiny end-to-end runs of main()


def tiny_task(query_file: str, preset: str = "sentiment") -> TaskHParams:
    """A preset's task shrunk to 16-token queries and 8-token responses of the test corpus."""
    task = task_presets()[preset].task
    shrunk = dict(query_length=16, response_length=8, start_text=None, end_text=None, truncate_after=2)
    return dataclasses.replace(task, query_dataset=query_file, truncate_token=13, truncate_text=None, **shrunk)


def save_reward_model(path, model_dir: str, task: TaskHParams, **metadata_overrides) -> str:
    """A random reward model on the tiny trunk, trained (as saved by train_reward.py) for `task`."""
    tokenizer = load_tokenizer(model_dir)
    metadata = {
        "base_model": model_dir,
        "tokenizer": model_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "task": dataclasses.asdict(task),
        **metadata_overrides,
    }
    torch.manual_seed(0)
    RewardModel.from_base(model_dir).save(str(path), metadata)
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir, query_file):
    return save_reward_model(tmp_path_factory.mktemp("reward"), tiny_model_dir, tiny_task(query_file))


def tiny_args(output_dir, model_dir: str, rm_dir: str, query_file: str, preset: str = "sentiment", **ppo) -> Args:
    """A preset shrunk to a tiny run: 8-episode updates of 16-token queries and 8-token responses."""
    args = task_presets()[preset]
    args.base_model, args.run.output_dir = model_dir, str(output_dir)
    args.run.log_interval, args.run.save_interval, args.run.print_samples = 1, 0, 2
    args.task = tiny_task(query_file, preset)
    args.rewards.trained_model = rm_dir
    args.ppo = dataclasses.replace(args.ppo, **{"total_episodes": 16, "batch_size": 8, **ppo})
    return args


@pytest.fixture(scope="module")
def sentiment_run(tmp_path_factory, tiny_model_dir, reward_model_dir, query_file):
    output_dir = tmp_path_factory.mktemp("policy")
    history = main(tiny_args(output_dir, tiny_model_dir, reward_model_dir, query_file))
    return output_dir, history


@pytest.mark.floor
def test_main_logs_exactly_oai_metric_names(sentiment_run):
    _, history = sentiment_run
    assert len(history) == 2
    for stats in history:
        assert {key for key in stats if not key.startswith("debug/")} == OAI_POLICY_METRICS
        assert all(math.isfinite(value) for value in stats.values())
    assert history[1]["elapsed/episodes"] == 16 and history[1]["elapsed/steps/total"] == 16 * 8
    assert 0.0 <= history[0]["ppo/policy/clipfrac"] <= 1.0 and history[0]["ppo/returns/var"] >= 0.0


def test_main_first_minibatch_ratio_is_one(sentiment_run):
    _, history = sentiment_run
    # rollout logprobs come from the sampling pass; the first PPO forward sees the same weights
    assert history[0]["debug/first_minibatch_ratio_max_abs_dev"] < 1e-5
    assert history[0]["debug/ratio_max"] > history[0]["debug/ratio_min"]


def test_main_adaptive_kl_uses_the_measured_kl(sentiment_run):
    _, history = sentiment_run
    assert history[0]["objective/kl_coef"] == 0.15
    controller = AdaptiveKLController(0.15, target=6.0, horizon=10000)
    controller.update(history[0]["objective/kl"], n_steps=8)
    assert history[1]["objective/kl_coef"] == pytest.approx(controller.value, rel=1e-12)
    assert history[1]["objective/kl_coef"] != 0.15


def test_main_lr_anneals_linearly_per_update(sentiment_run):
    _, history = sentiment_run
    assert [stats["debug/lr"] for stats in history] == pytest.approx([1e-5, 0.5e-5])


def test_main_saves_a_loadable_policy(sentiment_run, tiny_model_dir):
    output_dir, _ = sentiment_run
    trained = AutoModelForCausalLM.from_pretrained(output_dir)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(trained.transformer.h[0].attn.c_attn.weight, initial.transformer.h[0].attn.c_attn.weight)
    assert set(load_file(os.path.join(output_dir, "value_head.safetensors"))) == {"weight", "bias"}
    assert load_tokenizer(str(output_dir)).pad_token_id == PAD
    assert AutoTokenizer.from_pretrained(output_dir).pad_token_id == 50256  # saved for batched generation
    with open(os.path.join(output_dir, "args.json"), encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["ppo"]["batch_size"] == 8 and saved["task_id"] == "sentiment"
    assert os.path.isdir(os.path.join(output_dir, "tb"))


def test_main_fixed_kl_preset_keeps_kl_coef(tmp_path, tiny_model_dir, query_file):
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(query_file, "tldr"))
    history = main(tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file, preset="tldr"))
    assert [stats["objective/kl_coef"] for stats in history] == [0.03, 0.03]


def policy_state(output_dir) -> dict[str, torch.Tensor]:
    """Saved LM and value-head tensors of a policy directory."""
    state = {f"lm.{k}": v for k, v in load_file(os.path.join(output_dir, "model.safetensors")).items()}
    value_head = load_file(os.path.join(output_dir, "value_head.safetensors"))
    state.update({f"value_head.{k}": v for k, v in value_head.items()})
    return state


def test_main_rollout_in_micro_batches_tracks_the_whole_batch(
    tmp_path, tiny_model_dir, reward_model_dir, query_file, monkeypatch
):
    # --rollout_micro_batch_size 3: the 8 episodes decode and meet the reference policy 3, 3 and 2 at a time, each
    # with its own random numbers: the same responses, so the same update up to float rounding
    rows = {"sampled": [], "referenced": []}
    sample, forward = train_policy.modeling.sample, PolicyWithValueHead.forward
    monkeypatch.setattr(
        train_policy.modeling, "sample", lambda *a, **k: rows["sampled"].append(k["max_rows"]) or sample(*a, **k)
    )

    def recording_forward(self, query_responses, *args, **kwargs):
        if not torch.is_grad_enabled():
            rows["referenced"].append(query_responses.shape[0])
        return forward(self, query_responses, *args, **kwargs)

    monkeypatch.setattr(PolicyWithValueHead, "forward", recording_forward)
    common = dict(total_episodes=8, lr=1e-3)
    whole = main(tiny_args(tmp_path / "whole", tiny_model_dir, reward_model_dir, query_file, **common))
    assert rows == {"sampled": [8], "referenced": [8]}
    chunked_args = tiny_args(tmp_path / "chunked", tiny_model_dir, reward_model_dir, query_file, **common)
    chunked_args.run.rollout_micro_batch_size = 3
    chunked = main(chunked_args)
    assert rows == {"sampled": [8, 3], "referenced": [8, 3, 3, 2]}
    for key in ("objective/score", "objective/kl", "objective/entropy", "debug/num_eos", "ppo/loss/total"):
        assert chunked[0][key] == pytest.approx(whole[0][key], abs=1e-5), key


def test_main_gradient_accumulation_gives_the_same_update(tmp_path, tiny_model_dir, reward_model_dir, query_file):
    common = dict(total_episodes=8, lr=1e-3)
    single = main(tiny_args(tmp_path / "single", tiny_model_dir, reward_model_dir, query_file, **common))
    accumulated_args = tiny_args(tmp_path / "accum", tiny_model_dir, reward_model_dir, query_file, **common)
    accumulated_args.ppo.gradient_accumulation_steps = 2
    accumulated = main(accumulated_args)
    for key in ("ppo/loss/total", "ppo/loss/value", "ppo/policy/approxkl", "ppo/returns/var"):
        assert accumulated[0][key] == pytest.approx(single[0][key], abs=1e-6), key
    single_state, accumulated_state = policy_state(tmp_path / "single"), policy_state(tmp_path / "accum")
    initial = {f"lm.{k}": v for k, v in load_file(os.path.join(tiny_model_dir, "model.safetensors")).items()}
    moved = max((single_state[k] - initial[k]).abs().max().item() for k in initial if k in single_state)
    assert moved > 1e-4  # the update is not trivially zero
    for key, value in single_state.items():
        torch.testing.assert_close(accumulated_state[key], value, atol=1e-6, rtol=0, msg=key)


def test_main_gradient_checkpointing_and_bf16_track_the_plain_update(
    tmp_path, tiny_model_dir, reward_model_dir, query_file
):
    def train(name: str, **flags) -> tuple[dict, dict]:
        args = tiny_args(tmp_path / name, tiny_model_dir, reward_model_dir, query_file, total_episodes=8, lr=1e-3)
        history = main(with_run(args, **flags))
        return history[0], policy_state(tmp_path / name)

    (plain, plain_state), (checkpointed, checkpointed_state) = (
        train("plain"),
        train("ckpt", gradient_checkpointing=True),
    )
    bf16, bf16_state = train("bf16", bf16=True)
    timing = ("elapsed/fps", "elapsed/time", "debug/time/")
    # gradient checkpointing: the same update (measured: bit-identical on CPU, also over 4 updates; tolerance 1e-6)
    for key, value in plain.items():
        if not key.startswith(timing):
            assert checkpointed[key] == pytest.approx(value, abs=1e-6), key
    for key, value in plain_state.items():
        torch.testing.assert_close(checkpointed_state[key], value, atol=1e-6, rtol=0, msg=key)
    # bf16 autocast of the PPO forward: the same rollout (sampled in float32, KL penalty from those log-probs), PPO
    # losses within 1e-3 (measured 6e-6)
    for key in ("objective/kl", "objective/entropy", "objective/score"):
        assert bf16[key] == plain[key], key
    for key in ("ppo/loss/total", "ppo/loss/policy", "ppo/loss/value", "ppo/policy/approxkl", "ppo/val/vpred"):
        assert bf16[key] == pytest.approx(plain[key], abs=1e-3), key
    # the ratio's old log-probs come from the loss forward's bf16 arithmetic: the first minibatch's ratio is 1 at
    # float32 level (measured 1.5e-3 when they came from the float32 sampler; float32 run: 2e-6)
    assert bf16["debug/first_minibatch_ratio_max_abs_dev"] < 1e-5
    assert max((bf16_state[key] - value).abs().max().item() for key, value in plain_state.items()) < 1e-2


def test_main_trains_with_virtual_ranks(tmp_path, tiny_model_dir, reward_model_dir, query_file, capsys):
    args = tiny_args(
        tmp_path / "policy", tiny_model_dir, reward_model_dir, query_file, batch_size=16, total_episodes=16
    )
    args.ppo.whiten_group_size = 8  # 2 virtual ranks of 8 episodes in the one process
    history = main(args)
    assert len(history) == 1 and all(math.isfinite(value) for value in history[0].values())
    assert history[0]["debug/first_minibatch_ratio_max_abs_dev"] < 1e-5
    assert "2 x 8 episodes" in capsys.readouterr().out


@pytest.mark.parametrize(
    "ppo, numbers",
    [
        (dict(batch_size=12, nminibatches=5), ("12", "5")),
        (dict(batch_size=8, gradient_accumulation_steps=3), ("8", "3")),
        (dict(batch_size=16, whiten_group_size=6), ("16", "6")),
    ],
)
def test_main_sizes_that_do_not_divide_raise(tmp_path, ppo, numbers):
    args = with_run(Args(), output_dir=str(tmp_path), dry_run=True)
    args.ppo = dataclasses.replace(args.ppo, **ppo)
    with pytest.raises(ValueError) as error:
        main(args)
    assert all(number in str(error.value) for number in numbers)


def test_main_whitening_group_below_eight_raises(tmp_path):
    args = with_run(Args(), output_dir=str(tmp_path), dry_run=True)
    args.ppo = dataclasses.replace(args.ppo, batch_size=8, nminibatches=2)
    with pytest.raises(ValueError, match="at least 8 episodes"):
        main(args)
    args.ppo.whiten_rewards = False
    args.rewards.trained_model = "vader"  # a dry run checks its inputs: a reward with none to check
    assert main(args) == []


def test_main_rejects_reward_model_of_another_tokenizer(tmp_path, tiny_model_dir, query_file):
    rm_dir = save_reward_model(
        tmp_path / "reward",
        tiny_model_dir,
        tiny_task(query_file),
        tokenizer="EleutherAI/pythia-160m",
        tokenizer_fingerprint="0123abcd",
    )
    args = tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file)
    with pytest.raises(ValueError, match="tokenizer mismatch") as error:
        main(args)
    assert "EleutherAI/pythia-160m" in str(error.value) and tiny_model_dir in str(error.value)


def test_main_rejects_reward_model_with_another_pad_id(tmp_path, tiny_model_dir, query_file):
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(query_file), pad_token_id=50259)
    with pytest.raises(ValueError, match="pad id 50259"):
        main(tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file))


def test_main_rejects_reward_model_of_another_task_unless_allowed(tmp_path, tiny_model_dir, query_file):
    # OAI asserts that the reward model's task hyperparameters equal the policy's (train_policy.py#L411)
    other = dataclasses.replace(tiny_task(query_file), response_length=6, truncate_after=3, end_text=".")
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, other)
    args = tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file, total_episodes=8)
    with pytest.raises(ValueError, match="--rewards.allow_task_mismatch") as error:
        main(args)
    message = str(error.value)
    assert (
        "response_length: reward model 6, policy 8" in message and "truncate_after: reward model 3, policy 2" in message
    )
    assert "end_text: reward model '.', policy None" in message and "query_length" not in message
    assert not os.path.exists(tmp_path / "policy" / "args.json")  # stopped before training
    args.rewards.allow_task_mismatch = True
    assert len(main(args)) == 1


def test_reward_model_without_recorded_task_is_a_mismatch(tmp_path, query_file):
    rewards = RewardHParams(trained_model="rm")
    with pytest.raises(ValueError, match="query_length: reward model '<not recorded>', policy 16"):
        check_reward_model_task({}, tiny_task(query_file), rewards)
    assert (
        check_reward_model_task({"task": dataclasses.asdict(tiny_task(query_file))}, tiny_task(query_file), rewards)
        is None
    )
    rewards.allow_task_mismatch = True
    assert "temperature: reward model 1.0, policy 0.7" in check_reward_model_task(
        {"task": {**dataclasses.asdict(tiny_task(query_file)), "temperature": 1.0}}, tiny_task(query_file), rewards
    )


def test_main_warns_when_no_response_passes_the_filter(
    tmp_path, small_vocab_model_dir, reward_model_dir, query_file, capsys
):
    # the policy samples only words, never the truncate token '.': every score is the penalty
    args = tiny_args(tmp_path, small_vocab_model_dir, reward_model_dir, query_file)
    history = main(args)
    assert [stats["debug/filter_pass_rate"] for stats in history] == [0.0, 0.0]
    assert [stats["objective/score"] for stats in history] == [-1.0, -1.0]
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert out.count("warning: the filter pass rate stayed below 0.1") == 2  # every log_interval (1) updates
    for flag in ("--task.truncate_token 13", "--task.truncate_after 2", "--task.response_length 8"):
        assert flag in out


def test_main_raises_on_non_finite_scores(tmp_path, tiny_model_dir, query_file):
    # every response passes the filter without a truncate token, so the NaN score is not replaced
    task = dataclasses.replace(tiny_task(query_file), truncate_token=None, truncate_text=None)
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, task)
    weights = load_file(os.path.join(rm_dir, "model.safetensors"))
    # finite weights (NaN weights are refused at load) whose output overflows: every score is infinite or NaN
    weights["score.weight"] = torch.full_like(weights["score.weight"], 3e38)
    save_file(weights, os.path.join(rm_dir, "model.safetensors"), metadata={"format": "pt"})
    args = tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file, total_episodes=8)
    args.task, args.run.save_interval = task, 1
    with pytest.raises(ValueError, match=r"non-finite scores \(8 entries\), rewards .* at update 0; stopped before"):
        main(args)
    assert not os.path.exists(tmp_path / "policy" / "model.safetensors")  # nothing saved


# ---------------------------------------------------------------- every PPO statistic against its formula


def recorded_ppo_update(monkeypatch, **ppo) -> tuple[dict, list[dict], list[torch.Tensor]]:
    """One real ppo_update of a tiny policy on 32 episodes, rollout log-probs its own; -> the reduced statistics, the
    inputs of every ppo_losses call (float64 copies) and the entropy of every loss forward's full distribution."""
    args = Args()
    args.ppo = dataclasses.replace(args.ppo, batch_size=32, **ppo)
    sizes = derive_sizes(args, 1)
    from tests.conftest import tiny_gpt2

    policy = PolicyWithValueHead(tiny_gpt2(seed=0))
    generator = torch.Generator().manual_seed(0)
    context_length, length, temperature = 4, 5, 0.7
    query_responses = torch.randint(0, 50257, (32, context_length + length), generator=generator)
    with torch.no_grad():
        logits, _ = policy(query_responses, context_length, PAD, temperature)
        logprobs = torch.log_softmax(logits, -1).gather(-1, query_responses[:, context_length:, None])[..., 0]
    values = torch.randn(32, length, generator=generator)  # apart from vpred (0 at first): both clips fire
    # rewards whose level differs between the two halves (virtual ranks), so per-group moments differ from global ones
    rewards = torch.randn(32, length, generator=generator) + torch.arange(32.0)[:, None] / 8
    rollout = train_policy.Rollout(query_responses, context_length, logprobs, values, rewards)
    rngs = virtual_rank_rngs(args.seed, 0, 1, sizes.virtual_ranks)
    indices = torch.from_numpy(minibatch_indices(rngs, sizes.group, args.ppo.nminibatches, args.ppo.noptepochs))
    calls, entropies = [], []
    losses, forward = train_policy.ppo_losses, PolicyWithValueHead.forward

    def recording_losses(*inputs):
        names = ("new_logprobs", "vpred", "logprobs", "values", "advantages", "returns")
        calls.append({name: value.detach().double().clone() for name, value in zip(names, inputs)})
        return losses(*inputs)

    def recording_forward(self, *inputs, **kwargs):
        out = forward(self, *inputs, **kwargs)
        if torch.is_grad_enabled():
            entropies.append(torch.distributions.Categorical(logits=out[0].detach().double()).entropy())
        return out

    monkeypatch.setattr(train_policy, "ppo_losses", recording_losses)
    monkeypatch.setattr(PolicyWithValueHead, "forward", recording_forward)
    optimizer = train_policy.optim.make_optimizer(list(policy.parameters()), 1e-2, True)
    accelerator = distributed.make_accelerator()
    stats = train_policy.ppo_update(policy, optimizer, rollout, indices, sizes, args.ppo, temperature, PAD)
    return train_policy.reduce_stats(stats.local(), accelerator), calls, entropies


def test_ppo_update_logs_every_statistic_by_its_formula(monkeypatch):
    # spec §4.1, D4, D5, P8-P11: an update of 2 epochs x 2 minibatches of 16 episodes, each minibatch 2 micro-batches of
    # 8 (--ppo.gradient_accumulation_steps 2), 2 virtual ranks of 16 episodes (a rank's minibatch of 8 is one
    # micro-batch here), and cliprange 0.1 != cliprange_value 0.3 (their defaults are both 0.2): every ppo/* and
    # debug/ratio* statistic re-derived from the inputs of the loss calls, not from what ppo_losses returned
    cliprange, cliprange_value, vf_coef = 0.1, 0.3, 0.1
    ppo = dict(nminibatches=2, noptepochs=2, gradient_accumulation_steps=2, whiten_group_size=16)
    stats, calls, entropies = recorded_ppo_update(
        monkeypatch, cliprange=cliprange, cliprange_value=cliprange_value, vf_coef=vf_coef, **ppo
    )
    assert len(calls) == len(entropies) == 2 * 2 * 2
    per_call = {key: [] for key in ("policy", "value", "total", "approxkl", "pg_clip", "vf_clip", "vpred", "error")}
    moments = {"returns/mean": [], "returns/var": [], "val/mean": [], "val/var": []}
    ratios = []
    for call in calls:
        diff = (call["new_logprobs"] - call["logprobs"]).numpy()
        ratio = np.exp(diff)
        advantages, vpred, values, returns = (call[k].numpy() for k in ("advantages", "vpred", "values", "returns"))
        pg1, pg2 = -advantages * ratio, -advantages * np.clip(ratio, 1 - cliprange, 1 + cliprange)
        vf1 = (vpred - returns) ** 2
        vf2 = (np.clip(vpred, values - cliprange_value, values + cliprange_value) - returns) ** 2
        per_call["policy"].append(np.maximum(pg1, pg2).mean())
        per_call["value"].append(0.5 * np.maximum(vf1, vf2).mean())
        per_call["total"].append(per_call["policy"][-1] + vf_coef * per_call["value"][-1])
        per_call["approxkl"].append(0.5 * (diff**2).mean())
        per_call["pg_clip"].append((pg2 > pg1).mean())
        per_call["vf_clip"].append((vf2 > vf1).mean())
        per_call["vpred"].append(vpred.mean())
        per_call["error"].append(vf1.mean())
        # each micro-batch here is one virtual rank's block: population moments per virtual rank, then averaged
        for name, x in (("returns", returns), ("val", values)):
            moments[f"{name}/mean"].append(x.mean())
            moments[f"{name}/var"].append(x.var())
        ratios.append(ratio)
    # both clips fire on some tokens and not on others (ties count as not clipped)
    assert 0 < np.mean(per_call["pg_clip"]) < 1 and 0 < np.mean(per_call["vf_clip"]) < 1
    names = {
        "loss/policy": "policy",
        "loss/value": "value",
        "loss/total": "total",
        "policy/approxkl": "approxkl",
        "policy/clipfrac": "pg_clip",
        "val/clipfrac": "vf_clip",
        "val/vpred": "vpred",
        "val/error": "error",
    }
    # the micro-batches are equal, so the mean over minibatch steps of their means is the mean over all calls
    expected = {f"ppo/{key}": np.mean(per_call[name]) for key, name in names.items()}
    expected.update({f"ppo/{key}": np.mean(values) for key, values in moments.items()})
    expected["ppo/policy/entropy"] = np.mean([e.mean().item() for e in entropies])
    expected["debug/ratio_mean"] = np.mean([r.mean() for r in ratios])
    expected["debug/ratio_min"] = min(r.min() for r in ratios)
    expected["debug/ratio_max"] = max(r.max() for r in ratios)
    # the first minibatch of the first epoch (its 2 micro-batches): the ratio ~1 before any step
    expected["debug/first_minibatch_ratio_max_abs_dev"] = max(np.abs(r - 1).max() for r in ratios[:2])
    assert expected["debug/first_minibatch_ratio_max_abs_dev"] < 1e-5 < np.abs(ratios[-1] - 1).max()
    assert set(expected) | {"nonfinite/advantages", "nonfinite/loss", "nonfinite/gradients"} == set(stats)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_main_logs_eos_count_and_filter_pass_rate_of_the_raw_responses(tmp_path, tokenizer, query_file, monkeypatch):
    # debug/num_eos counts EOS in the sampled (raw) responses, debug/filter_pass_rate is the share with the truncate
    # token at index >= truncate_after: a model sampling almost only EOS, '.' and two words puts EOS after a
    # truncating '.' in some responses, so counting in the truncated responses would tell apart
    from tests.conftest import small_vocab_gpt2
    from tests.fidelity import np_passes

    model_dir = tmp_path / "model"
    small_vocab_gpt2([tokenizer.eos_token_id, 13, *tokenizer.encode(" the cat")]).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rm_dir = save_reward_model(tmp_path / "reward", str(model_dir), tiny_task(query_file))
    sampled, sample = [], train_policy.modeling.sample
    monkeypatch.setattr(train_policy.modeling, "sample", lambda *a, **k: sampled.append(sample(*a, **k)) or sampled[-1])
    (stats,) = main(tiny_args(tmp_path / "policy", str(model_dir), rm_dir, query_file, total_episodes=8))
    responses = sampled[0][0]
    eos = (responses == tokenizer.eos_token_id).sum(1).double()
    truncated = truncate_response(responses, 13, 2, PAD)
    assert (truncated == tokenizer.eos_token_id).sum(1).double().mean() < eos.mean()
    assert stats["debug/num_eos"] == pytest.approx(eos.mean().item())
    passed = np_passes(responses.numpy(), 13, 2)
    assert 0 < passed.mean() < 1 and stats["debug/filter_pass_rate"] == pytest.approx(passed.mean())


def test_elapsed_statistics_follow_their_formulas(monkeypatch):
    # spec §4.1: elapsed/* of update 2 (0-based) of a global batch of 64 and 24-token responses, at a pinned clock:
    # fps = int(batch * length / seconds since the previous update's statistics), time = seconds since the start
    args = Args()
    args.ppo.batch_size, args.task.response_length = 64, 24
    monkeypatch.setattr(train_policy.time, "time", lambda: 1000.0)
    stats = {"ppo/val/error": 0.5, "ppo/returns/var": 2.0}
    train_policy.add_elapsed_stats(stats, 2, args, start_time=900.0, last_time=997.0)
    assert stats == {
        "ppo/val/error": 0.5,
        "ppo/returns/var": 2.0,
        "ppo/val/var_explained": 1 - 0.5 / 2.0,
        "elapsed/updates": 3,
        "elapsed/steps/serial": 3 * 24,
        "elapsed/steps/total": 3 * 64 * 24,
        "elapsed/episodes": 3 * 64,
        "elapsed/fps": int(64 * 24 / 3.0),
        "elapsed/time": 100.0,
    }
