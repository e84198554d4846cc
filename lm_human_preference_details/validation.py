"""Checks that run before a script deletes, overwrites, downloads or trains anything, and the non-finite guards.

Every check raises ValueError (or OutputError for a directory that cannot be written) with one line naming the
problem, the flag and the fix; `cli.run` prints it as one `error:` line. The scripts call `check_*_args` first thing
in `main`; the training loops count non-finite entries on the device into the statistics they already reduce once
per step, and `check_finite_stats` names the tensor that went bad.
"""

import dataclasses
import errno
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PreTrainedTokenizerBase

from lm_human_preference_details import files, lora
from lm_human_preference_details.files import OutputError
from lm_human_preference_details.hub import check_available
from lm_human_preference_details.labelers import check_labeler_source
from lm_human_preference_details.modeling import (
    CRITIC_CONFIG_FILE,
    CRITIC_TRUNK_DIR,
    REWARD_CONFIG_FILE,
    REWARD_TRUNK_DIR,
    check_model_dir,
)
from lm_human_preference_details.optim import check_weight_decay
from lm_human_preference_details.prompts import query_dataset_path
from lm_human_preference_details.rewards import (
    check_reward_source,
    is_programmatic,
    reward_input_path,
    reward_model_dir,
)
from lm_human_preference_details.settings import PolicyArgs, RewardArgs, RunSettings
from lm_human_preference_details.sizes import divisors
from lm_human_preference_details.tasks import TaskHParams, check_task, encode_context_affixes
from lm_human_preference_details.tokenizer import added_bos_id

NONFINITE_ORDER = ("logprobs", "values", "scores", "rewards", "advantages", "loss", "gradients", "weights")
"""Order in which a training step computes the tensors whose non-finite entries are counted (the first is the cause)."""


# ---------------------------------------------------------------- numbers


def check_at_least(value: int, minimum: int, flag: str, fix: str = "") -> None:
    """ValueError unless the integer `value` of `flag` is >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}; {fix or f'pass {flag} {minimum}'}.")


def check_positive(value: float, flag: str, fix: str = "") -> None:
    """ValueError unless `value` of `flag` is a finite number > 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a finite number > 0, got {value!r}; {fix or 'pass a positive value'}.")


def check_non_negative(value: float, flag: str, fix: str = "") -> None:
    """ValueError unless `value` of `flag` is a finite number >= 0."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{flag} must be a finite number >= 0, got {value!r}; {fix or 'pass 0 or more'}.")


def check_unit_interval(value: float, flag: str) -> None:
    """ValueError unless 0 <= `value` <= 1."""
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"{flag} must be in [0, 1], got {value!r}; OAI uses 1 (gamma) and 0.95 (lam).")


# ---------------------------------------------------------------- paths


def local_path(name_or_path: str | None) -> str | None:
    """The real path of `name_or_path` when it exists on this machine (a hub id that does not: None)."""
    if not name_or_path:
        return None
    path = os.path.expanduser(name_or_path)
    return os.path.realpath(path) if os.path.exists(path) else None


def labeler_path(spec: str | None) -> str | None:
    """The local model directory of a labeler spec (reward_model:DIR, classifier:DIR[#LABEL],
    sequence_classifier:DIR); None otherwise."""
    if not spec or ":" not in spec:
        return None
    kind, _, target = spec.partition(":")
    if kind == "classifier" and "#" in target:
        target = target.rpartition("#")[0]
    return local_path(target) if kind in ("reward_model", "classifier", "sequence_classifier") else None


def _inside(path: str, directory: str) -> bool:
    """True when `path` is `directory` or lies below it (both real paths)."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def check_output_dir(output_dir: str, inputs: dict[str, str | None], flag: str = "--output_dir") -> None:
    """ValueError when `output_dir` equals, contains or lies inside a local input (flag -> path); OutputError when it
    cannot be written."""
    out = os.path.realpath(os.path.expanduser(output_dir))
    for input_flag, name in inputs.items():
        path = local_path(name)
        if path is None:
            continue
        if _inside(path, out) or _inside(out, path):
            relation = "is" if path == out else "contains" if _inside(path, out) else "lies inside"
            raise ValueError(
                f"{flag} '{output_dir}' {relation} the input {input_flag} '{name}', which the run would overwrite or "
                f"mix with its outputs; choose an {flag} outside every input (e.g. a new directory)."
            )
    check_writable_dir(output_dir, flag)


def check_output_file(output: str, inputs: dict[str, str | None], flag: str = "--output") -> None:
    """ValueError when the output file (or its `.meta.json`) is a local input file or lies inside an input directory;
    OutputError when its directory cannot be written."""
    for path_out in (output, f"{output}.meta.json"):
        out = os.path.realpath(os.path.expanduser(path_out))
        for input_flag, name in inputs.items():
            path = local_path(name)
            if path is not None and _inside(out, path):
                relation = "is" if out == path else "lies inside"
                raise ValueError(
                    f"{flag} '{path_out}' {relation} the input {input_flag} '{name}', which it would overwrite or "
                    f"change; choose an {flag} outside every input."
                )
    check_writable_dir(os.path.dirname(os.path.abspath(os.path.expanduser(output))), flag)


def check_writable_dir(directory: str, flag: str) -> None:
    """OutputError unless `directory` (or, when it does not exist yet, its nearest existing parent) is a directory in
    which a file can be created; creates nothing that stays."""
    path = os.path.abspath(os.path.expanduser(directory))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise OutputError(f"{flag} '{directory}': '{existing}' is a file, not a directory; choose another {flag}.")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OutputError(
            f"{flag} '{directory}' is not writable ('{existing}': {e.strerror or e}); choose a directory you can "
            "write to."
        ) from e


def save_atomically(output_dir: str, write: Callable[[str], Any], flag: str = "--output_dir") -> None:
    """Run `write(tmp)` into a fresh directory beside the outputs, then move its files into `output_dir`
    (`files.atomic_files`): a failure (e.g. disk full) leaves `output_dir` as it was, with no partial file, and
    raises OutputError naming `flag`."""
    try:
        with files.atomic_files(output_dir) as tmp:
            write(tmp)
    except OSError as e:
        full = e.errno == errno.ENOSPC
        raise OutputError(
            f"could not save to {flag} '{output_dir}': {'disk full' if full else e.strerror or e}; the previous "
            f"files there are unchanged. {'Free space' if full else 'Fix the directory'} or choose another {flag}."
        ) from e


# ---------------------------------------------------------------- the scripts' arguments


def is_reward_model(name_or_path: str) -> bool:
    """Whether a model name is a local reward model directory: its reward_model.json, or a config of a sequence
    classifier (reward_model.json lost in a copy)."""
    path = os.path.expanduser(name_or_path)
    config_path = os.path.join(path, "config.json")
    architectures = []
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                architectures = json.load(f).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            architectures = []  # check_model_dir and the loader name an unreadable config
    classifier = any(str(name).endswith("ForSequenceClassification") for name in architectures)
    return os.path.isfile(os.path.join(path, REWARD_CONFIG_FILE)) or classifier


def check_not_reward_model(base_model: str) -> None:
    """ValueError when the policy's --base_model is a local reward model: the policy would start from the reward
    model's trunk."""
    if is_reward_model(base_model):
        raise ValueError(
            f"--base_model '{base_model}' is a reward model, not a language model to start the policy from; pass it "
            "as --rewards.trained_model, and as --base_model the pretrained model it was trained from (e.g. gpt2)."
        )


# ---------------------------------------------------------------- what the checks read of label_generation.py


class GenerateFlags(Protocol):
    """What `check_generate_args` reads of label_generation.py generate's arguments."""

    base_model: str
    labeler: str
    output: str

    @property
    def task(self) -> TaskHParams: ...


class ConvertFlags(Protocol):
    """What `check_convert_args` reads of label_generation.py convert's arguments."""

    input: str
    base_model: str
    source_tokenizer: str
    output: str


def check_policy_args(args: PolicyArgs) -> None:
    """Every train_policy.py flag whose value makes the run fail late or mean nothing, and its output directory."""
    ppo, rewards = args.ppo, args.rewards
    check_task(args.task)
    check_not_reward_model(args.base_model)
    check_model_dir(args.base_model, "--base_model", tokenizer=True)
    check_at_least(ppo.total_episodes, 1, "--ppo.total_episodes", "OAI's books runs use 1000000")
    check_at_least(ppo.batch_size, 1, "--ppo.batch_size", "OAI uses 512 (books) or 32 (tldr, cnndm)")
    check_at_least(ppo.nminibatches, 1, "--ppo.nminibatches", "OAI uses 1")
    check_at_least(ppo.noptepochs, 1, "--ppo.noptepochs", "OAI uses 4")
    check_at_least(ppo.gradient_accumulation_steps, 1, "--ppo.gradient_accumulation_steps")
    if ppo.whiten_group_size is not None:
        fix = "omit it for OAI's 8 ranks (ppo.batch_size / 8), or pass 0 to whiten each process's batch"
        check_at_least(ppo.whiten_group_size, 0, "--ppo.whiten_group_size", fix)
    check_positive(ppo.lr, "--ppo.lr", "OAI uses 1e-5 (books) or 2e-6 (tldr, cnndm)")
    check_weight_decay(args.weight_decay, args.use_tensorflow_adam)
    check_non_negative(ppo.cliprange, "--ppo.cliprange", "OAI uses 0.2")
    check_non_negative(ppo.cliprange_value, "--ppo.cliprange_value", "OAI uses 0.2")
    check_non_negative(ppo.vf_coef, "--ppo.vf_coef", "OAI uses 0.1")
    check_unit_interval(ppo.gamma, "--ppo.gamma")
    check_unit_interval(ppo.lam, "--ppo.lam")
    check_non_negative(
        rewards.kl_coef,
        "--rewards.kl_coef",
        "a negative coefficient rewards moving away from the "
        "reference policy; OAI uses 0.15 (books), 0.03 (tldr), 0.01 (cnndm)",
    )
    if rewards.adaptive_kl.enabled:
        check_positive(rewards.adaptive_kl.target, "--rewards.adaptive_kl.target", "OAI uses 6.0 (nats)")
        check_at_least(rewards.adaptive_kl.horizon, 1, "--rewards.adaptive_kl.horizon", "OAI uses 10000")
    check_reward_source(rewards.trained_model, rewards.normalize_samples)
    check_labeler_source(rewards.gold_model, "--rewards.gold_model")
    check_at_least(args.run.log_interval, 1, "--log_interval", "e.g. 10")
    check_at_least(args.run.divergence_updates, 0, "--divergence_updates", "0 never reports divergence")
    if args.run.divergence_kl is not None:
        check_positive(args.run.divergence_kl, "--divergence_kl", "e.g. 60 (nats), or None for 10 x the KL target")
    check_at_least(args.run.save_interval, 0, "--save_interval", "0 saves only at the end")
    check_at_least(args.run.print_samples, 0, "--print_samples")
    if args.run.rollout_micro_batch_size is not None:
        fix = "omit it to decode the whole batch at once"
        check_at_least(args.run.rollout_micro_batch_size, 1, "--rollout_micro_batch_size", fix)
    inputs = {
        "--base_model": args.base_model,
        "--rewards.trained_model": reward_input_path(rewards.trained_model),
        "--rewards.gold_model": labeler_path(rewards.gold_model),
        "--task.query_dataset": query_dataset_path(args.task.query_dataset),
    }
    check_output_dir(args.run.output_dir, inputs)


def check_reward_args(args: RewardArgs) -> None:
    """Every train_reward.py flag whose value makes the run fail late or mean nothing, and its output directory."""
    check_task(args.task, response_filter=False)
    check_model_dir(args.base_model, "--base_model", tokenizer=True)
    check_at_least(args.batch_size, 1, "--batch_size", "OAI uses 32 (books) or 16 (tldr, cnndm)")
    num_train = args.labels.num_train
    check_at_least(num_train, 1, "--labels.num_train", "OAI trains on 4992 labels (books) or 46000 (tldr, cnndm)")
    if num_train < args.batch_size:
        raise ValueError(
            f"--labels.num_train {num_train} is less than one batch (--batch_size {args.batch_size}); lower "
            f"--batch_size to a divisor of {num_train} ({divisors(num_train)}), or raise --labels.num_train (the label "
            "file needs that many rows)."
        )
    check_at_least(args.gradient_accumulation_steps, 1, "--gradient_accumulation_steps")
    check_positive(args.lr, "--lr", "OAI uses 5e-5 (books) or 2.5e-5 (tldr, cnndm)")
    check_weight_decay(args.weight_decay, args.use_tensorflow_adam)
    check_at_least(args.rollout_batch_size, 1, "--rollout_batch_size", "OAI uses 512 (books) or 128 (tldr, cnndm)")
    check_at_least(args.normalize_samples, 0, "--normalize_samples", "0 skips normalization")
    check_at_least(args.debug_normalize, 0, "--debug_normalize")
    check_at_least(args.eval_interval, 0, "--eval_interval", "0 evaluates only before and after training")
    inputs = {
        "--base_model": args.base_model,
        "--label_dataset": args.label_dataset,
        "--task.query_dataset": query_dataset_path(args.task.query_dataset),
    }
    check_output_dir(args.run.output_dir, inputs)


def dry_run_world(run: RunSettings, world: int) -> int:
    """The process count to derive sizes for: --dry_run_processes (which needs --dry_run), else this launch's."""
    if run.dry_run_processes is None:
        return world
    check_at_least(run.dry_run_processes, 1, "--dry_run_processes", "e.g. 8 for 8 GPUs")
    if not run.dry_run:
        raise ValueError("--dry_run_processes only sizes a dry run; add --dry_run (or drop --dry_run_processes).")
    return run.dry_run_processes


def check_generate_args(args: GenerateFlags) -> None:
    """label_generation.py generate: the task, and an --output that overwrites no input."""
    check_task(args.task)
    check_model_dir(args.base_model, "--base_model", tokenizer=True)
    check_labeler_source(args.labeler, "--labeler")
    inputs = {
        "--base_model": args.base_model,
        "--labeler": labeler_path(args.labeler),
        "--task.query_dataset": query_dataset_path(args.task.query_dataset),
    }
    check_output_file(args.output, inputs)


def check_convert_args(args: ConvertFlags) -> None:
    """label_generation.py convert: an --output that overwrites no input."""
    inputs = {"--input": args.input, "--base_model": args.base_model, "--source_tokenizer": args.source_tokenizer}
    check_output_file(args.output, inputs)


# ---------------------------------------------------------------- context lengths

CONTEXT_FIELDS = ("n_positions", "max_position_embeddings")
"""config.json fields that give a model's context, the most positions it reads (GPT-2; GPT-NeoX, Llama, Qwen2)"""


@dataclass(frozen=True)
class ContextReader:
    """A model that reads the task's tokens: which of them, and where its config is.

    `reads`: "context", the policy's prefix ⊕ query ⊕ suffix ⊕ response but its last token (sampling feeds every
    sampled token but the last, and the training forward reads the same: spec G4, P7); "critic", the same with the
    critic's own BOS in front (nplus N16); "episode", the raw query ⊕ response with the scorer's own BOS in front (a
    reward model of train_reward.py, spec G4, R1).
    """

    who: str
    """the model as a message names it, e.g. "the policy" """
    flag: str
    """the flag that names the model"""
    source: str
    """the flag and its value as a message names them, e.g. "--base_model 'gpt2'" """
    config_dir: str
    """the directory (or hub id) of the config.json that gives its context"""
    reads: str
    bos: bool = False
    """a BOS of the reader's own in front ("critic", "episode")"""


def model_context(name_or_dir: str, flag: str) -> tuple[int, str] | None:
    """The most positions a model reads and the config field that says so (e.g. 1024, "n_positions"), from its
    config.json (a peft adapter directory: its base model's; a hub id: cached or fetched); None when the config is
    unreadable here or sets neither field (the loader names an unreadable one)."""
    path = os.path.expanduser(name_or_dir)
    if lora.is_adapter_dir(path):
        return model_context(lora.adapter_base_model(path, flag), flag)
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    elif os.path.exists(path):
        return None
    else:
        check_available(name_or_dir, flag)
        config = AutoConfig.from_pretrained(name_or_dir).to_dict()
    if not isinstance(config, dict):
        return None
    for key in CONTEXT_FIELDS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, key
    return None


def policy_reader(flag: str, name: str, who: str = "the policy") -> ContextReader:
    """A causal LM that samples or scores the policy's tokens (the policy, its reference, a base model)."""
    return ContextReader(who, flag, f"{flag} '{name}'", name, "context")


def reward_model_reader(flag: str, spec: str | None, who: str) -> ContextReader | None:
    """A reward model of train_reward.py that `spec` names (DIR, reward_model:DIR) on the raw query ⊕ response, its
    BOS from reward_model.json; None for any other scorer (vader, python:, and classifier: and sequence_classifier:,
    which cut text too long for them: labelers.py) or a directory without reward_model.json (its loader names it)."""
    if not spec or is_programmatic(spec) or spec == "human":
        return None
    directory = os.path.expanduser(spec.removeprefix("reward_model:"))
    metadata = _json_file(os.path.join(directory, REWARD_CONFIG_FILE))
    if metadata is None:
        return None
    # a classifier checkpoint has its config at the top, a trunk checkpoint in trunk/ (modeling.RewardModel.save)
    classifier = os.path.isfile(os.path.join(directory, "config.json"))
    trunk = directory if classifier else os.path.join(directory, REWARD_TRUNK_DIR)
    return ContextReader(who, flag, f"{flag} '{spec}'", trunk, "episode", metadata.get("bos_token_id") is not None)


def labeler_reader(flag: str, spec: str | None, who: str) -> ContextReader | None:
    """The labeler or judge that `spec` names when it is a reward model (reward_model:DIR); None otherwise."""
    return reward_model_reader(flag, spec, who) if spec and spec.startswith("reward_model:") else None


def critic_reader(value_model: str | None, trained_model: str) -> ContextReader | None:
    """The separate critic that --ppo.value_model names, on the policy's tokens with its own BOS: a reward model's
    trunk or a saved critic's (OUTPUT_DIR/critic); None without one, or for `policy` (a copy of the policy's trunk,
    whose context the policy's check covers)."""
    if value_model is None or value_model == "policy":
        return None
    directory = reward_model_dir(trained_model) if value_model == "reward" else value_model
    if directory is None:
        return None
    directory = os.path.expanduser(directory)
    source = (
        f"--ppo.value_model '{directory}'" if value_model != "reward" else f"--ppo.value_model reward: '{directory}'"
    )
    critic = _json_file(os.path.join(directory, CRITIC_CONFIG_FILE))
    if critic is not None:
        trunk, bos = os.path.join(directory, CRITIC_TRUNK_DIR), critic.get("bos_token_id") is not None
        return ContextReader("the critic", "--ppo.value_model", source, trunk, "critic", bos)
    reward = reward_model_reader("--ppo.value_model", directory, "the critic")
    return dataclasses.replace(reward, source=source, reads="critic") if reward is not None else None


def _json_file(path: str) -> dict | None:
    """A JSON object file's content; None when it is missing or not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def check_context_lengths(
    readers: Iterable[ContextReader | None], task: TaskHParams, tokenizer: PreTrainedTokenizerBase
) -> None:
    """ValueError in one line for the first of `readers` (None: skipped) whose tokens exceed its context: the
    sum, each term named by its flag, the model and its config field, and the flags to change."""
    # a GPT-2 reads positions 0..n_positions-1 (a learned embedding each: one more is an IndexError); RoPE models
    # (GPT-NeoX, Llama, Qwen2) compute any position but were trained on max_position_embeddings of them
    bos = added_bos_id(tokenizer)
    prefix, suffix = encode_context_affixes(tokenizer, task)
    terms = [(f"--task.query_length {task.query_length}", task.query_length)]
    terms.append((f"--task.response_length {task.response_length}", task.response_length))
    prefix_tokens = len(prefix) - (bos is not None)  # the context's prefix starts with the tokenizer's BOS
    affixes = [("1 BOS of the tokenizer", 1)] if bos is not None else []
    if prefix_tokens:
        affixes.append((f"{prefix_tokens} tokens of --task.query_prefix", prefix_tokens))
    if suffix:
        affixes.append((f"{len(suffix)} tokens of --task.query_suffix", len(suffix)))
    for reader in readers:
        if reader is None or (context := model_context(reader.config_dir, reader.flag)) is None:
            continue
        limit, field = context
        parts = list(terms)
        if reader.reads in ("context", "critic"):
            parts += affixes + [("the last response token, which no forward reads", -1)]
        if reader.bos and reader.reads != "context":
            parts.append((f"1 BOS of {reader.who}", 1))
        total = sum(count for _, count in parts)
        if total <= limit:
            continue
        expression = parts[0][0] + "".join(f" + {text}" if count > 0 else f" - 1 ({text})" for text, count in parts[1:])
        shortened = reader.reads != "episode" and (prefix_tokens or suffix)
        shorten = " (or shorten --task.query_prefix / --task.query_suffix)" if shortened else ""
        excess = f"{total - limit} token{'s' if total - limit > 1 else ''}"
        raise ValueError(
            f"{expression} = {total} tokens exceed the context of {reader.who} ({reader.source}: {field} {limit}); "
            f"lower --task.query_length or --task.response_length{shorten} by {excess} in all, or pass {reader.flag} a "
            "model with a longer context."
        )


def check_policy_context(args: PolicyArgs, tokenizer: PreTrainedTokenizerBase) -> None:
    """train_policy.py: the policy (its reference policy is a copy), a separate critic, the reward model and a gold
    reward model, each against its own context."""
    rewards = args.rewards
    readers = [
        policy_reader("--base_model", args.base_model),
        reward_model_reader("--rewards.trained_model", rewards.trained_model, "the reward model"),
        critic_reader(args.ppo.value_model, rewards.trained_model),
        labeler_reader("--rewards.gold_model", rewards.gold_model, "the gold judge"),
    ]
    check_context_lengths(readers, args.task, tokenizer)


def check_reward_context(args: RewardArgs, tokenizer: PreTrainedTokenizerBase) -> None:
    """train_reward.py: the reward model on each label row's query ⊕ sample (with the BOS its tokenizer adds), and the
    policy that samples for the normalization (when it normalizes)."""
    bos = added_bos_id(tokenizer) is not None
    source = f"--base_model '{args.base_model}'"
    reward = ContextReader("the reward model", "--base_model", source, args.base_model, "episode", bos)
    normalizes = args.normalize_samples > 0 and (args.normalize_before or args.normalize_after)
    who = "the policy that samples for --normalize_samples"
    policy = policy_reader("--base_model", args.base_model, who) if normalizes else None
    check_context_lengths([reward, policy], args.task, tokenizer)


def check_sampling_context(
    task: TaskHParams, tokenizer: PreTrainedTokenizerBase, base_model: str, labeler: str | None = None
) -> None:
    """label_generation.py: the base model that samples, and a reward-model labeler (`labeler`, --labeler)."""
    readers = [
        policy_reader("--base_model", base_model, "the base model"),
        labeler_reader("--labeler", labeler, "the labeler"),
    ]
    check_context_lengths(readers, task, tokenizer)


def check_evaluate_context(
    task: TaskHParams,
    tokenizer: PreTrainedTokenizerBase,
    base_model: str,
    policies: Iterable[tuple[str, str]],
    reward_model: str,
    gold: str | None,
) -> None:
    """evaluate.py: the base model, every policy (flag, directory), the reward model and a reward-model gold judge."""
    readers = [policy_reader("--base_model", base_model, "the base model")]
    readers += [policy_reader(flag, directory) for flag, directory in policies]
    readers.append(reward_model_reader("--reward_model", reward_model, "the reward model"))
    readers.append(labeler_reader("--gold", gold, "the gold judge"))
    check_context_lengths(readers, task, tokenizer)


# ---------------------------------------------------------------- non-finite values


def nonfinite_count(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Number of NaN or infinite entries over `tensors`, as a device tensor (no host sync)."""
    counts = [(~torch.isfinite(t.detach())).sum() for t in tensors]
    return torch.stack(counts).sum() if counts else torch.zeros(())


def nonfinite_tensors(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Number of `tensors` (weights, gradients) holding a NaN or infinite entry, as a device tensor (no host sync).

    One sum per tensor: a NaN or infinity makes it non-finite (so does a float32 overflow, |entries| ~ 1e38 / numel,
    which only a diverged model reaches); 20x cheaper than counting entries, 0.2 s per GPT-2-124M pass on one CPU core.
    """
    # an --fsdp run's weights and gradients are DTensors: each process checks its own shards (the counts are reduced
    # over processes with the other statistics)
    sums = [(t.to_local() if isinstance(t, DTensor) else t).detach().sum() for t in tensors]
    return (~torch.isfinite(torch.stack(sums))).sum() if sums else torch.zeros((), dtype=torch.long)


def check_finite_stats(stats: dict[str, float], where: str, fix: str) -> None:
    """Pop the `nonfinite/<tensor>` counts from reduced statistics; ValueError naming `where` (e.g. "update 3") and
    every tensor with NaN or infinite entries, in the order the step computes them."""
    keys = [key for key in stats if key.startswith("nonfinite/")]
    counts = {key.removeprefix("nonfinite/"): stats.pop(key) for key in keys}
    counts = dict(
        sorted(counts.items(), key=lambda item: NONFINITE_ORDER.index(item[0]) if item[0] in NONFINITE_ORDER else 99)
    )
    unit = {name: "tensors" if name in ("gradients", "weights") else "entries" for name in counts}
    bad = [f"{name} ({count:.12g} {unit[name]})" for name, count in counts.items() if not count <= 0]
    if bad:
        raise ValueError(
            f"non-finite {', '.join(bad)} at {where}; stopped before saving, so the last checkpoint on disk is the "
            f"last good state. {fix}"
        )
