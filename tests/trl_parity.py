"""TRL 0.29.1's `PPOTrainer.train()` beside `train_policy.main` on the same inputs (tests/test_trl_parity.py): the
world both read, a run of each that records every quantity of its updates, and the rows that compare them.

Both sides run their real entry points on a tiny GPT-NeoX policy (TRL's TL;DR example trains Pythia), reference
policy, reward model and value model (the reward model, as in TRL's example) of the same weights, with the same
queries, the same sampled tokens and the same minibatch permutations:

- the queries are TRL's batches (its dataloader shuffles them), handed to train_policy.py's query stream;
- the tokens are forced: TRL's `generate` runs with `torch.multinomial` returning them, train_policy.py's sampler with
  each step's uniform chosen inside the forced token's slice of the CDF, so each side's own code computes the
  log-probs of the tokens it samples;
- TRL draws each epoch's permutation from NumPy's global RNG, which it never seeds: seeded here with the run's seed, it
  draws what train_policy.py's RNG of that seed draws (compared, not forced).

TRL keeps its quantities in the locals of `train()`; a line tracer copies them at three lines of its source (found
by text, so a moved line fails loudly). The optimizers of both sides are observed through torch's step hooks.

`python -m tests.trl_parity` prints the rows of the switch and the size of every difference of
docs/migrating-from-trl.md, each measured as the switch minus that setting.
"""

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXModel,
    PreTrainedTokenizerFast,
)

import train_policy
from lm_human_preference_details import data, distributed, modeling, optim, presets, tasks
from lm_human_preference_details.modeling import RewardModel
from lm_human_preference_details.nplus.end_at_eos import ResponseMasks
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint

TRL_VERSION = "0.29.1"
"""the TRL the switch matches, pinned in pyproject's test extra: the test reads its train() by source line"""
try:
    import trl
except ImportError as e:  # a failure, not a skip: the test extra installs it
    raise ImportError(f"the TRL parity test needs trl=={TRL_VERSION}: pip install -e '.[test]'") from e
if trl.__version__ != TRL_VERSION:
    raise ImportError(f"the TRL parity test needs trl=={TRL_VERSION}, not {trl.__version__}: pip install -e '.[test]'")
with warnings.catch_warnings():  # TRL warns on every import of trl.experimental
    warnings.simplefilter("ignore")
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

SEED = 1
QUERY_LENGTH = 5
RESPONSE_LENGTH = 6
BATCH = 16
"""episodes per update, one process"""
MICRO = 4
"""TRL's per_device_train_batch_size"""
ACCUMULATION = 4
"""TRL's gradient_accumulation_steps: 4 micro-batches of 4 per epoch, one optimizer step per epoch"""
TRL_MINIBATCHES = 2
"""TRL's num_mini_batches: 2 mini-batches of 2 micro-batches; TRL 0.29.1 still steps once per epoch"""
EPOCHS = 2
UPDATES = 2
LR = 1e-3
"""large enough that 4 Adam steps move the policy past the clip range (clip fractions of up to 0.8)"""
KL_COEF = 0.05
WORDS = ["<|endoftext|>", "<unk>"] + [f"w{i}" for i in range(94)]
"""a word-level vocabulary of 96 tokens: EOS is 0, and load_tokenizer adds PAD as 96, outside the model's embedding"""
EOS, VOCAB = 0, len(WORDS)
PASS_BATCHES = 3
"""batches in one pass of TRL's dataloader: the 2 updates draw the first two, so neither meets the end of the pass,
where accelerate syncs every micro-batch and TRL steps the optimizer after each (`dataloader_end_steps` measures it)"""
ROUNDING_GRADIENT = 1e-6
"""a gradient element below this fraction of its tensor's largest is rounding noise (the attention key biases: their
exact gradient is 0, as softmax ignores a constant added to every logit)"""


@dataclass
class World:
    """What both sides read: model directories, the query rows of TRL's dataset, the task and the forced tokens."""

    policy: str
    reward: str
    queries_file: str
    rows: list[list[int]]
    task: tasks.TaskHParams
    tokenizer: Any
    forced: list[torch.Tensor]
    """(BATCH, RESPONSE_LENGTH) tokens each update samples, for up to PASS_BATCHES updates"""


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over WORDS, EOS first (the GPT-NeoX tokenizer's EOS is a BOS too)."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=WORDS[EOS], unk_token="<unk>")


def tiny_neox(seed: int) -> GPTNeoXConfig:
    """A 2-layer, 32-wide GPT-NeoX config over the word vocabulary (dropout off by default), seeding torch."""
    torch.manual_seed(seed)
    return GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.25,
        max_position_embeddings=64,
        eos_token_id=EOS,
        bos_token_id=EOS,
    )


def forced_tokens() -> list[torch.Tensor]:
    """Each update's sampled tokens (a pass of TRL's dataloader): row r's first EOS at (r + update) % 8 (index 0 to 5,
    or none: the penalty), row 0 without EOS, so TRL's `generate`, which stops once every row has its EOS, runs all
    RESPONSE_LENGTH steps."""
    generator = torch.Generator().manual_seed(3)
    forced = []
    for update in range(PASS_BATCHES):
        tokens = torch.randint(1, VOCAB, (BATCH, RESPONSE_LENGTH), generator=generator)
        for row in range(1, BATCH):
            end = (row + update) % (RESPONSE_LENGTH + 2)
            if end < RESPONSE_LENGTH:
                tokens[row, end] = EOS
        forced.append(tokens)
    return forced


def make_world(root: str) -> World:
    """The policy (the reference policy is a second copy on both sides) and the reward model, which is also the
    value model's start; the reward model is train_reward.py's GPT-NeoX export, a sequence classifier TRL loads."""
    policy_dir, reward_dir = os.path.join(root, "policy"), os.path.join(root, "reward")
    GPTNeoXForCausalLM(tiny_neox(0)).save_pretrained(policy_dir)
    word_tokenizer().save_pretrained(policy_dir)
    tokenizer = load_tokenizer(policy_dir)
    queries_file = os.path.join(root, "queries.txt")  # read by train_policy.py's query stream, whose batches are TRL's
    with open(queries_file, "w", encoding="utf-8") as f:
        f.write("w1 w2 w3\nw4 w5\n")
    task = dataclasses.replace(
        presets.TRL_TASK,
        query_dataset=queries_file,
        query_template=None,
        query_truncate_field=None,
        query_length=QUERY_LENGTH,
        response_length=RESPONSE_LENGTH,
    )
    task = tasks.resolve_truncation(task, tokenizer)
    reward = RewardModel(GPTNeoXModel(tiny_neox(1)))
    with torch.no_grad():  # scores of a few units, so that the penalty and the whitening matter
        reward.head.weight.normal_(0.0, 1.0)
    metadata = {
        "base_model": policy_dir,
        "tokenizer": policy_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "task": dataclasses.asdict(task),
        "task_name": "trl_tldr",
    }
    reward.save(reward_dir, metadata)
    tokenizer.save_pretrained(reward_dir)
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(2, QUERY_LENGTH + 1, (PASS_BATCHES * BATCH,), generator=generator)
    rows = [torch.randint(1, VOCAB, (int(n),), generator=generator).tolist() for n in lengths]
    return World(policy_dir, reward_dir, queries_file, rows, task, tokenizer, forced_tokens())


# ---------------------------------------------------------------- recording


def _copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().clone()
    return np.array(value, copy=True) if isinstance(value, np.ndarray) else value


class LocalsTracer:
    """Copies of the tensor, array and int locals of `function` each time its frame reaches one of `lines` (name -> the
    source text a line starts with, which must occur once)."""

    def __init__(self, function, lines: dict[str, str]):
        self.code = function.__code__
        source, first = inspect.getsourcelines(function)
        self.names = {}
        for name, text in lines.items():
            found = [first + i for i, line in enumerate(source) if line.strip().startswith(text)]
            if len(found) != 1:
                raise AssertionError(f"{text!r} is {len(found)} lines of {function.__qualname__}, not 1")
            self.names[found[0]] = name
        self.snapshots: dict[str, list[dict[str, Any]]] = {name: [] for name in lines}

    def _line(self, frame, event, arg):
        if event == "line" and frame.f_lineno in self.names:
            kept = (torch.Tensor, np.ndarray, int)
            values = {k: _copy(v) for k, v in frame.f_locals.items() if isinstance(v, kept)}
            self.snapshots[self.names[frame.f_lineno]].append(values)
        return self._line

    def _call(self, frame, event, arg):
        return self._line if frame.f_code is self.code else None

    @contextlib.contextmanager
    def tracing(self):
        previous = sys.gettrace()
        sys.settrace(self._call)
        try:
            yield
        finally:
            sys.settrace(previous)


@dataclass
class StepRecord:
    """Every optimizer step of a run: learning rates, gradients before it and weights after it, by TRL's names."""

    lrs: list[float] = field(default_factory=list)
    gradients: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def observe(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
        """Record each step of `optimizer` (torch's step hooks) under `names` (id of a parameter -> name)."""

        def params():
            return [p for group in optimizer.param_groups for p in group["params"]]

        def before(opt, args, kwargs):
            self.lrs.append(opt.param_groups[0]["lr"])
            self.gradients.append({names[id(p)]: p.grad.detach().clone() for p in params() if p.grad is not None})

        def after(opt, args, kwargs):
            self.weights.append({names[id(p)]: p.detach().clone() for p in params()})

        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)


@dataclass
class TrlRun:
    """TRL's locals at three lines of `train()` and its optimizer steps."""

    before_whitening: list[dict]
    """each update's locals at step 5 (`if args.whiten_rewards:`): its rewards before whitening"""
    epochs: list[dict]
    """each epoch's locals once it drew its permutation (`minibatch_idx = 0`): the rollout, masks, advantages"""
    micro_batches: list[dict]
    """each micro-batch's locals after its backward and optimizer call (`gradient_accumulation_idx += 1`)"""
    steps: StepRecord
    metrics: list[dict]

    def rollout(self, update: int) -> dict:
        return [e for e in self.epochs if int(e["ppo_epoch_idx"]) == 0][update]


@contextlib.contextmanager
def trl_quiet():
    """TRL's own deprecated calls into transformers (its arguments, generation config) are TRL's affair: not shown."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def run_trl(world: World, root: str, updates: int = UPDATES) -> TrlRun:
    """TRL's PPOTrainer(...).train() on the world: TL;DR example settings at the test's sizes (stop at EOS,
    missing_eos_penalty 1, fixed kl 0.05, here with k3 and reward whitening), its defaults otherwise."""
    forced = iter(world.forced)
    generate = trl_ppo.generate

    def forced_generate(lm, queries, pad_token_id, generation_config):
        tokens = next(forced)
        steps = iter(range(RESPONSE_LENGTH))
        with mock.patch.object(torch, "multinomial", lambda probs, num_samples: tokens[:, next(steps), None].clone()):
            return generate(lm, queries, pad_token_id, generation_config)

    tokenizer = copy.deepcopy(world.tokenizer)
    tokenizer.padding_side = "left"  # TRL's example pads its prompts on the left
    with trl_quiet():  # PPOConfig passes deprecated TrainingArguments fields
        config = PPOConfig(
            output_dir=os.path.join(root, "trl"),
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUMULATION,
            num_mini_batches=TRL_MINIBATCHES,
            num_ppo_epochs=EPOCHS,
            total_episodes=updates * BATCH,
            local_rollout_forward_batch_size=BATCH,
            response_length=RESPONSE_LENGTH,
            stop_token="eos",
            missing_eos_penalty=1.0,
            kl_coef=KL_COEF,
            kl_estimator="k3",
            whiten_rewards=True,
            learning_rate=LR,
            seed=SEED,
            bf16=False,
            report_to="none",
            save_strategy="no",
            num_sample_generations=0,
            logging_steps=1,
            disable_tqdm=True,
            use_cpu=True,
        )
    metrics = []
    with trl_quiet():
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=AutoModelForCausalLM.from_pretrained(world.policy),
            ref_model=AutoModelForCausalLM.from_pretrained(world.policy),
            reward_model=AutoModelForSequenceClassification.from_pretrained(world.reward),
            value_model=AutoModelForSequenceClassification.from_pretrained(world.reward),
            train_dataset=Dataset.from_dict({"input_ids": world.rows}),
            eval_dataset=Dataset.from_dict({"input_ids": world.rows}),
        )
        steps = StepRecord()
        steps.observe(trainer.optimizer.optimizer, {id(p): n for n, p in trainer.model.named_parameters()})
        tracer = LocalsTracer(
            PPOTrainer.train,
            {
                "before_whitening": "if args.whiten_rewards:",
                "epochs": "minibatch_idx = 0",
                "micro_batches": "gradient_accumulation_idx += 1",
            },
        )
        np.random.seed(SEED)  # TRL's permutations come from NumPy's global RNG
        with mock.patch.object(trl_ppo, "generate", forced_generate), mock.patch.object(trainer, "log", metrics.append):
            with tracer.tracing():
                trainer.train()
    return TrlRun(**tracer.snapshots, steps=steps, metrics=metrics)


@dataclass
class OurRun:
    """train_policy.main's quantities, from wrappers of the functions that compute them."""

    rollouts: list = field(default_factory=list)
    rewards: list[dict] = field(default_factory=list)
    passed: list[torch.Tensor] = field(default_factory=list)
    advantages: list[tuple] = field(default_factory=list)
    losses: list[dict] = field(default_factory=list)
    indices: list[np.ndarray] = field(default_factory=list)
    steps: StepRecord = field(default_factory=StepRecord)
    history: list[dict] = field(default_factory=list)


def switch_flags(world: World, output_dir: str) -> list[str]:
    """`--task trl_tldr` at the test's sizes, on the world's models, with the test's k3, reward whitening and lr."""
    return [
        *("--task", "trl_tldr", "--base_model", world.policy, "--rewards.trained_model", world.reward),
        *("--task.query_dataset", world.queries_file, "--task.query_template", "None"),
        *("--task.query_truncate_field", "None", "--task.query_length", str(QUERY_LENGTH)),
        *("--task.response_length", str(RESPONSE_LENGTH), "--rewards.kl_estimator", "k3", "--ppo.whiten_rewards"),
        *("--ppo.batch_size", str(BATCH), "--ppo.total_episodes", str(UPDATES * BATCH)),
        *("--ppo.noptepochs", str(EPOCHS), "--ppo.gradient_accumulation_steps", str(ACCUMULATION)),
        *("--ppo.lr", str(LR), "--rewards.kl_coef", str(KL_COEF), "--seed", str(SEED)),
        *("--save_interval", "0", "--output_dir", output_dir),
    ]


def run_ours(world: World, trl: TrlRun, flags: list[str]) -> OurRun:
    """train_policy.main(parse(flags)) on TRL's queries and the forced tokens, recording every quantity."""
    run = OurRun()
    queries = iter([trl.rollout(u)["queries"] for u in range(len(trl.before_whitening))])
    forced, decodes, learner = iter(world.forced), [], {}
    sample, sample_categorical = modeling.sample, modeling.sample_categorical
    rollout, compute_rewards, passes_filter = train_policy.rollout, train_policy.compute_rewards, tasks.passes_filter
    minibatch_advantages, ppo_losses = ResponseMasks.minibatch_advantages, train_policy.ppo_losses
    minibatch_indices, data_parallel, make_optimizer = (
        train_policy.minibatch_indices,
        distributed.data_parallel,
        optim.make_optimizer,
    )

    def forced_sample(*args, **kwargs):
        decodes.append((next(forced), iter(range(RESPONSE_LENGTH))))
        return sample(*args, **kwargs)

    def forced_categorical(logits, uniform):
        # the uniform at the middle of the forced token's slice of the CDF, in the sampler's own arithmetic
        tokens, steps = decodes[-1]
        token = tokens[:, next(steps), None]
        cdf = (logits - logits.amax(-1, keepdim=True)).exp().cumsum(-1, dtype=torch.float64)
        upper = cdf.gather(-1, token)
        lower = torch.where(token > 0, cdf.gather(-1, (token - 1).clamp_min(0)), 0.0)
        return sample_categorical(logits, (lower + upper) / 2 / cdf[:, -1:])

    def recorded_rollout(*args, **kwargs):
        run.rollouts.append(rollout(*args, **kwargs))
        return run.rollouts[-1]

    def recorded_rewards(scores, logprobs, ref_logprobs, *args):
        out = compute_rewards(scores, logprobs, ref_logprobs, *args)
        run.rewards.append({"scores": scores, "ref_logprobs": ref_logprobs, "kl": out[2], "non_score": out[1]})
        return out

    def recorded_filter(*args):
        run.passed.append(passes_filter(*args))
        return run.passed[-1]

    def recorded_advantages(self, *args, **kwargs):
        run.advantages.append(minibatch_advantages(self, *args, **kwargs))
        return run.advantages[-1]

    def recorded_losses(new_logprobs, vpred, *args, **kwargs):
        out = ppo_losses(new_logprobs, vpred, *args, **kwargs)
        detached = {k: v.detach().clone() for k, v in out.items()}
        run.losses.append({"new_logprobs": new_logprobs.detach().clone(), "vpred": vpred.detach().clone(), **detached})
        return out

    def recorded_indices(*args):
        run.indices.append(minibatch_indices(*args))
        return run.indices[-1]

    def recorded_learner(module, *args):
        learner["module"] = module
        return data_parallel(module, *args)

    def observed_optimizer(*args, **kwargs):
        optimizer = make_optimizer(*args, **kwargs)
        names = {id(p): trl_name(n) for n, p in learner["module"].named_parameters()}
        run.steps.observe(optimizer, names)
        return optimizer

    patches = [
        (modeling, "sample", forced_sample),
        (modeling, "sample_categorical", forced_categorical),
        (data.QueryStream, "next_batch", lambda self, size, virtual_ranks=1: next(queries).clone()),
        (train_policy, "rollout", recorded_rollout),
        (train_policy, "compute_rewards", recorded_rewards),
        (tasks, "passes_filter", recorded_filter),
        (ResponseMasks, "minibatch_advantages", recorded_advantages),
        (train_policy, "ppo_losses", recorded_losses),
        (train_policy, "minibatch_indices", recorded_indices),
        (distributed, "data_parallel", recorded_learner),
        (optim, "make_optimizer", observed_optimizer),
    ]
    with contextlib.ExitStack() as stack:
        for target, name, replacement in patches:
            stack.enter_context(mock.patch.object(target, name, replacement))
        run.history = train_policy.main(train_policy.parse(flags))
    return run


TRL_NAMES = (
    ("policy.lm.", "policy."),
    ("critic.trunk.", "value_model.gpt_neox."),
    ("critic.head.", "value_model.score."),
)
"""train_policy.py's learner's parameter name prefixes, and TRL's"""


def trl_name(name: str) -> str:
    """The TRL parameter name of one of train_policy.py's learner (PolicyWithCritic): policy.lm.X is TRL's policy.X,
    the critic's trunk and head its value model's gpt_neox and score; the policy's frozen value head is its own."""
    for ours, theirs in TRL_NAMES:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


# ---------------------------------------------------------------- comparison


@dataclass
class Row:
    """One quantity of both runs, over every update, micro-batch or step: its largest difference and tolerance."""

    name: str
    difference: float = 0.0
    scale: float = 0.0
    exact: bool = False
    pairs: int = 0
    limit: float | None = None
    """a tolerance of its own, instead of the rounding one"""

    def add(self, theirs: torch.Tensor, ours: torch.Tensor) -> None:
        self.pairs += 1
        if theirs.shape != ours.shape:
            self.difference = float("inf")
            return
        if theirs.numel():
            diff = (theirs.double() - ours.double()).abs().max().item()
            self.difference = max(self.difference, diff if diff == diff else float("inf"))
            self.scale = max(self.scale, theirs.double().abs().max().item())

    @property
    def tolerance(self) -> float:
        """0 for tokens, indices, masks and counts; else 1e-5 of the row's largest value (at least 1e-5): float32
        rounding (6e-8 relative) of two codes that sum, normalize and backpropagate in other orders, with 30x room
        over the largest difference seen (3e-7 relative, the value loss and the gradients)."""
        if self.limit is not None:
            return self.limit
        return 0.0 if self.exact else 1e-5 * max(1.0, self.scale)

    @property
    def equal(self) -> bool:
        return self.pairs > 0 and self.difference <= self.tolerance


EXACT_ROWS = (
    "queries",
    "responses up to s",
    "postprocessed responses",
    "s",
    "mask t > s",
    "mask t > s + 1",
    "passes filter",
    "minibatch order",
    "micro-batch rows",
    "optimizer steps",
    "trained parameters (names only one side has)",
)


def compare(trl: TrlRun, ours: OurRun) -> dict[str, Row]:
    """Every row of docs/migrating-from-trl.md#parity-test, in the order one update computes them."""
    rows: dict[str, Row] = {}

    def add(name: str, theirs, mine) -> None:
        row = rows.setdefault(name, Row(name, exact=name in EXACT_ROWS))
        row.add(torch.as_tensor(theirs), torch.as_tensor(mine))

    updates = len(trl.before_whitening)
    minibatches = len(ours.indices[0][0])  # per epoch
    for update in range(min(updates, len(ours.rollouts))):
        t, rollout, rewards = trl.rollout(update), ours.rollouts[update], ours.rewards[update]
        context, kept = t["queries"].shape[1], ~t["padding_mask"]
        # our rewards, advantages and returns come per minibatch, in its rows' order: epoch 0's put back in place
        first = update * EPOCHS * minibatches
        advantages = [torch.empty_like(rollout.rewards) for _ in range(3)]
        for k in range(minibatches):
            rows_k = torch.as_tensor(ours.indices[update][0][k])
            for whole, part in zip(advantages, ours.advantages[first + k]):
                whole.index_copy_(0, rows_k, part)
        add("queries", t["queries"], rollout.query_responses[:, :context])
        # after EOS TRL's generate writes its PAD (EOS here) and train_policy.py samples on; nothing after s is read
        add("responses up to s", t["responses"] * kept, rollout.query_responses[:, context:] * kept)
        add("postprocessed responses", t["postprocessed_responses"], rollout.samples[1])
        add("s", t["sequence_lengths"], rollout.masks.ends)
        add("mask t > s", t["padding_mask"], rollout.masks.after_end)
        add("mask t > s + 1", t["padding_mask_p1"], rollout.masks.after_value_end)
        add("logprobs (INVALID_LOGPROB after s)", t["logprobs"], rollout.logprobs)
        add("ref logprobs", t["ref_logprobs"], rewards["ref_logprobs"])
        add("values (0 after s + 1)", t["values"], rollout.values)
        add("passes filter", t["contain_eos_token"], ours.passed[update])
        add("scores after the penalty", t["scores"], rewards["scores"])
        add("kl (k3)", t["kl"], rewards["kl"])
        add("non-score rewards", t["non_score_reward"], rewards["non_score"])
        add("rewards", trl.before_whitening[update]["rewards"], rollout.rewards)
        add("whitened rewards", t["rewards"], advantages[0])
        add("advantages", t["advantages"], advantages[1])
        add("returns", t["returns"], advantages[2])
        for epoch in range(EPOCHS):
            theirs = trl.epochs[update * EPOCHS + epoch]["b_inds"]
            add("minibatch order", theirs, ours.indices[update][epoch].reshape(-1))
    micro = len(ours.losses[0]["ratio"])  # rows per micro-batch
    micro_rows = [
        rows_of_micro
        for update_indices in ours.indices
        for epoch_indices in update_indices
        for minibatch in epoch_indices
        for rows_of_micro in np.split(minibatch, len(minibatch) // micro)
    ]
    for theirs, mine, mine_rows in zip(trl.micro_batches, ours.losses, micro_rows):
        add("micro-batch rows", theirs["micro_batch_inds"], mine_rows)
        add("new logprobs", theirs["new_logprobs"], mine["new_logprobs"])
        add("vpred", theirs["vpred"], mine["vpred"])
        add("ratio", theirs["ratio"], mine["ratio"])
        add("policy loss", theirs["pg_loss"], mine["loss/policy"])
        add("value loss", theirs["vf_loss"], mine["loss/value"])
        add("loss", theirs["loss"], mine["loss/total"])
        add("policy clip fraction", theirs["pg_clipfrac"], mine["policy/clipfrac"])
        add("value clip fraction", theirs["vf_clipfrac"], mine["val/clipfrac"])
    add("optimizer steps", len(trl.steps.weights), len(ours.steps.weights))
    trained = set(trl.steps.weights[0]) ^ set(ours.steps.weights[0]) if ours.steps.weights else {"all"}
    add("trained parameters (names only one side has)", len(trained), 0)
    noise = rows.setdefault(NOISE_ROW, Row(NOISE_ROW))
    rounding = {}  # per parameter: the elements whose gradient has been rounding noise at some step so far
    for step, (theirs, mine) in enumerate(zip(trl.steps.gradients, ours.steps.gradients)):
        add("learning rate", trl.steps.lrs[step], ours.steps.lrs[step])
        for name, gradient in theirs.items():
            add("gradients", gradient, mine.get(name, torch.full_like(gradient, torch.nan)))
            small = gradient.abs() <= ROUNDING_GRADIENT * gradient.abs().max()
            rounding[name] = rounding.get(name, torch.zeros_like(small)) | small
        for name, weight in trl.steps.weights[step].items():
            mine_weight = ours.steps.weights[step].get(name, torch.full_like(weight, torch.nan))
            add("weights after each step", weight[~rounding[name]], mine_weight[~rounding[name]])
            # Adam moves an element by up to about lr per step whatever its gradient's size, so one whose gradient is
            # rounding noise moves by a noise-driven part of lr: checked against that bound
            noise.add(weight[rounding[name]], mine_weight[rounding[name]])
            noise.limit = LR
    return rows


NOISE_ROW = "weights after each step, elements with a rounding-noise gradient"


def red(rows: dict[str, Row]) -> list[str]:
    """The rows whose difference exceeds their tolerance (or that compared nothing)."""
    return [name for name, row in rows.items() if not row.equal]


def table(rows: dict[str, Row]) -> str:
    """Markdown rows: quantity, how many tensors it compared, TRL's largest value, the largest difference, the
    tolerance, equal."""
    lines = ["| quantity | compared | largest TRL value | largest difference | tolerance | equal |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows.values():
        cells = [
            r.name,
            r.pairs,
            f"{r.scale:.3g}",
            f"{r.difference:.3g}",
            f"{r.tolerance:.3g}",
            "yes" if r.equal else "NO",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


DIFFERENCES = {
    "whitening variance (--ppo.whiten_variance population)": ["--ppo.whiten_variance", "population"],
    "whitening groups (--ppo.whiten_group_size 8: two virtual ranks)": ["--ppo.whiten_group_size", "8"],
    "critic head bias (--ppo.value_head_bias)": ["--ppo.value_head_bias"],
    "Adam epsilon (--eps 1e-5)": ["--eps", "1e-5"],
    "loss means (--ppo.loss_means minibatch)": ["--ppo.loss_means", "minibatch"],
    "one step per mini-batch (--ppo.nminibatches 2 --ppo.gradient_accumulation_steps 2)": [
        *("--ppo.nminibatches", str(TRL_MINIBATCHES)),
        *("--ppo.gradient_accumulation_steps", str(ACCUMULATION // TRL_MINIBATCHES)),
    ],
    "missing-EOS penalty (--task.penalty_mode replace)": [
        *("--task.penalty_mode", "replace", "--rewards.allow_task_mismatch")
    ],
}
"""docs/migrating-from-trl.md's differences: the flags that put each back to its default under the switch"""


def dataloader_end_steps(world: World, root: str) -> int:
    """TRL's optimizer steps in the update that draws the last batch of its dataloader's pass (epochs x micro-batches
    where every other update steps once per epoch)."""
    trl = run_trl(world, os.path.join(root, "pass"), updates=PASS_BATCHES)
    return len(trl.steps.weights) - (PASS_BATCHES - 1) * EPOCHS


def main() -> None:
    """The switch's rows, then for each difference the rows it makes differ and their largest difference."""
    with tempfile.TemporaryDirectory() as root:
        world = make_world(root)
        trl = run_trl(world, root)
        rows = compare(trl, run_ours(world, trl, switch_flags(world, os.path.join(root, "switch"))))
        report = [table(rows), ""]
        for i, (name, flags) in enumerate(DIFFERENCES.items()):
            output_dir = os.path.join(root, f"difference{i}")
            planted = compare(trl, run_ours(world, trl, switch_flags(world, output_dir) + flags))
            weights = planted["weights after each step"]
            report.append(
                f"- {name}: {len(red(planted))} of {len(planted)} rows differ; the weights after the steps by up to "
                f"{weights.difference:.3g} (tolerance {weights.tolerance:.3g})"
            )
        report.append(f"- TRL's update at the end of its dataloader's pass: {dataloader_end_steps(world, root)} steps")
    print("\n".join(report))


if __name__ == "__main__":
    main()
