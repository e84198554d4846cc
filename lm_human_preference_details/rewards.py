"""What train_policy.py maximizes: a reward model of train_reward.py, or a programmatic reward scoring the text.

`--rewards.trained_model` names the source: a reward-model directory (OAI's only source), `vader`,
`classifier:NAME_OR_DIR[#LABEL]`, `sequence_classifier:NAME_OR_DIR` (a reward model with its own tokenizer; the
labelers of labelers.py), or `python:FILE.py:FUNCTION`, a function of the decoded queries and truncated responses of a
batch. Every source scores the raw query and the truncated response, as OAI's
reward model does; the filter penalty, the score at the last token and the KL penalty stay in train_policy.py.
A programmatic reward can be normalized on samples of the initial policy as OAI normalizes its reward model (spec RS1).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L378-L390
"""

import copy
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.checkpoint import Resumed
from lm_human_preference_details.distributed import gathered
from lm_human_preference_details.labelers import (
    SEQUENCE_CLASSIFIER,
    ConversationOf,
    Labeler,
    SequenceClassifierLabeler,
    check_sequence_classifier,
    decode_without_pad,
    load_labeler,
    sequence_classifier_target,
)
from lm_human_preference_details.modeling import RewardModel, load_reward_model, sample
from lm_human_preference_details.sizes import ceil_div
from lm_human_preference_details.tasks import (
    TASK_GOALS,
    TaskHParams,
    check_truncation_resolved,
    format_contexts,
    truncate_response,
)

FLAG = "--rewards.trained_model"
REWARD_FORMS = (
    "DIR or reward_model:DIR (a reward model written by train_reward.py)",
    "vader (VADER compound sentiment of the response, pip install vaderSentiment)",
    "classifier:NAME_OR_DIR[#LABEL] (log-probability of a label of an HF sequence classifier on the response)",
    "sequence_classifier:NAME_OR_DIR (a one-output HF reward model with its own tokenizer, on the prompt and response)",
    "python:FILE.py:FUNCTION (FUNCTION(queries, responses) of two lists of strings returns one float per episode)",
)
PROGRAMMATIC_PREFIXES = ("classifier:", SEQUENCE_CLASSIFIER, "python:")
NORMALIZE_BATCH = 64
"""queries per process and sampling batch of --rewards.normalize_samples"""


def is_programmatic(spec: str) -> bool:
    """True when `spec` names VADER, a classifier, a sequence classifier or a Python function rather than a
    reward-model directory of train_reward.py."""
    return spec == "vader" or spec.startswith(PROGRAMMATIC_PREFIXES)


def reward_model_dir(spec: str) -> str | None:
    """The reward-model directory that `spec` names (DIR or reward_model:DIR); None for a programmatic reward."""
    if is_programmatic(spec):
        return None
    return spec.removeprefix("reward_model:")


def reward_input_path(spec: str) -> str | None:
    """The local file or directory that `spec` reads (a reward model, a classifier directory, a Python file)."""
    if spec.startswith("python:"):
        return spec.removeprefix("python:").rpartition(":")[0] or None
    if spec.startswith("classifier:"):
        target = spec.removeprefix("classifier:")
        return target.rpartition("#")[0] if "#" in target else target
    if spec.startswith(SEQUENCE_CLASSIFIER):
        return spec.removeprefix(SEQUENCE_CLASSIFIER) or None
    return reward_model_dir(spec)


def check_reward_source(spec: str, normalize_samples: int) -> None:
    """ValueError unless --rewards.normalize_samples is 0, or >= 2 with a programmatic reward; a sequence classifier
    is checked (its config: one output) before anything trains."""
    flag = "--rewards.normalize_samples"
    if isinstance(normalize_samples, bool) or not isinstance(normalize_samples, int) or normalize_samples < 0:
        raise ValueError(f"{flag} must be an integer >= 0, got {normalize_samples!r}; pass 0 for the raw scores.")
    if normalize_samples and not is_programmatic(spec):
        raise ValueError(
            f"{flag} normalizes a programmatic reward (vader, classifier:, sequence_classifier:, python:), but {FLAG} "
            f"'{spec}' is a reward model, which train_reward.py already normalized (its --normalize_samples); drop "
            "the flag."
        )
    if normalize_samples == 1:
        raise ValueError(f"{flag} 1 gives no std to normalize by; pass 0 for the raw scores or e.g. 256.")
    if spec.startswith(SEQUENCE_CLASSIFIER):
        check_sequence_classifier(spec, FLAG)


class Reward:
    """Scores (B,) on the device of raw queries (B, Lq) and truncated responses (B, L); no filter penalty."""

    name: str
    metadata: dict | None = None
    """the reward model's saved metadata (tokenizer, task); None for a programmatic reward"""
    measures: str | None = None
    """what the scores measure, in the words of tasks.TASK_GOALS (vader: positive sentiment); None: not known"""
    gain: float = 1.0
    bias: float = 0.0

    def raw(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Scores (B,) before the gain and bias."""
        raise NotImplementedError

    def __call__(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """gain * score + bias (spec R4: OAI's reward model ends in the same affine map)."""
        return self.gain * self.raw(queries, responses) + self.bias


class RewardModelReward(Reward):
    """A reward model of train_reward.py on raw query ⊕ truncated response; it holds its own gain and bias."""

    def __init__(self, model: RewardModel, pad_id: int, name: str = "reward model", metadata: dict | None = None):
        self.model = model.eval().requires_grad_(False)
        self.pad_id, self.name, self.metadata = pad_id, name, metadata
        self.measures = TASK_GOALS.get((metadata or {}).get("task_name"))

    def raw(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """One forward; the rollout's queries start with a real token, so the check and its host sync are skipped."""
        return self.model(torch.cat([queries, responses], 1), self.pad_id, False)

    __call__ = raw  # the model's own gain and bias, set by train_reward.py, are already applied


class LabelerReward(Reward):
    """VADER or an HF classifier on the decoded truncated response, or a sequence classifier on the decoded prompt and
    response (labelers.py)."""

    def __init__(self, labeler: Labeler, device: torch.device):
        self.labeler, self.device, self.name = labeler, device, labeler.name
        self.measures = labeler.measures

    def raw(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """The labeler's score of each episode as one response per query."""
        return self.labeler.scores(queries, responses[:, None])[:, 0].to(self.device)


class PythonReward(Reward):
    """FUNCTION(queries, responses) of a Python file on the decoded raw queries and truncated responses."""

    def __init__(
        self, spec: str, function: Callable, tokenizer: PreTrainedTokenizerBase, pad_id: int, device, flag: str = FLAG
    ):
        self.name, self.function = spec, function
        self.who = f"reward function {spec} ({flag})"
        """how errors name the function"""
        self.tokenizer, self.pad_id, self.device = tokenizer, pad_id, device

    def raw(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """The function's floats; ValueError naming the function when it raises or returns wrong or non-finite ones."""
        query_texts = decode_without_pad(self.tokenizer, queries, self.pad_id)
        response_texts = decode_without_pad(self.tokenizer, responses, self.pad_id)
        try:
            result = self.function(query_texts, response_texts)
        except Exception as e:
            raise ValueError(
                f"{self.who} raised {type(e).__name__}: {one_line(str(e))}; fix the function "
                "(run with --debug for its traceback)."
            ) from e
        return self.check_scores(result, response_texts).to(self.device)

    def check_scores(self, result, response_texts: list[str]) -> torch.Tensor:
        """(B,) float64 tensor of the function's result; ValueError unless it is B finite numbers."""
        fix = f"it must return one finite float per episode ({len(response_texts)} here), in the order given"
        try:
            scores = torch.as_tensor(result, dtype=torch.float64, device="cpu")
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"{self.who} returned {type(result).__name__} {one_line(repr(result))[:80]}, not numbers; {fix}."
            ) from e
        if scores.dim() != 1 or scores.numel() != len(response_texts):
            raise ValueError(
                f"{self.who} returned {scores.numel()} scores of shape {tuple(scores.shape)} "
                f"for {len(response_texts)} episodes; {fix}."
            )
        bad = (~torch.isfinite(scores)).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise ValueError(
                f"{self.who} returned the non-finite score {scores[i].item()} for episode "
                f"{i} (response {response_texts[i][:60]!r}){more}; {fix}."
            )
        return scores.float()


def one_line(text: str) -> str:
    """`text` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(text.split())


def python_file_and_function(spec: str, flag: str = FLAG) -> tuple[str, str]:
    """FILE.py and FUNCTION of `python:FILE.py:FUNCTION`; ValueError in one line for another form."""
    path, _, name = spec.removeprefix("python:").rpartition(":")
    if not path or not name or not path.endswith(".py"):
        raise ValueError(
            f"{flag} '{spec}' is not of the form python:FILE.py:FUNCTION; pass {flag} python:FILE.py:FUNCTION."
        )
    return path, name


def load_python_function(spec: str, flag: str = FLAG) -> Callable:
    """FUNCTION of FILE.py for `python:FILE.py:FUNCTION`; FileNotFoundError or ValueError in one line otherwise."""
    path, name = python_file_and_function(spec, flag)
    usage = f"pass {flag} python:FILE.py:FUNCTION"
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward file '{path}' of {flag} '{spec}' does not exist (a relative path is read from the working "
            f"directory, {os.getcwd()}); {usage} with an existing file."
        )
    module_name = f"_reward_{abs(hash(os.path.realpath(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(
            f"reward file '{path}' of {flag} failed to import: {type(e).__name__}: {one_line(str(e))}"
        ) from e
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(
            k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module_name
        )
        raise ValueError(
            f"reward file '{path}' has no function '{name}' ({flag} '{spec}'); its functions: "
            f"{', '.join(found) or 'none'}. {usage}."
        )
    return function


def load_reward(
    spec: str,
    tokenizer: PreTrainedTokenizerBase,
    pad_id: int,
    device: torch.device,
    flag: str = FLAG,
    conversation_of: ConversationOf | None = None,
) -> Reward:
    """The reward that `spec` names (REWARD_FORMS), on `device`, with gain 1 and bias 0; errors name `flag`.
    `conversation_of`: a query's chat messages, for a sequence classifier with a chat template (labelers.py)."""
    if spec.startswith("python:"):
        return PythonReward(spec, load_python_function(spec, flag), tokenizer, pad_id, device, flag)
    if spec.startswith(SEQUENCE_CLASSIFIER):
        target = sequence_classifier_target(spec, flag)
        labeler = SequenceClassifierLabeler(target, tokenizer, pad_id, device, flag, conversation_of)
        return LabelerReward(labeler, device)
    if is_programmatic(spec):
        return LabelerReward(load_labeler(spec, tokenizer, pad_id, device, flag=flag), device)
    directory = reward_model_dir(spec)
    if not os.path.isdir(directory):
        forms = "; ".join(REWARD_FORMS)
        raise FileNotFoundError(f"reward model directory '{directory}' ({flag}) does not exist; valid forms: {forms}.")
    model, metadata = load_reward_model(directory, flag=flag)
    return RewardModelReward(model.to(device), pad_id, directory, metadata)


def attach_conversations(conversation_of: ConversationOf | None, *scorers: Reward | Labeler | None) -> None:
    """Give every sequence classifier among `scorers` (a reward, the gold labeler) the query stream's chat messages
    (`conversation_of`); the other scorers see the decoded query text, as before."""
    for scorer in scorers:
        labeler = getattr(scorer, "labeler", scorer)
        if isinstance(labeler, SequenceClassifierLabeler):
            labeler.conversation_of = conversation_of


# ---------------------------------------------------------------- normalization on the initial policy's samples


@torch.no_grad()
def normalize_reward(
    reward: Reward,
    policy,
    query_stream,
    affixes: tuple[torch.Tensor, torch.Tensor],
    task: TaskHParams,
    num_samples: int,
    seed: int,
    accelerator,
) -> dict[str, float]:
    """The gain and bias that give the raw scores of `num_samples` samples of the initial policy (over all processes,
    sampled with `seed`) mean 0 and std 1, and the measured mean, std and number of samples."""
    # OAI's reward-model normalization (spec R4): gain = 1 / std, bias = -mean / std (population std). The reward scores
    # what it scores in training, the raw query and the truncated response; the filter penalty (a fixed value) is not
    # part of what is normalized.
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L149-L219
    check_truncation_resolved(task)
    generator = torch.Generator(device=accelerator.device).manual_seed(seed)
    pad_id = query_stream.pad_id
    scores, remaining = [], ceil_div(num_samples, accelerator.num_processes)  # this process's share
    while remaining > 0:
        queries = query_stream.next_batch(min(remaining, NORMALIZE_BATCH)).to(accelerator.device)
        remaining -= len(queries)
        contexts = format_contexts(queries, *affixes)
        responses, _, _ = sample(
            policy, contexts, task.response_length, task.temperature, pad_id, generator, check_first_token=False
        )
        truncated = truncate_response(responses, task.truncate_token, task.truncate_after, pad_id)
        scores.append(reward.raw(queries, truncated).float())
    scores = torch.cat(scores)
    moments = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), reduction="mean")
    mean, std = moments[0].item(), (moments[1] - moments[0].square()).clamp_min(0).sqrt().item()
    count = accelerator.num_processes * len(scores)
    if not math.isfinite(std) or std <= 1e-8:
        raise ValueError(
            f"--rewards.normalize_samples: {reward.name} gave every one of the initial policy's {count} samples the "
            f"same score ({mean:.6g}), so there is no std to divide by; drop --rewards.normalize_samples or use a "
            "reward that varies across samples."
        )
    return {"gain": 1.0 / std, "bias": -mean / std, "mean": mean, "std": std, "samples": count}


def normalize_from_initial_policy(
    reward: Reward,
    samples: int,
    resumed: Resumed | None,
    reference: Callable[[], AbstractContextManager],
    query_stream,
    affixes: tuple[torch.Tensor, torch.Tensor],
    task: TaskHParams,
    seed: int,
    accelerator,
) -> dict[str, float] | None:
    """--rewards.normalize_samples: set a programmatic reward's gain and bias (spec R4) from that many samples of
    the initial policy (`reference()` lends it) on the queries the first updates draw (a copy of `query_stream`: the
    stream itself does not move), or take a resumed run's own; print them; -> them, for the run config, args.json
    and the training state (None: 0 samples, raw scores)."""
    if not samples:
        return None
    normalization = resumed.meta.get("reward_normalization") if resumed else None
    if not normalization:
        # an --fsdp run's sharded reference gathered once for all the sampling steps
        with reference() as ref_policy, gathered(ref_policy):
            stream = copy.deepcopy(query_stream)
            normalization = normalize_reward(reward, ref_policy, stream, affixes, task, samples, seed, accelerator)
    reward.gain, reward.bias = normalization["gain"], normalization["bias"]
    accelerator.print(describe_normalization(normalization))
    return normalization


def describe_normalization(normalization: dict[str, float]) -> str:
    """One line: what was measured on the initial policy's samples and the gain and bias it gave."""
    n = normalization
    return (
        f"reward normalization on {n['samples']} samples of the initial policy: mean {n['mean']:.4g}, std "
        f"{n['std']:.4g} -> gain {n['gain']:.4g}, bias {n['bias']:.4g}"
    )
