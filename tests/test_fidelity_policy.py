"""One real run of train_policy.main (2 updates) as rank 0 of a pretended 2-process job, with every step's tensors
recorded; each test re-derives what OAI computes from the recorded inputs (NumPy, a plain Hugging Face forward) and
compares it with what the run produced. The pretended other rank holds the same weights and gradients; its
statistics are this rank's + 1 (non-zero entries), so a statistic taken from this rank alone is told apart.
"""

import dataclasses
import random

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

import train_policy
from lm_human_preference_details import distributed, modeling, optim, ppo_plumbing, tracking
from tests.fidelity import (
    Recorder,
    fake_world,
    hf_response_outputs,
    np_gae,
    np_passes,
    np_truncate,
    np_whiten,
    patch_collectives,
    patch_everywhere,
    reduced_mean,
    shift_nonzero,
    state_copy,
    word_sampler_dir,
    write_corpus,
)
from tests.test_train_policy import save_reward_model

PREFIX, SUFFIX = "Article:\n\n", "\n\nTL;DR:"
QUERY_LENGTH, RESPONSE_LENGTH, TRUNCATE_AFTER = 12, 8, 2
GLOBAL_BATCH, TOTAL_EPISODES, NMINIBATCHES, NOPTEPOCHS = 32, 48, 2, 4  # 48 / 32 -> 2 updates (ceil)
LR, KL_COEF, KL_TARGET, KL_HORIZON = 1e-3, 0.15, 0.45, 32
WORLD, LOCAL_BATCH = 2, 16


@dataclasses.dataclass
class Run:
    history: list[dict]
    events: Recorder
    args: train_policy.Args
    model_dir: str
    pad: int
    truncate_token: int
    prefix: list[int]
    suffix: list[int]

    def per_update(self, kind: str) -> list[list]:
        """Events of `kind` grouped by update (an update starts with its `sample` call)."""
        starts = [self.events.index(e) for e in self.events.of("sample")] + [len(self.events.events)]
        return [[e for e in self.events.events[a:b] if e.kind == kind] for a, b in zip(starts, starts[1:])]

    def rollout(self, update: int) -> dict:
        """The update's sampled episodes: contexts, responses, rollout logprobs and values, the policy's weights."""
        event = self.events.of("sample")[update]
        responses, logprobs, values = event.output
        return dict(
            contexts=event.inputs["contexts"],
            responses=responses,
            logprobs=logprobs,
            values=values,
            state=event.inputs["state"],
        )

    def minibatch_rows(self, update: int) -> list[np.ndarray]:
        """Rollout row indices of each PPO loss call, from the tokens the loss forward ran on."""
        rollout = self.rollout(update)
        episodes = torch.cat([rollout["contexts"], rollout["responses"]], 1)
        rows = []
        for forward in [e for e in self.per_update("forward")[update] if e.inputs["grad"]]:
            tokens = forward.inputs["query_responses"]
            match = (tokens[:, None, :] == episodes[None, :, :]).all(-1)  # (b, B)
            assert bool((match.sum(1) == 1).all()), "episodes must be distinct"
            rows.append(match.float().argmax(1).numpy())
        return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer) -> Run:
    root = tmp_path_factory.mktemp("fidelity-policy")
    corpus = write_corpus(root / "queries.txt")
    model_dir = word_sampler_dir(root / "model", tokenizer)
    the = tokenizer.encode(" the")[0]  # sampled often: about 1 in 3 responses passes the filter
    args = train_policy.task_presets()["sentiment"]
    args.base_model, args.run.output_dir = model_dir, str(root / "policy")
    args.run.log_interval, args.run.save_interval, args.run.print_samples = 1, 0, 3
    args.task = dataclasses.replace(
        args.task,
        query_dataset=corpus,
        query_length=QUERY_LENGTH,
        response_length=RESPONSE_LENGTH,
        query_prefix=PREFIX,
        query_suffix=SUFFIX,
        start_text=None,
        end_text=None,
        truncate_token=the,
        truncate_text=None,
        truncate_after=TRUNCATE_AFTER,
    )
    rm_dir = save_reward_model(root / "reward", model_dir, args.task)
    args.rewards.trained_model, args.rewards.kl_coef = rm_dir, KL_COEF
    args.rewards.adaptive_kl = dataclasses.replace(args.rewards.adaptive_kl, target=KL_TARGET, horizon=KL_HORIZON)
    args.ppo = dataclasses.replace(
        args.ppo,
        total_episodes=TOTAL_EPISODES,
        batch_size=GLOBAL_BATCH,
        nminibatches=NMINIBATCHES,
        noptepochs=NOPTEPOCHS,
        lr=LR,
        whiten_group_size=0,  # each process one rank, as in the pretended 2-rank OAI job
    )
    events = Recorder()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        fake_world(mp, [train_policy], rank=0, other=shift_nonzero)
        patch_collectives(mp, events, [distributed, tracking, train_policy])
        record_policy_calls(mp, events)
        history = train_policy.main(args)
    torch.set_num_threads(threads)
    prefix, suffix = (tokenizer.encode(text) for text in (PREFIX, SUFFIX))
    return Run(history, events, args, model_dir, tokenizer.pad_token_id, the, prefix, suffix)


def record_policy_calls(mp: pytest.MonkeyPatch, events: Recorder) -> None:
    """Record rollouts (with the sampling policy's weights), rewards, advantages, losses, loss forwards (with the
    entropy of their logits), reward-model calls, KL-controller updates and optimizer steps."""

    def sampling_weights(a):
        return {"state": state_copy(a["policy"])}

    def grad_mode(a):
        return {"grad": torch.is_grad_enabled()}

    def loss_forward_entropy(result, a):
        """The entropy of the loss forward's tempered logits (the ppo/policy/entropy statistic)."""
        if not torch.is_grad_enabled():
            return None
        logp = torch.log_softmax(result[0].detach(), -1)
        return dict(entropy=-(logp.exp() * logp).sum(-1).double())

    def kl_coef_before(a):
        return {"value": a["self"].value}

    def learning_rates(a):
        return {"lrs": [g["lr"] for g in a["self"].param_groups]}

    extra = {"sample": sampling_weights}
    for name in ("sample", "compute_rewards", "compute_advantages", "ppo_losses", "sample_table_rows"):
        modules = [train_policy, ppo_plumbing, modeling]
        patch_everywhere(mp, name, lambda fn, n=name: events.wrap(n, fn, extra.get(n)), modules)
    forward = events.wrap("forward", modeling.PolicyWithValueHead.forward, grad_mode, loss_forward_entropy)
    mp.setattr(modeling.PolicyWithValueHead, "forward", forward)
    mp.setattr(modeling.RewardModel, "forward", events.wrap("reward", modeling.RewardModel.forward))
    update = events.wrap("kl_update", train_policy.AdaptiveKLController.update, kl_coef_before)
    mp.setattr(train_policy.AdaptiveKLController, "update", update)
    mp.setattr(optim.AdamTensorFlowStyle, "step", events.wrap("step", optim.AdamTensorFlowStyle.step, learning_rates))


def initial_lm(run: Run) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(run.model_dir).eval()


def lm_with(run: Run, state: dict) -> tuple[GPT2LMHeadModel, torch.Tensor, torch.Tensor]:
    """A plain GPT-2 LM with the policy weights of `state` (a PolicyWithValueHead state dict) and its value head."""
    lm = initial_lm(run)
    lm.load_state_dict({k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")})
    return lm, state["value_head.weight"].double(), state["value_head.bias"].double()


# ---------------------------------------------------------------- rollout (G4, G6, P1, P2, P3, P4, P13, D1)


def test_run_policy_sees_prefix_query_suffix_and_reward_model_the_raw_query(run):
    # spec G4, P2, D1: each process samples its share of the global batch from prefix + query + suffix; the reward model
    # scores the raw query + the truncated response; PPO trains on the raw response
    for update in range(2):
        rollout = run.rollout(update)
        contexts, responses = rollout["contexts"], rollout["responses"]
        p, s = len(run.prefix), len(run.suffix)
        assert contexts.shape == (GLOBAL_BATCH // WORLD, p + QUERY_LENGTH + s)
        assert responses.shape == (GLOBAL_BATCH // WORLD, RESPONSE_LENGTH)
        assert (contexts[:, :p] == torch.tensor(run.prefix)).all() and (
            contexts[:, -s:] == torch.tensor(run.suffix)
        ).all()
        queries = contexts[:, p : p + QUERY_LENGTH]
        assert (queries == run.pad).any(), "queries are right-padded"
        truncated = np_truncate(responses.numpy(), run.truncate_token, TRUNCATE_AFTER, run.pad)
        assert (truncated != responses.numpy()).any(), "some responses are truncated"
        scored = run.per_update("reward")[update]
        assert len(scored) == 1
        expected = torch.cat([queries, torch.from_numpy(truncated)], 1)
        assert torch.equal(scored[0].inputs["query_responses"], expected)
        assert len(run.minibatch_rows(update)) == NOPTEPOCHS * NMINIBATCHES  # each loss forward: context + raw response


def test_run_draws_queries_in_the_data_seed_order_rank_strided(run, tokenizer):
    # spec D3, G3: the texts in OAI's order, Python's random.seed(data_seed); random.shuffle(texts) (data_seed 0, not
    # the run seed), the same on every process; rank r of R takes valid queries r, r + R, ...; each query is its first
    # 12 tokens, right-padded
    texts = open(run.args.task.query_dataset, encoding="utf-8").read().splitlines()
    shuffled = list(texts)
    random.seed(run.args.data_seed)
    random.shuffle(shuffled)
    stream = [tokenizer.encode(text)[:QUERY_LENGTH] for text in shuffled + shuffled]
    mine = [query + [run.pad] * (QUERY_LENGTH - len(query)) for query in stream[0::WORLD]]
    p = len(run.prefix)
    drawn = torch.cat([run.rollout(u)["contexts"][:, p : p + QUERY_LENGTH] for u in range(2)])
    assert drawn.tolist() == mine[: len(drawn)]


def test_run_reference_logprobs_are_the_initial_policy_at_the_task_temperature(run):
    # spec G6, P1: rho is the frozen initial policy; its log-probs use the task temperature (0.7), like the policy's
    lm = initial_lm(run)
    temperature = run.args.task.temperature
    for update, call in enumerate(run.events.of("compute_rewards")):
        rollout = run.rollout(update)
        tokens = torch.cat([rollout["contexts"], rollout["responses"]], 1)
        logp, _ = hf_response_outputs(lm, tokens, rollout["contexts"].shape[1], run.pad, temperature)
        expected = logp.gather(-1, rollout["responses"][..., None])[..., 0]
        np.testing.assert_allclose(call.inputs["ref_logprobs"].double(), expected, atol=2e-4, rtol=0)


def test_run_rollout_logprobs_and_values_come_from_the_sampling_policy(run):
    # spec P13, G5: logprobs and values of the rollout are those of the sampled tokens under the policy that sampled
    # them (tempered), at the positions that predict each token; exactly response_length tokens per episode
    temperature = run.args.task.temperature
    for update in range(2):
        rollout = run.rollout(update)
        lm, weight, bias = lm_with(run, rollout["state"])
        tokens = torch.cat([rollout["contexts"], rollout["responses"]], 1)
        logp, hidden = hf_response_outputs(lm, tokens, rollout["contexts"].shape[1], run.pad, temperature)
        expected = logp.gather(-1, rollout["responses"][..., None])[..., 0]
        np.testing.assert_allclose(rollout["logprobs"].double(), expected, atol=2e-4, rtol=0)
        np.testing.assert_allclose(rollout["values"].double(), hidden @ weight[0] + bias[0], atol=2e-4, rtol=0)
    assert rollout["values"].abs().max() > 1e-3, "the second update's values come from a trained value head"


def test_run_failing_responses_score_the_penalty(run):
    # spec P3: a response without truncate_token at index >= truncate_after scores -1 instead of the reward model's
    for update, call in enumerate(run.events.of("compute_rewards")):
        responses = run.rollout(update)["responses"].numpy()
        passed = np_passes(responses, run.truncate_token, TRUNCATE_AFTER)
        assert 0 < passed.sum() < len(passed)
        model_scores = run.per_update("reward")[update][0].output.numpy()
        expected = np.where(passed, model_scores, run.args.task.penalty_reward_value)
        np.testing.assert_allclose(call.inputs["scores"].numpy(), expected, atol=1e-6, rtol=0)


def test_run_rewards_are_kl_penalized_with_the_current_kl_coef(run):
    # spec P4, P1, P14: rewards = -beta * (logp - logp_ref), + score at the last token; beta is the controller's value
    # at the time of the rollout (0.15 first, then the value after one adaptive update)
    calls = run.events.of("compute_rewards")
    kl_0 = run.history[0]["objective/kl"]
    error = np.clip(kl_0 / KL_TARGET - 1, -0.2, 0.2)
    betas = [KL_COEF, KL_COEF * (1 + error * GLOBAL_BATCH / KL_HORIZON)]
    for update, (call, beta) in enumerate(zip(calls, betas)):
        assert call.inputs["kl_coef"] == pytest.approx(beta, rel=1e-9)
        logprobs = run.rollout(update)["logprobs"].double()
        np.testing.assert_array_equal(call.inputs["logprobs"].double(), logprobs)
        kl = logprobs - call.inputs["ref_logprobs"].double()
        expected = -beta * kl
        expected[:, -1] += call.inputs["scores"].double()
        rewards = call.output[0]
        np.testing.assert_allclose(rewards.double(), expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- PPO (P5-P12, P15, P16, D4, O4, O5, D6)


def test_run_whitens_rewards_and_advantages_per_minibatch(run):
    # spec P5, P6, D4: per minibatch (this process's episodes): rewards whitened with the mean kept, GAE(1, 0.95),
    # returns = advantages + values, advantages whitened to mean 0 / variance 1 (population moments)
    ppo = run.args.ppo
    for update in range(2):
        rewards = run.events.of("compute_rewards")[update].output[0].numpy()
        values = run.rollout(update)["values"].numpy()
        losses = run.per_update("ppo_losses")[update]
        rows = run.minibatch_rows(update)
        assert len(losses) == len(rows) == NOPTEPOCHS * NMINIBATCHES
        for call, idx in zip(losses, rows):
            whitened_rewards = np_whiten(rewards[idx], shift_mean=False)
            advantages, returns = np_gae(whitened_rewards, values[idx], ppo.gamma, ppo.lam)
            np.testing.assert_allclose(call.inputs["returns"].numpy(), returns, atol=2e-5, rtol=1e-5)
            np.testing.assert_allclose(call.inputs["advantages"].numpy(), np_whiten(advantages), atol=2e-5, rtol=1e-5)
            np.testing.assert_array_equal(call.inputs["values"].numpy(), values[idx])


def test_run_ppo_ratio_is_taken_against_the_rollout_logprobs(run):
    # spec P7, P9, P13: the loss forward re-evaluates context + raw response at the task temperature; the ratio's
    # denominator is the rollout's logprobs (not the reference policy's), so the first minibatch's ratio is ~1
    for update in range(2):
        rollout = run.rollout(update)
        losses = run.per_update("ppo_losses")[update]
        for call, idx in zip(losses, run.minibatch_rows(update)):
            np.testing.assert_array_equal(call.inputs["logprobs"].numpy(), rollout["logprobs"].numpy()[idx])
        first = losses[0]
        np.testing.assert_allclose(first.inputs["new_logprobs"], first.inputs["logprobs"], atol=1e-4, rtol=0)
    later = run.per_update("ppo_losses")[1][-1]
    assert (later.inputs["new_logprobs"] - later.inputs["logprobs"]).abs().max() > 1e-3, "the policy moved"


def test_run_each_epoch_draws_a_fresh_permutation(run):
    # spec P12: every epoch visits each episode once, in a new random order, cut into nminibatches contiguous chunks,
    # one optimizer step per chunk
    for update in range(2):
        rows = run.minibatch_rows(update)
        epochs = [np.concatenate(rows[e * NMINIBATCHES : (e + 1) * NMINIBATCHES]) for e in range(NOPTEPOCHS)]
        for order in epochs:
            assert sorted(order.tolist()) == list(range(LOCAL_BATCH))
            assert all(len(chunk) == LOCAL_BATCH // NMINIBATCHES for chunk in rows)
        assert len({tuple(order) for order in epochs}) == NOPTEPOCHS, "each epoch has its own permutation"
        assert len(run.per_update("step")[update]) == NOPTEPOCHS * NMINIBATCHES


def test_run_nupdates_round_up_and_lr_anneals_per_update(run):
    # spec P15, P16, O5: ceil(48 / 32) = 2 updates; every step of update u uses lr * (1 - u / nupdates)
    assert len(run.history) == 2
    for update, steps in enumerate(run.per_update("step")):
        expected = LR * (1 - update / 2)
        assert [lr for step in steps for lr in step.inputs["lrs"]] == pytest.approx([expected] * len(steps))


def test_run_syncs_weights_first_then_averages_gradients_before_every_step(run):
    # spec D6, O4: rank 0's policy weights are broadcast before any rollout; gradients are all-reduced before each step
    broadcasts = run.events.of("broadcast_parameters")
    first_sample = run.events.index(run.events.of("sample")[0])
    assert broadcasts and run.events.index(broadcasts[0]) < first_sample
    policy = run.events.of("sample")[0].inputs["policy"]
    assert any(b.inputs["module"] is policy for b in broadcasts)
    kinds = [e.kind for e in run.events.events if e.kind in ("allreduce_gradients", "step")]
    assert kinds == ["allreduce_gradients", "step"] * (2 * NOPTEPOCHS * NMINIBATCHES)
    params = run.events.of("allreduce_gradients")[0].inputs["params"]
    assert {id(p) for p in params} == {id(p) for p in policy.parameters()}


def test_run_trains_the_embeddings_and_the_tied_lm_head(run):
    # spec G9: every policy parameter is optimized, token embeddings (tied to the LM head) included
    before, after = run.rollout(0)["state"], run.rollout(1)["state"]
    for name in ("lm.transformer.wte.weight", "lm.transformer.wpe.weight", "lm.transformer.h.0.attn.c_attn.weight"):
        assert not torch.equal(before[name], after[name]), name
    assert not torch.equal(before["value_head.weight"], after["value_head.weight"])
    policy = run.events.of("sample")[0].inputs["policy"]
    assert policy.lm.get_output_embeddings().weight is policy.lm.get_input_embeddings().weight


# ---------------------------------------------------------------- KL control and statistics (P14, §4.1, D5, P19)


def test_run_kl_controller_gets_the_global_kl_and_the_global_batch(run):
    # spec P14, D5: once per update, after its PPO steps, with objective/kl reduced over all processes and
    # n_steps = ppo.batch_size (global episodes)
    updates = run.events.of("kl_update")
    assert len(updates) == 2
    for update, event in enumerate(updates):
        steps = run.per_update("step")[update]
        assert run.events.index(event) > run.events.index(steps[-1])
        assert event.inputs["n_steps"] == GLOBAL_BATCH
        assert event.inputs["value"] == run.events.of("compute_rewards")[update].inputs["kl_coef"]
        assert event.inputs["current"] == pytest.approx(run.history[update]["objective/kl"], rel=1e-9)
        local_kl = run.per_update("compute_rewards")[update][0].output[2].sum(1).mean().item()
        assert event.inputs["current"] == pytest.approx(reduced_mean(local_kl), abs=1e-5)
    # the next update's rewards use the adapted coefficient
    assert run.history[1]["objective/kl_coef"] == run.events.of("compute_rewards")[1].inputs["kl_coef"]


def test_run_logs_oai_metric_semantics(run):
    # spec §4.1, P11, D5: objective/* from the rollout (per-episode sums over tokens, means over episodes), ppo/* as
    # means over all minibatch steps, population variances, everything averaged over processes; var_explained from
    # the reduced values; elapsed/* from global sizes
    batch, length = GLOBAL_BATCH, RESPONSE_LENGTH
    for update, stats in enumerate(run.history):
        rollout = run.rollout(update)
        call = run.events.of("compute_rewards")[update]
        logprobs, ref = rollout["logprobs"].double(), call.inputs["ref_logprobs"].double()
        scores, beta = call.inputs["scores"].double(), call.inputs["kl_coef"]
        objective = {
            "objective/kl": (logprobs - ref).sum(1).mean(),
            "objective/entropy": (-logprobs).sum(1).mean(),
            "objective/score": scores.mean(),
            "objective/score_total": scores.mean() + (-beta * (logprobs - ref)).sum(1).mean(),
        }
        for key, local in objective.items():
            assert stats[key] == pytest.approx(reduced_mean(local.item()), abs=1e-5), key
        assert stats["objective/kl_coef"] == beta
        losses = run.per_update("ppo_losses")[update]
        forwards = [e for e in run.per_update("forward")[update] if e.inputs["grad"]]
        steps = {
            "ppo/loss/policy": [c.output["loss/policy"].item() for c in losses],
            "ppo/loss/value": [c.output["loss/value"].item() for c in losses],
            "ppo/loss/total": [c.output["loss/total"].item() for c in losses],
            "ppo/policy/approxkl": [c.output["policy/approxkl"].item() for c in losses],
            "ppo/policy/clipfrac": [c.output["policy/clipfrac"].item() for c in losses],
            "ppo/val/clipfrac": [c.output["val/clipfrac"].item() for c in losses],
            "ppo/val/vpred": [c.inputs["vpred"].double().mean().item() for c in losses],
            "ppo/val/error": [((c.inputs["vpred"] - c.inputs["returns"]).double() ** 2).mean().item() for c in losses],
            "ppo/returns/mean": [c.inputs["returns"].double().mean().item() for c in losses],
            "ppo/returns/var": [np.var(c.inputs["returns"].double().numpy()) for c in losses],
            "ppo/val/mean": [c.inputs["values"].double().mean().item() for c in losses],
            "ppo/val/var": [np.var(c.inputs["values"].double().numpy()) for c in losses],
            "ppo/policy/entropy": [f.output["entropy"].mean().item() for f in forwards],
        }
        for key, values in steps.items():
            assert len(values) == NOPTEPOCHS * NMINIBATCHES
            assert stats[key] == pytest.approx(reduced_mean(float(np.mean(values))), abs=2e-5), key
        var_explained = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
        assert stats["ppo/val/var_explained"] == pytest.approx(var_explained, rel=1e-9)
        done = update + 1
        assert stats["elapsed/updates"] == done
        assert stats["elapsed/episodes"] == done * batch
        assert stats["elapsed/steps/serial"] == done * length
        assert stats["elapsed/steps/total"] == done * batch * length
        assert isinstance(stats["elapsed/fps"], int) and stats["elapsed/fps"] > 0
    assert 0 < run.history[0]["elapsed/time"] < run.history[1]["elapsed/time"]


def test_run_sample_table_totals_use_the_initial_kl_coef(run):
    # spec P19: rank 0 prints (query, truncated response, score, kl, score - initial kl_coef * kl) every log_interval
    tables = run.events.of("sample_table_rows")
    assert len(tables) == 2
    for update, table in enumerate(tables):
        assert table.inputs["kl_coef"] == KL_COEF
        call = run.events.of("compute_rewards")[update]
        kl_sums = (run.rollout(update)["logprobs"] - call.inputs["ref_logprobs"]).sum(1)
        np.testing.assert_allclose(table.inputs["kl_sums"], kl_sums, atol=1e-6)
        np.testing.assert_array_equal(table.inputs["scores"], call.inputs["scores"])
