"""The successor recipe's responses that end at EOS (nplus N19-N24, N26), its KL estimators (N21) and the penalty
modes (--task.end_at_eos, --rewards.kl_estimator, --task.penalty_mode): each masked quantity of the functions that
training runs against a plain per-row computation, on responses whose first EOS is at 0, in the middle, at L - 2,
at L - 1 or nowhere; and tiny runs of train_policy.main with the flags on."""

import dataclasses
import math

import numpy as np
import pytest
import torch

import train_policy
from lm_human_preference_details import modeling, rewards
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.nplus.end_at_eos import INVALID_LOGPROB, ResponseMasks
from lm_human_preference_details.sizes import derive_sizes
from lm_human_preference_details.tasks import (
    TASKS,
    check_truncation_resolved,
    filter_flags,
    resolve_truncation,
    task_differences,
    truncate_response,
)
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import small_vocab_gpt2, tiny_gpt2
from tests.fidelity import Recorder, patch_everywhere
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task
from train_policy import (
    Args,
    Rollout,
    compute_rewards,
    kl_estimate,
    minibatch_advantages,
    minibatch_indices,
    ppo_losses,
    virtual_rank_rngs,
)

EOS, PAD, L = 50256, 50257, 6
FIRST_EOS = [0, 2, None, L - 1, 1, L - 2, None, 3]
"""first EOS of each test response (None: none); row 4 has a second EOS at 4"""


def eos_responses(seed: int = 0) -> torch.Tensor:
    """(8, L) random responses (no EOS, no PAD) with EOS put at FIRST_EOS (and a second one in row 4)."""
    generator = torch.Generator().manual_seed(seed)
    responses = torch.randint(0, 50000, (len(FIRST_EOS), L), generator=generator)
    for row, first in enumerate(FIRST_EOS):
        if first is not None:
            responses[row, first] = EOS
    responses[4, 4] = EOS
    return responses


def end_of(row: list[int]) -> int:
    """s of one response: its first EOS, L - 1 without one (nplus N20), by a plain scan."""
    for t, token in enumerate(row):
        if token == EOS:
            return t
    return len(row) - 1


def ends_of(responses: torch.Tensor) -> list[int]:
    return [end_of(row) for row in responses.tolist()]


# ---------------------------------------------------------------- N19, N20: truncation and masks


def test_truncation_at_eos_keeps_the_eos_and_the_masks_follow_it():
    # nplus N19: every token after the first EOS becomes PAD, the EOS stays; N20: s = that EOS (L - 1 without one),
    # masks t > s and t > s + 1; N21: the score goes to s + 1, or to s when s + 1 is past the response
    raw = eos_responses()
    truncated = truncate_response(raw, EOS, 0, PAD)
    masks = ResponseMasks.of(truncated, EOS)
    for i, (raw_row, row) in enumerate(zip(raw.tolist(), truncated.tolist())):
        s = end_of(raw_row)
        assert int(masks.ends[i]) == s == (FIRST_EOS[i] if FIRST_EOS[i] is not None else L - 1)
        assert row[: s + 1] == raw_row[: s + 1] and row[s + 1 :] == [PAD] * (L - 1 - s)
        assert masks.after_end[i].tolist() == [t > s for t in range(L)]
        assert masks.after_value_end[i].tolist() == [t > s + 1 for t in range(L)]
        assert int(masks.score_index()[i]) == (s + 1 if s + 1 < L else s)


def test_end_at_eos_resolves_the_truncation_to_the_tokenizers_eos(tokenizer):
    task = dataclasses.replace(TASKS["tldr"], truncate_text=None, end_at_eos=True)
    resolved = resolve_truncation(task, tokenizer)
    assert (resolved.truncate_token, resolved.truncate_after) == (tokenizer.eos_token_id, 0)
    assert resolve_truncation(resolved, tokenizer) == resolved  # a saved, resolved task resolves to itself
    check_truncation_resolved(resolved)
    assert "with an EOS (token 50256, --task.end_at_eos)" in filter_flags(resolved)  # the pass-rate warnings' words
    with pytest.raises(ValueError, match="not resolved"):
        check_truncation_resolved(task)


def test_end_at_eos_with_another_truncation_token_or_without_an_eos_is_one_clear_line(tokenizer):
    with pytest.raises(ValueError) as error:
        resolve_truncation(dataclasses.replace(TASKS["tldr"], end_at_eos=True), tokenizer)  # the preset's '\n'
    message = str(error.value)
    assert "--task.end_at_eos" in message and "--task.truncate_text None" in message and "\n" not in message
    with pytest.raises(ValueError, match="--task.truncate_token 13"):
        task = dataclasses.replace(TASKS["tldr"], truncate_text=None, truncate_token=13, end_at_eos=True)
        resolve_truncation(task, tokenizer)

    class NoEos:  # a tokenizer whose vocabulary has no EOS
        eos_token_id = None

    with pytest.raises(ValueError, match="has none; .*--task.end_at_eos"):
        resolve_truncation(dataclasses.replace(TASKS["tldr"], truncate_text=None, end_at_eos=True), NoEos())


def test_a_task_saved_before_end_at_eos_and_penalty_mode_matches_their_defaults():
    task = TASKS["sentiment"]
    saved = dataclasses.asdict(task)
    del saved["end_at_eos"], saved["penalty_mode"]
    assert task_differences(saved, task) == {}
    changed = dataclasses.replace(task, end_at_eos=True, penalty_mode="subtract")
    assert task_differences(saved, changed) == {"end_at_eos": (False, True), "penalty_mode": ("replace", "subtract")}
    assert task_differences({**saved, "end_at_eos": True}, task) == {"end_at_eos": (True, False)}


# ---------------------------------------------------------------- N21: rewards and the KL estimators


def random_logprobs(generator: torch.Generator) -> torch.Tensor:
    return -torch.rand((len(FIRST_EOS), L), generator=generator, dtype=torch.float64) * 3


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_rewards_carry_no_kl_after_eos_and_the_score_one_step_after_it(estimator):
    generator = torch.Generator().manual_seed(1)
    masks = ResponseMasks.of(truncate_response(eos_responses(), EOS, 0, PAD), EOS)
    logprobs, ref_logprobs = random_logprobs(generator), random_logprobs(generator)
    scores = torch.randn(len(FIRST_EOS), generator=generator, dtype=torch.float64)
    beta = 0.05
    rewards_, non_score, kl = compute_rewards(
        scores, masks.invalidate(logprobs), masks.invalidate(ref_logprobs), beta, estimator, masks.score_index()
    )
    for i, s in enumerate(masks.ends.tolist()):
        for t in range(L):
            lp, ref = logprobs[i, t].item(), ref_logprobs[i, t].item()
            k = (lp - ref if estimator == "k1" else math.exp(ref - lp) - 1 - (ref - lp)) if t <= s else 0.0
            expected = -beta * k + (scores[i].item() if t == min(s + 1, L - 1) else 0.0)
            assert kl[i, t].item() == pytest.approx(k, abs=1e-12)
            assert non_score[i, t].item() == pytest.approx(-beta * k, abs=1e-12)
            assert rewards_[i, t].item() == pytest.approx(expected, abs=1e-12)


def test_k1_and_k3_estimate_the_kl_and_only_k3_is_never_negative():
    # nplus N21: k1 = logp - logp_ref, k3 = (r - 1) - log r with log r = logp_ref - logp; both unbiased estimates of
    # KL(p || p_ref) over tokens sampled from p; k3 >= 0 per token, k1 is negative wherever p_ref > p
    generator = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(20, generator=generator, dtype=torch.float64), 0)
    ref = torch.softmax(torch.randn(20, generator=generator, dtype=torch.float64), 0)
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=generator)
    logp, logp_ref = p.log()[tokens], ref.log()[tokens]
    k1, k3 = kl_estimate(logp, logp_ref, "k1"), kl_estimate(logp, logp_ref, "k3")
    assert torch.equal(k1, logp - logp_ref)
    assert torch.allclose(k3, (logp_ref - logp).exp() - 1 - (logp_ref - logp))
    exact = (p * (p.log() - ref.log())).sum().item()
    assert k1.mean().item() == pytest.approx(exact, rel=0.03) and k3.mean().item() == pytest.approx(exact, rel=0.03)
    assert (k3 >= 0).all() and (k1 < 0).any()
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros_like(logp))


def test_default_rewards_are_oais_float_for_float():
    # end_at_eos and kl_estimator off: exactly OAI's operations (spec P4), bit for bit
    generator = torch.Generator().manual_seed(3)
    logprobs, ref_logprobs = random_logprobs(generator), random_logprobs(generator)
    scores = torch.randn(len(FIRST_EOS), generator=generator, dtype=torch.float64)
    last_token = torch.full((len(FIRST_EOS),), L - 1)  # the score's index under OAI's rule (spec P4)
    rewards_, non_score, kl = compute_rewards(scores, logprobs, ref_logprobs, 0.15, "k1", last_token)
    expected = -0.15 * (logprobs - ref_logprobs)
    assert torch.equal(kl, logprobs - ref_logprobs) and torch.equal(non_score, expected)
    expected[:, -1] += scores
    assert torch.equal(rewards_, expected)


# ---------------------------------------------------------------- N22, N23: whitening and GAE


def np_masked_whiten(x: np.ndarray, keep: np.ndarray, shift_mean: bool) -> np.ndarray:
    values = x[keep]
    mean, var = values.mean(), values.var()
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


@pytest.mark.parametrize("whiten_rewards", [True, False])
def test_masked_advantages_match_per_row_loops(whiten_rewards):
    # nplus N22, N23: rewards whitened over t <= s + 1 (mean kept) and 0 after; GAE backwards over all L positions with
    # the values 0 after s + 1; returns from the unwhitened advantages; advantages whitened over t <= s (mean shifted)
    # and 0 after; each whitening group of 4 rows apart
    generator = torch.Generator().manual_seed(4)
    masks = ResponseMasks.of(truncate_response(eos_responses(), EOS, 0, PAD), EOS)
    # as compute_rewards leaves them: no KL after s, the score at s + 1, nothing after
    rewards_ = torch.randn(len(FIRST_EOS), L, generator=generator, dtype=torch.float64)
    rewards_ = rewards_.masked_fill(masks.after_value_end, 0.0)
    values = masks.zero_values(torch.randn(len(FIRST_EOS), L, generator=generator, dtype=torch.float64))
    ppo = dataclasses.replace(train_policy.PpoHParams(), whiten_rewards=whiten_rewards, gamma=0.9, lam=0.8)
    out_rewards, advantages, returns = masks.minibatch_advantages(
        rewards_, values, ppo.whiten_rewards, ppo.gamma, ppo.lam, 4, train_policy.compute_advantages
    )
    ends = masks.ends.tolist()
    r, v = rewards_.numpy(), values.numpy()
    keep_value = np.array([[t <= s + 1 for t in range(L)] for s in ends])
    keep_policy = np.array([[t <= s for t in range(L)] for s in ends])
    expected_rewards = r.copy()
    for g in (slice(0, 4), slice(4, 8)):
        if whiten_rewards:
            expected_rewards[g] = np_masked_whiten(r[g], keep_value[g], shift_mean=False)
    if whiten_rewards:
        expected_rewards[~keep_value] = 0.0
    expected_adv = np.zeros_like(r)
    for i in range(len(ends)):
        last = 0.0
        for t in reversed(range(L)):
            next_value = v[i, t + 1] if t + 1 < L else 0.0
            last = expected_rewards[i, t] + 0.9 * next_value - v[i, t] + 0.9 * 0.8 * last
            expected_adv[i, t] = last
    expected_returns = expected_adv + v
    whitened = np.zeros_like(r)
    for g in (slice(0, 4), slice(4, 8)):
        whitened[g] = np_masked_whiten(expected_adv[g], keep_policy[g], shift_mean=True)
    whitened[~keep_policy] = 0.0
    np.testing.assert_allclose(out_rewards.numpy(), expected_rewards, atol=1e-10)
    np.testing.assert_allclose(returns.numpy(), expected_returns, atol=1e-10)
    np.testing.assert_allclose(advantages.numpy(), whitened, atol=1e-10)
    assert (returns.numpy()[~keep_value] == 0).all()  # nothing after s + 1 to learn: reward, value and return 0


def test_default_advantages_are_oais_float_for_float():
    generator = torch.Generator().manual_seed(5)
    rewards_ = torch.randn(8, L, generator=generator)
    values = torch.randn(8, L, generator=generator)
    ppo = train_policy.PpoHParams()
    out = minibatch_advantages(rewards_, values, ppo, 4)
    whitened = train_policy.whiten(rewards_, shift_mean=False, group_size=4)
    advantages, returns = train_policy.compute_advantages(whitened, values, ppo.gamma, ppo.lam)
    assert torch.equal(out[0], whitened) and torch.equal(out[2], returns)
    assert torch.equal(out[1], train_policy.whiten(advantages, group_size=4))


# ---------------------------------------------------------------- N20, N24: the PPO update's masked losses


def test_ppo_update_masks_new_logprobs_values_and_the_loss_means(monkeypatch):
    # nplus N20, N24: in the update the new log-probs are INVALID_LOGPROB after s and the new values 0 after s + 1;
    # the policy loss and its clip fraction are means over the minibatch's t <= s, the value loss and its clip
    # fraction over t <= s + 1 (here each minibatch is 2 micro-batches of 4: their mean is the minibatch's)
    cliprange, cliprange_value = 0.1, 0.3
    args = Args()
    args.ppo = dataclasses.replace(
        args.ppo,
        batch_size=8,
        nminibatches=1,
        noptepochs=2,
        gradient_accumulation_steps=2,
        whiten_group_size=0,
        whiten_rewards=False,
        cliprange=cliprange,
        cliprange_value=cliprange_value,
    )
    sizes = derive_sizes(args, 1)
    policy = PolicyWithValueHead(tiny_gpt2(seed=0))
    generator = torch.Generator().manual_seed(6)
    context_length, temperature = 3, 0.7
    responses = eos_responses(6)
    query_responses = torch.cat([torch.randint(0, 50000, (8, context_length), generator=generator), responses], 1)
    masks = ResponseMasks.of(truncate_response(responses, EOS, 0, PAD), EOS)
    with torch.no_grad():
        logits, _ = policy(query_responses, context_length, PAD, temperature)
        logprobs = masks.invalidate(torch.log_softmax(logits, -1).gather(-1, responses[..., None])[..., 0])
    values = masks.zero_values(torch.randn(8, L, generator=generator))  # apart from vpred (0 at first): clips fire
    scores = torch.randn(8, generator=generator)
    reward_tokens, _, _ = compute_rewards(scores, logprobs, logprobs + 0.1, 0.05, "k1", masks.score_index())
    rollout = Rollout(query_responses, context_length, logprobs, values, reward_tokens, masks)
    rngs = virtual_rank_rngs(args.seed, 0, 1, sizes.virtual_ranks)
    indices = torch.from_numpy(minibatch_indices(rngs, sizes.group, 1, 2))
    calls = []

    def recording_losses(*inputs, **means):
        names = ("new_logprobs", "vpred", "logprobs", "values", "advantages", "returns")
        out = ppo_losses(*inputs, **means)
        calls.append({**{n: x.detach().double().clone() for n, x in zip(names, inputs)}, "out": out})
        return out

    monkeypatch.setattr(train_policy, "ppo_losses", recording_losses)
    optimizer = train_policy.optim.make_optimizer(list(policy.parameters()), 1e-2, True)
    train_policy.ppo_update(policy, optimizer, rollout, indices, sizes, args.ppo, temperature, PAD)
    assert len(calls) == 2 * 2
    ends = masks.ends.tolist()
    clipped = {"pg": [], "vf": []}
    for minibatch in (calls[:2], calls[2:]):
        sums = dict(policy=0.0, value=0.0, pg_clip=0.0, vf_clip=0.0, n_policy=0, n_value=0)
        for call in minibatch:
            # the rows of this micro-batch: their rollout log-probs are unique
            rows = [int((logprobs.double() == row).all(1).nonzero()[0, 0]) for row in call["logprobs"]]
            for b, i in enumerate(rows):
                s = ends[i]
                for t in range(L):
                    new, vpred = call["new_logprobs"][b, t].item(), call["vpred"][b, t].item()
                    if t > s:
                        assert new == INVALID_LOGPROB and call["advantages"][b, t].item() == 0.0
                    if t > s + 1:
                        assert vpred == 0.0
                        continue
                    ret, old_v = call["returns"][b, t].item(), call["values"][b, t].item()
                    vf1 = (vpred - ret) ** 2
                    vf2 = (min(max(vpred, old_v - cliprange_value), old_v + cliprange_value) - ret) ** 2
                    sums["value"] += 0.5 * max(vf1, vf2)
                    sums["vf_clip"] += float(vf2 > vf1)
                    sums["n_value"] += 1
                    if t > s:
                        continue
                    ratio = math.exp(new - call["logprobs"][b, t].item())
                    adv = call["advantages"][b, t].item()
                    pg1, pg2 = -adv * ratio, -adv * min(max(ratio, 1 - cliprange), 1 + cliprange)
                    sums["policy"] += max(pg1, pg2)
                    sums["pg_clip"] += float(pg2 > pg1)
                    sums["n_policy"] += 1
        mean = {
            key: np.mean([c["out"][key].item() for c in minibatch]) for key in minibatch[0]["out"] if key != "ratio"
        }
        assert mean["loss/policy"] == pytest.approx(sums["policy"] / sums["n_policy"], rel=1e-5, abs=1e-7)
        assert mean["policy/clipfrac"] == pytest.approx(sums["pg_clip"] / sums["n_policy"], abs=1e-6)
        assert mean["loss/value"] == pytest.approx(sums["value"] / sums["n_value"], rel=1e-5)
        assert mean["val/clipfrac"] == pytest.approx(sums["vf_clip"] / sums["n_value"], abs=1e-6)
        clipped["pg"].append(sums["pg_clip"])
        clipped["vf"].append(sums["vf_clip"])
    assert sum(clipped["vf"]) > 0 and sum(clipped["pg"]) > 0  # the clip fractions are not trivially 0


# ---------------------------------------------------------------- tiny runs of main with the flags on


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory, tokenizer):
    """A tiny GPT-2 that samples almost only EOS and seven words: responses end at EOS anywhere, or never."""
    path = tmp_path_factory.mktemp("eos-sampler")
    small_vocab_gpt2([tokenizer.eos_token_id, *tokenizer.encode(" the cat sat on a mat and")]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def eos_run(tmp_path, model_dir: str, query_file: str, monkeypatch, **task_and_rewards) -> tuple[list, Recorder]:
    """Two 16-episode updates of main with --task.end_at_eos (and the given task and rewards fields), recorded; the
    lr is high enough for the second update's KL and values (0 at first: a zero value head) to be far from 0."""
    task_fields = {k: v for k, v in task_and_rewards.items() if k in ("penalty_mode", "penalty_reward_value")}
    task = dataclasses.replace(tiny_task(query_file), truncate_token=None, end_at_eos=True, **task_fields)
    task = resolve_truncation(task, load_tokenizer(model_dir))
    rm_dir = save_reward_model(tmp_path / "reward", model_dir, task)
    ppo = dict(total_episodes=32, batch_size=16, lr=3e-3, noptepochs=2)
    args = tiny_args(tmp_path / "policy", model_dir, rm_dir, query_file, **ppo)
    args.task = task
    args.rewards.kl_estimator = task_and_rewards.get("kl_estimator", "k1")
    events = Recorder()
    for name in ("sample", "reference_logprobs", "compute_rewards", "ppo_update"):
        patch_everywhere(monkeypatch, name, lambda fn, n=name: events.wrap(n, fn), [train_policy, modeling])
    scorer = events.wrap("reward", rewards.RewardModelReward.__call__)
    monkeypatch.setattr(rewards.RewardModelReward, "__call__", scorer)
    history = train_policy.main(args)
    return history, events


@pytest.mark.parametrize(
    "flags",
    [dict(), dict(penalty_mode="subtract", penalty_reward_value=-0.5, kl_estimator="k3")],
    ids=["replace-k1", "subtract-k3"],
)
def test_main_with_end_at_eos_masks_the_rollout_and_logs_the_masked_objectives(
    tmp_path, tokenizer, eos_model_dir, query_file, monkeypatch, flags
):
    # nplus N19-N21, N26 through the real main: the raw responses' first EOS ends each; the rollout's and the
    # reference's log-probs are INVALID after it, the values 0 after s + 1; a response without EOS scores the penalty
    # (replace) or its score + the penalty (subtract); the score lands at s + 1; objective/kl sums the estimator's kl
    # (0 after EOS); objective/entropy sums -logprob including the -1 of every slot after EOS (the recipe's quirk)
    history, events = eos_run(tmp_path, eos_model_dir, query_file, monkeypatch, **flags)
    assert len(history) == 2
    for update, stats in enumerate(history):
        check_masked_update(events, update, stats, tokenizer.eos_token_id, flags)
    assert history[1]["objective/kl"] != 0.0


def check_masked_update(events: Recorder, update: int, stats: dict, eos: int, flags: dict) -> None:
    """One recorded update of eos_run against plain per-row computations from its sampled responses."""
    responses, raw_logprobs, raw_values = events.of("sample")[update].output
    raw_ref = events.of("reference_logprobs")[update].output
    ends = ends_of(responses)
    length = responses.shape[1]
    assert 0 < np.mean([eos in row for row in responses.tolist()]) < 1 and min(ends) < length - 2
    assert all(row[s] == eos or (s == length - 1 and eos not in row) for row, s in zip(responses.tolist(), ends))
    rewards_call = events.of("compute_rewards")[update].inputs
    raw_scores = events.of("reward")[update].output
    estimator = flags.get("kl_estimator", "k1")
    assert rewards_call["kl_estimator"] == estimator
    rollout = events.of("ppo_update")[update].inputs["rollout"]
    kl_sums, entropy_sums = [], []
    for i, s in enumerate(ends):
        for t in range(length):
            after = t > s
            assert rewards_call["logprobs"][i, t] == (INVALID_LOGPROB if after else raw_logprobs[i, t])
            assert rewards_call["ref_logprobs"][i, t] == (INVALID_LOGPROB if after else raw_ref[i, t])
            assert rollout.logprobs[i, t] == (INVALID_LOGPROB if after else raw_logprobs[i, t])
            assert rollout.values[i, t] == (0.0 if t > s + 1 else raw_values[i, t])
        assert int(rewards_call["score_index"][i]) == min(s + 1, length - 1)
        penalty = flags.get("penalty_reward_value", -1.0)
        if eos in responses[i].tolist():
            expected_score = raw_scores[i].item()
        elif flags.get("penalty_mode") == "subtract":
            expected_score = raw_scores[i].item() + penalty
        else:
            expected_score = penalty
        assert rewards_call["scores"][i].item() == pytest.approx(expected_score, abs=1e-6)
        lp, ref = raw_logprobs[i, : s + 1].double(), raw_ref[i, : s + 1].double()
        kl = lp - ref if estimator == "k1" else (ref - lp).exp() - 1 - (ref - lp)
        kl_sums.append(kl.sum().item())
        entropy_sums.append(-lp.sum().item() - (length - 1 - s) * INVALID_LOGPROB)
    if update == 1:  # the trained value head: its values after s + 1 were not 0 before the mask
        after_value_end = torch.tensor([[t > s + 1 for t in range(length)] for s in ends])
        assert (raw_values[after_value_end] != 0).all()
    assert stats["objective/kl"] == pytest.approx(np.mean(kl_sums), rel=1e-5, abs=1e-6)
    assert stats["objective/entropy"] == pytest.approx(np.mean(entropy_sums), rel=1e-5)
    assert stats["debug/filter_pass_rate"] == pytest.approx(np.mean([eos in r for r in responses.tolist()]))
    if estimator == "k3":
        assert min(kl_sums) >= 0.0


def test_main_without_end_at_eos_never_masks(tmp_path, eos_model_dir, query_file, monkeypatch):
    # OAI's path: no masks are built, the score goes to the last token of every response (spec P4)
    def refuse(*args, **kwargs):
        raise AssertionError("masks built with end_at_eos off")

    monkeypatch.setattr(ResponseMasks, "of", refuse)
    events = Recorder()
    patch_everywhere(monkeypatch, "compute_rewards", lambda fn: events.wrap("compute_rewards", fn), [train_policy])
    task = tiny_task(query_file)
    rm_dir = save_reward_model(tmp_path / "reward", eos_model_dir, task)
    train_policy.main(tiny_args(tmp_path / "policy", eos_model_dir, rm_dir, query_file, total_episodes=8, noptepochs=1))
    call = events.of("compute_rewards")[0].inputs
    assert torch.equal(call["score_index"], torch.full((8,), task.response_length - 1)) and call["kl_estimator"] == "k1"


# ---------------------------------------------------------------- evaluate.py's episodes


def test_evaluation_sums_the_kl_up_to_the_eos_and_subtracts_the_penalty(tokenizer):
    # evaluate.py scores episodes as training does: under end_at_eos the KL of an episode is the sum over t <= s, and
    # with penalty_mode subtract a response without EOS scores its reward + the penalty
    from lm_human_preference_details.evaluation import KL, SCORE, sample_and_score
    from lm_human_preference_details.modeling import RewardModel
    from lm_human_preference_details.rewards import RewardModelReward
    from tests.test_evaluation import TEMPERATURE, context_rows, direct_logprobs, random_queries
    from tests.test_evaluation import task as evaluation_task

    eos = tokenizer.eos_token_id
    words = [eos, *tokenizer.encode(" the cat sat on a mat and")]
    lm, ref_lm = small_vocab_gpt2(words, seed=0, strength=3.0), small_vocab_gpt2(words, seed=1, strength=3.0)
    settings = evaluation_task(truncate_after=4, end_at_eos=True, penalty_mode="subtract", penalty_reward_value=-2.0)
    settings = resolve_truncation(settings, tokenizer)
    queries = random_queries(3, 12, 6, pad_tail=True)
    reward = RewardModelReward(RewardModel(tiny_gpt2(2).transformer), PAD)
    policy, reference = PolicyWithValueHead(lm), PolicyWithValueHead(ref_lm)
    generator = torch.Generator().manual_seed(0)
    episodes = sample_and_score(policy, reference, queries, settings, tokenizer, reward, {}, generator, 4)
    with torch.no_grad():
        raw_scores = reward(queries, episodes.truncated)
    expected_kl, expected_score = [], []
    contexts = context_rows(tokenizer, queries, settings)
    for i, (context, response) in enumerate(zip(contexts, episodes.responses.tolist())):
        s = end_of(response)
        policy_lp = direct_logprobs(lm, context, response, TEMPERATURE)
        kl = policy_lp - direct_logprobs(ref_lm, context, response, TEMPERATURE)
        expected_kl.append(kl[: s + 1].sum().item())
        expected_score.append(raw_scores[i].item() + (0.0 if eos in response else -2.0))
    assert min(ends_of(episodes.responses)) < L - 2 and any(eos not in r for r in episodes.responses.tolist())
    expected_kl = torch.tensor(expected_kl, dtype=torch.float32)
    torch.testing.assert_close(episodes.metrics[KL], expected_kl, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(episodes.metrics[SCORE], torch.tensor(expected_score), atol=1e-5, rtol=1e-5)


def test_end_at_eos_with_a_presets_truncation_text_stops_the_command_line_with_one_line(
    tmp_path, tiny_model_dir, query_file, capsys
):
    # `--task tldr --task.end_at_eos` as typed: the preset's '\n' truncation is refused in one line that names the fix,
    # before anything is trained or written
    from tests.test_user_errors import one_error_line, run_cli

    output_dir = tmp_path / "policy"
    flags = ["--task", "tldr", "--task.end_at_eos", "--base_model", tiny_model_dir, "--rewards.trained_model", "vader"]
    flags += ["--task.query_dataset", query_file, "--output_dir", str(output_dir)]
    line = one_error_line(*run_cli(train_policy, flags, capsys)[::2])
    assert line.startswith("error: --task.end_at_eos") and "pass --task.truncate_text None" in line
    assert not output_dir.exists() or not any(output_dir.rglob("*.safetensors"))
