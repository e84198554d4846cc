"""One real run of train_reward.main as rank 1 of a pretended 2-process job, with every step's tensors recorded; each
test re-derives what OAI computes (NumPy, the label file itself) and compares it with what the run did. The pretended
rank 0 holds the same tensors as this one (so a mean over ranks equals this rank's value), and its broadcast of the
label order is rank 0's NumPy permutation, as OAI's rank 0 draws it.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from transformers import GPT2LMHeadModel

import train_reward
from lm_human_preference_details import distributed, modeling, optim, tracking
from lm_human_preference_details.labels import OAI_PAD_TOKEN
from lm_human_preference_details.tasks import TaskHParams
from tests.fidelity import (
    WORDS,
    Recorder,
    fake_world,
    np_truncate,
    patch_collectives,
    patch_everywhere,
    state_copy,
    word_sampler_dir,
    write_corpus,
)

PREFIX, SUFFIX = "Article:\n\n", "\n\nTL;DR:"
QUERY_LENGTH, RESPONSE_LENGTH, TRUNCATE_AFTER = 12, 8, 2
NUM_TRAIN, NUM_ROWS, BATCH, ACCUM = 32, 40, 8, 2  # 4 steps of 8 labels: 4 per process, 2 micro-batches of 2
ROLLOUT_BATCH, NORMALIZE_SAMPLES = 16, 24  # ceil(24 / 16) = 2 global batches of 16 (8 per process)
LR, SEED, RANK, WORLD = 1e-3, 1, 1, 2


@dataclasses.dataclass
class Run:
    result: dict
    events: Recorder
    args: train_reward.Args
    rows: list[dict]
    model_dir: str
    pad: int
    prefix: list[int]
    suffix: list[int]
    local_permutation: list

    def phases(self) -> dict[str, list]:
        """Reward-model calls of the normalization before training, of training, and of the normalization after."""
        reward_calls = self.events.of("reward")
        training = [e for e in reward_calls if e.inputs["grad"]]
        first, last = self.events.index(training[0]), self.events.index(training[-1])
        normalizing = [e for e in reward_calls if self.follows_sample(e)]
        return {
            "before": [e for e in normalizing if self.events.index(e) < first],
            "training": training,
            "after": [e for e in normalizing if self.events.index(e) > last],
        }

    def follows_sample(self, event) -> bool:
        """True for a reward-model call right after a sampling call (a normalization batch)."""
        i = self.events.index(event)
        return i > 0 and self.events.events[i - 1].kind == "sample"

    def samples_of(self, event):
        return self.events.events[self.events.index(event) - 1]


def write_labels(path, rng: np.random.RandomState, tokens: list[int], the: int) -> list[dict]:
    """NUM_ROWS best-of-4 rows in OAI's schema: right-padded queries, some truncated samples, PAD written as 50259."""
    rows = []
    for _ in range(NUM_ROWS):
        length = rng.randint(3, QUERY_LENGTH + 1)
        query = rng.choice(tokens, length).tolist() + [OAI_PAD_TOKEN] * (QUERY_LENGTH - length)
        samples = {}
        for i in range(4):
            sample = rng.choice(tokens, RESPONSE_LENGTH).tolist()
            if rng.rand() < 0.5:
                cut = rng.randint(TRUNCATE_AFTER, RESPONSE_LENGTH - 1)
                sample[cut] = the
                sample[cut + 1 :] = [OAI_PAD_TOKEN] * (RESPONSE_LENGTH - cut - 1)
            samples[f"sample{i}"] = sample
        rows.append({"query": query, **samples, "best": int(rng.randint(4))})
    path.write_text(json.dumps(rows))
    return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer) -> Run:
    root = tmp_path_factory.mktemp("fidelity-reward")
    corpus = write_corpus(root / "queries.txt")
    model_dir = word_sampler_dir(root / "model", tokenizer)
    the, words = tokenizer.encode(" the")[0], [tokenizer.encode(word)[0] for word in WORDS]
    rows = write_labels(root / "labels.json", np.random.RandomState(0), words, the)
    args = train_reward.Args(
        seed=SEED,
        base_model=model_dir,
        label_dataset=str(root / "labels.json"),
        task=TaskHParams(
            query_dataset=corpus,
            query_length=QUERY_LENGTH,
            response_length=RESPONSE_LENGTH,
            query_prefix=PREFIX,
            query_suffix=SUFFIX,
            start_text=None,
            end_text=None,
            truncate_token=the,
            truncate_after=TRUNCATE_AFTER,
        ),
        labels=train_reward.LabelHParams(num_train=NUM_TRAIN),
        batch_size=BATCH,
        gradient_accumulation_steps=ACCUM,
        lr=LR,
        rollout_batch_size=ROLLOUT_BATCH,
        normalize_samples=NORMALIZE_SAMPLES,
    )
    args.run.output_dir = str(root / "rm")
    events, local_permutation = Recorder(), []

    def rank_zero_broadcast(tensor, from_process=0):
        """Rank 0's label order (NumPy seeded with the run seed), as OAI's rank 0 broadcasts it."""
        assert from_process == 0
        local_permutation.append(tensor.tolist())
        return torch.from_numpy(np.random.RandomState(SEED).permutation(len(tensor))).to(tensor.device)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        fake_world(mp, [train_reward], rank=RANK)
        patch_collectives(mp, events, [distributed, tracking, train_reward])
        patch_everywhere(mp, "broadcast", lambda fn: rank_zero_broadcast, [train_reward])
        record_reward_calls(mp, events)
        result = train_reward.main(args)
    torch.set_num_threads(threads)
    prefix, suffix = (tokenizer.encode(text) for text in (PREFIX, SUFFIX))
    return Run(result, events, args, rows, model_dir, tokenizer.pad_token_id, prefix, suffix, local_permutation)


def record_reward_calls(mp: pytest.MonkeyPatch, events: Recorder) -> None:
    """Record sampling calls (the sampling policy's weights and generator seed), reward-model calls (gain, bias and
    grad mode at the time), optimizer steps (learning rates, parameters) and logged metrics."""

    def sampling(a):
        return {"state": state_copy(a["policy"]), "seed": a["generator"].initial_seed()}

    def reward_model(a):
        model = a["self"]
        return {"gain": model.gain.item(), "bias": model.bias.item(), "grad": torch.is_grad_enabled(), "model": model}

    def optimizer(a):
        groups = a["self"].param_groups
        return {"lrs": [g["lr"] for g in groups], "params": [p for g in groups for p in g["params"]]}

    patch_everywhere(mp, "sample", lambda fn: events.wrap("sample", fn, sampling), [train_reward])
    mp.setattr(modeling.RewardModel, "forward", events.wrap("reward", modeling.RewardModel.forward, reward_model))
    mp.setattr(optim.AdamTensorFlowStyle, "step", events.wrap("step", optim.AdamTensorFlowStyle.step, optimizer))
    mp.setattr(tracking.Tracker, "log", events.wrap("log", tracking.Tracker.log))


def label_tokens(rows: list[dict], index: int, pad: int) -> torch.Tensor:
    """The 4 reward-model inputs (query + sample_i) of a label row, OAI's PAD 50259 mapped to ours."""
    row = rows[index]
    tokens = torch.tensor([row["query"] + row[f"sample{i}"] for i in range(4)])
    return torch.where(tokens == OAI_PAD_TOKEN, pad, tokens)


# ---------------------------------------------------------------- normalization (R4)


def test_reward_run_normalizes_on_raw_samples_of_the_pretrained_policy(run):
    # spec R4, G4: gain/bias reset to 1/0, ceil(normalize_samples / rollout_batch_size) global batches of samples of
    # the pretrained policy at the task temperature (context with prefix/suffix), scored raw (query + untruncated
    # response), then gain = 1/std, bias = -mean/std with the population std
    initial = GPT2LMHeadModel.from_pretrained(run.model_dir).state_dict()
    phases = run.phases()
    p, s = len(run.prefix), len(run.suffix)
    queries_seen, responses_seen = [], []
    for name in ("before", "after"):
        calls = phases[name]
        assert len(calls) == 2, f"{name}: ceil(24 / 16) = 2 batches"
        scores = []
        for call in calls:
            sampling = run.samples_of(call).inputs
            for key, value in initial.items():
                assert torch.equal(sampling["state"][f"lm.{key}"], value), key
            assert sampling["temperature"] == run.args.task.temperature
            contexts, responses = sampling["contexts"], run.samples_of(call).output[0]
            assert contexts.shape == (ROLLOUT_BATCH // WORLD, p + QUERY_LENGTH + s)
            assert torch.equal(contexts[:, :p], torch.tensor(run.prefix).expand(len(contexts), -1))
            assert torch.equal(contexts[:, -s:], torch.tensor(run.suffix).expand(len(contexts), -1))
            queries = contexts[:, p : p + QUERY_LENGTH]
            queries_seen.append(queries)
            responses_seen.append(responses.numpy())
            assert torch.equal(call.inputs["query_responses"], torch.cat([queries, responses], 1))
            assert (call.inputs["gain"], call.inputs["bias"]) == (1.0, 0.0)
            scores.append(call.output.double().numpy())
        scores = np.concatenate(scores)
        gain, bias = 1 / scores.std(), -scores.mean() / scores.std()  # numpy std: population
        if name == "before":
            applied = phases["training"][0].inputs
        else:
            applied = {"gain": run.result["gain"], "bias": run.result["bias"]}
        assert applied["gain"] == pytest.approx(gain, rel=1e-5)
        assert applied["bias"] == pytest.approx(bias, rel=1e-5, abs=1e-6)
    assert not torch.equal(queries_seen[0], queries_seen[2]), "the query stream continues between normalizations"
    responses = np.concatenate(responses_seen)
    truncated = np_truncate(responses, run.args.task.truncate_token, TRUNCATE_AFTER, run.pad)
    assert (truncated != responses).any(), "truncation would have changed some samples"


# ---------------------------------------------------------------- the label loop (R3, R5, R6, R7, D2, D7, O5, G1)


def test_reward_run_trains_one_epoch_in_rank_zero_order_with_rank_strided_slices(run):
    # spec R6, R7, D2, D7, G1, O5: rank 1 seeds NumPy with seed + 100003 (its own draw is discarded for rank 0's
    # broadcast permutation); each step of 8 labels gives this rank indices[start:start + 8][1::2] of the first
    # num_train rows (OAI's PAD mapped), in micro-batches of 2 rows x 4 samples; lr = lr * (1 - start / num_train)
    assert run.local_permutation == [np.random.RandomState(SEED + RANK * 100003).permutation(NUM_TRAIN).tolist()]
    order = np.random.RandomState(SEED).permutation(NUM_TRAIN)
    expected = [order[start : start + BATCH][RANK::WORLD] for start in range(0, NUM_TRAIN, BATCH)]
    assert run.result["label_indices"] == np.concatenate(expected).tolist()
    training = run.phases()["training"]
    assert len(training) == len(expected) * ACCUM
    for step, indices in enumerate(expected):
        micro = training[step * ACCUM : (step + 1) * ACCUM]
        fed = torch.cat([call.inputs["query_responses"] for call in micro])
        assert torch.equal(fed, torch.cat([label_tokens(run.rows, int(i), run.pad) for i in indices]))
    steps = run.events.of("step")
    assert [s.inputs["lrs"][0] for s in steps] == pytest.approx(
        [LR * (1 - start / NUM_TRAIN) for start in range(0, NUM_TRAIN, BATCH)]
    )


def test_reward_run_trains_gain_and_bias_with_the_trunk(run):
    # spec R3, O1: the optimizer holds every reward-model parameter, gain and bias included; the gain moves
    training = run.phases()["training"]
    model = training[0].inputs["model"]
    params = run.events.of("step")[0].inputs["params"]
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}
    assert any(p is model.gain for p in params) and any(p is model.bias for p in params)
    assert training[-1].inputs["gain"] != training[0].inputs["gain"]
    assert type(run.events.of("step")[0].inputs["self"]).__name__ == "AdamTensorFlowStyle"


def test_reward_run_logs_the_best_of_n_cross_entropy(run):
    # spec R5, §4.2, D5: one batched forward of the 4 samples per label row; train_reward/minibatch/loss and /error
    # are the mean softmax cross-entropy of the step's labels (averaged over micro-batches and processes)
    logs = [e.inputs for e in run.events.of("log") if "train_reward/minibatch/loss" in e.inputs["metrics"]]
    training = run.phases()["training"]
    indices = np.asarray(run.result["label_indices"]).reshape(len(logs), -1)
    for step, (log, step_indices) in enumerate(zip(logs, indices)):
        assert log["step"] == step
        rewards = torch.cat([c.output for c in training[step * ACCUM : (step + 1) * ACCUM]]).double()
        rewards = rewards.view(len(step_indices), 4).numpy()
        best = np.array([run.rows[i]["best"] for i in step_indices])
        log_softmax = rewards - np.log(np.exp(rewards).sum(1, keepdims=True))
        loss = -log_softmax[np.arange(len(best)), best].mean()
        metrics = log["metrics"]
        assert metrics["train_reward/minibatch/loss"] == pytest.approx(loss, rel=1e-5)
        assert metrics["train_reward/minibatch/error"] == pytest.approx(loss, rel=1e-5)
