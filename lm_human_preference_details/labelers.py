"""Scoring functions that pick the best of N responses: a reward model, an HF classifier, VADER, or a human.

OAI released only the label schema, no labeling code; these labelers write OAI-style best-of-N labels
(label_generation.py) and can act as a "gold" judge during policy training.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L55
"""

import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TextIO

import torch
from rich.console import Console
from rich.text import Text
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from lm_human_preference_details.hub import HubUnavailableError, check_available
from lm_human_preference_details.modeling import load_reward_model, score_label_rows
from lm_human_preference_details.tasks import TASK_GOALS
from lm_human_preference_details.tokenizer import TOKENIZER_FILES, check_same_tokenizer

LABELER_FORMS = (
    "reward_model:DIR (a reward model written by train_reward.py)",
    "classifier:NAME_OR_DIR[#LABEL] (an HF sequence classifier; LABEL = a name of its config.id2label or an index, "
    "default the last label)",
    "sequence_classifier:NAME_OR_DIR (a one-output HF reward model with its own tokenizer, on prompt + response)",
    "vader (VADER compound sentiment, pip install vaderSentiment)",
    "human (you pick the best response in the terminal)",
)


class LabelingStopped(Exception):
    """The human labeler asked to stop (typed `q` or closed stdin); what was labelled so far is kept."""


class Labeler(ABC):
    """Scores N responses per query; higher is better. Responses arrive truncated (PAD after the truncation point)."""

    name: str
    interactive: bool = False
    """True when every row needs a person's answer (label one row at a time and save after each)"""
    measures: str | None = None
    """what its scores measure, in the words of tasks.TASK_GOALS (VADER: positive sentiment); None: not known"""

    @abstractmethod
    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(B, N) float scores of responses (B, N, L) to right-padded queries (B, Lq)."""

    def best(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(B,) index of the highest-scoring response of each row."""
        return self.scores(queries, responses).argmax(dim=-1)


def _check_shapes(queries: torch.Tensor, responses: torch.Tensor) -> None:
    """ValueError unless queries are (B, Lq) and responses (B, N, L) with the same B."""
    if queries.dim() != 2 or responses.dim() != 3 or queries.shape[0] != responses.shape[0]:
        raise ValueError(
            f"expected queries (B, Lq) and responses (B, N, L), got {tuple(queries.shape)} and "
            f"{tuple(responses.shape)}; add the N axis with responses[:, None] for one response per query."
        )


def judge_task_mismatch(measures: str | None, judge: str, task_id: str, flag: str) -> str | None:
    """One warning line when a judge that measures one thing (VADER: positive sentiment) judges a run or labels of a
    --task about another (descriptiveness): its scores then say nothing about the task. None when they agree or
    either is not known."""
    goal = TASK_GOALS.get(task_id)
    if measures is None or goal is None or measures == goal:
        return None
    return (
        f"{flag} {judge} measures {measures}, but --task {task_id} is about {goal}, so its scores do not judge this "
        f"task; pass a {flag} of {goal}, such as reward_model:DIR of a train_reward.py --task {task_id} run."
    )


def sentiment_measured(id2label: dict, label_index: int) -> str | None:
    """What a classifier's label measures when its labels are sentiments (POSITIVE, NEGATIVE and perhaps NEUTRAL, as
    the SST-2 and IMDB classifiers name them): "positive sentiment" for POSITIVE; None for other classifiers."""
    names = {int(i): str(n).lower() for i, n in id2label.items()}
    if not {"positive", "negative"} <= set(names.values()) <= {"positive", "negative", "neutral"}:
        return None
    return f"{names[label_index]} sentiment"


def decode_without_pad(tokenizer: PreTrainedTokenizerBase, tokens: torch.Tensor, pad_id: int) -> list[str]:
    """Text of every row of a (..., L) token tensor, PAD tokens dropped (special tokens such as EOS kept)."""
    rows = tokens.reshape(-1, tokens.shape[-1]).tolist()
    return tokenizer.batch_decode([[t for t in row if t != pad_id] for row in rows], skip_special_tokens=False)


# ---------------------------------------------------------------- reward model


class RewardModelLabeler(Labeler):
    """Rewards of a reward model of this project on raw query ⊕ truncated response (what OAI's reward model sees)."""

    def __init__(self, directory: str, tokenizer: PreTrainedTokenizerBase, pad_id: int, device, flag: str):
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"reward model directory '{directory}' does not exist; pass {flag} reward_model:DIR with a directory "
                "written by train_reward.py (its --output_dir)."
            )
        model, metadata = load_reward_model(directory, flag=f"{flag} reward_model:DIR")
        check_same_tokenizer(
            metadata,
            tokenizer,
            f"{flag} reward_model:{directory}",
            f"the labelled tokens come from tokenizer '{tokenizer.name_or_path}'",
        )
        self.name = f"reward_model:{directory}"
        self.measures = TASK_GOALS.get(metadata.get("task_name"))
        self.model = model.to(device).eval().requires_grad_(False)
        self.pad_id = pad_id
        self.device = device

    @torch.no_grad()
    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Rewards (B, N) in one forward of B*N rows; the reward model never sees the policy's prefix/suffix."""
        _check_shapes(queries, responses)
        # reward read at the last real token of the raw query ⊕ truncated response
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L177-L179
        rewards = score_label_rows(self.model, queries.to(self.device), responses.to(self.device), self.pad_id)
        return rewards.float().to(responses.device)


# ---------------------------------------------------------------- HF sequence classifier


class ClassifierLabeler(Labeler):
    """Log-probability of one label of an HF sequence classifier (or the logit of a 1-output regressor) on the text.

    A response longer than the classifier takes (the smaller of its tokenizer's model_max_length and its position
    embeddings) is cut to its first max_length tokens of the classifier's tokenizer, special tokens kept (the
    tokenizer's own truncation); the run says so once, on stderr.
    """

    def __init__(
        self,
        name_or_dir: str,
        label: str | None,
        tokenizer: PreTrainedTokenizerBase,
        pad_id: int,
        device,
        flag: str,
        batch_size: int = 64,
    ):
        suffix = f"#{label}" if label is not None else ""
        try:
            check_available(name_or_dir, flag, kind="classifier")
        except HubUnavailableError as e:
            raise HubUnavailableError(
                f"could not fetch classifier '{name_or_dir}' for {flag}: the Hugging Face hub is unreachable (offline) "
                f"and it is not in the local cache. Download it on a machine with internet (`hf download {name_or_dir} "
                f"--local-dir DIR`), copy DIR here and pass {flag} classifier:DIR{suffix}."
            ) from e
        fix = (
            f"pass {flag} classifier:NAME_OR_DIR with a model fine-tuned for sequence classification (e.g. "
            "distilbert/distilbert-base-uncased-finetuned-sst-2-english#POSITIVE), or use reward_model:DIR / vader."
        )
        config = AutoConfig.from_pretrained(name_or_dir)
        architectures = config.architectures or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(
                f"classifier '{name_or_dir}' cannot score text: it is a {architectures[0]}, not a sequence "
                f"classifier; {fix}"
            )
        self.label_index = _label_index(config.id2label, label, name_or_dir, flag)
        model, info = AutoModelForSequenceClassification.from_pretrained(name_or_dir, output_loading_info=True)
        if info["missing_keys"]:
            raise ValueError(
                f"classifier '{name_or_dir}' cannot score text: its classification weights "
                f"{sorted(info['missing_keys'])[:4]} are missing (an untrained head); {fix}"
            )
        self.classifier_tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
        if self.classifier_tokenizer.pad_token is None:
            # HF convention for GPT-style classifiers without a PAD: pad with EOS; they read the last non-PAD token
            self.classifier_tokenizer.pad_token = self.classifier_tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.classifier_tokenizer.pad_token_id
        positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        self.max_length = min(self.classifier_tokenizer.model_max_length, positions or 512)
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer, self.pad_id, self.device, self.batch_size = tokenizer, pad_id, device, batch_size
        label_name = model.config.id2label.get(self.label_index, str(self.label_index))
        self.name = f"classifier:{name_or_dir}#{label_name}"
        self.measures = sentiment_measured(model.config.id2label, self.label_index)
        self.warned_cut = False

    def warn_if_cut(self, texts: list[str]) -> None:
        """Say once per run that a text longer than the classifier takes is cut (its end is not scored)."""
        if self.warned_cut:
            return
        lengths = [len(ids) for ids in self.classifier_tokenizer(texts, verbose=False)["input_ids"]]
        if any(length > self.max_length for length in lengths):
            self.warned_cut = True
            print(
                f"warning: {self.name}: a response longer than the classifier's {self.max_length} tokens is cut to "
                "its first ones, and the rest is not scored (said once per run)",
                file=sys.stderr,
            )

    @torch.no_grad()
    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """log p(label | response text) (B, N), in batches of the classifier's own tokens."""
        _check_shapes(queries, responses)
        texts = decode_without_pad(self.tokenizer, responses, self.pad_id)
        self.warn_if_cut(texts)
        out = []
        for start in range(0, len(texts), self.batch_size):
            inputs = self.classifier_tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**inputs).logits.float()  # (b, num_labels)
            if logits.shape[-1] == 1:
                out.append(logits[:, 0])
            else:
                out.append(torch.log_softmax(logits, dim=-1)[:, self.label_index])
        return torch.cat(out).view(responses.shape[:2]).to(responses.device)


def _label_index(id2label: dict, label: str | None, name_or_dir: str, flag: str) -> int:
    """Index of `label` (a name of id2label, case-insensitive, or an index); the last label when None."""
    names = {int(i): str(n) for i, n in id2label.items()}
    if label is None:
        return max(names)
    by_name = {n.lower(): i for i, n in names.items()}
    if label.lower() in by_name:
        return by_name[label.lower()]
    if label.lstrip("-").isdigit() and int(label) in names:
        return int(label)
    raise ValueError(
        f"classifier '{name_or_dir}' has no label '{label}'; its labels are "
        f"{', '.join(f'{i}={n}' for i, n in sorted(names.items()))}. Pass {flag} classifier:{name_or_dir}#LABEL with "
        "one of these names or indices."
    )


# ---------------------------------------------------------------- a reward model with its own tokenizer

SEQUENCE_CLASSIFIER = "sequence_classifier:"
SEQUENCE_CLASSIFIER_BATCH = 32
"""rows per forward of a sequence_classifier: reward model"""
Conversation = list[dict[str, str]]
ConversationOf = Callable[[list[int]], Conversation | None]
"""a query's token ids (no PAD) -> the chat messages it was rendered from, or None for a plain-text query"""


def sequence_classifier_target(spec: str, flag: str) -> str:
    """NAME_OR_DIR of `sequence_classifier:NAME_OR_DIR`; ValueError in one line for an empty name or a #LABEL."""
    target = spec.removeprefix(SEQUENCE_CLASSIFIER)
    if not target:
        raise ValueError(f"{flag} '{spec}' names no model; pass {flag} sequence_classifier:NAME_OR_DIR.")
    if "#" in target:
        raise ValueError(
            f"{flag} '{spec}': sequence_classifier: reads the one output of a reward model and takes no #LABEL; pass "
            f"{flag} classifier:{target} to score one label of a multi-label classifier."
        )
    return target


def _check_classifier_files(target: str, spec: str, flag: str) -> None:
    """FileNotFoundError, ValueError or HubUnavailableError (one line naming `flag`) unless `target` is a model
    directory with a config and a tokenizer, or a hub id that is cached or fetchable now."""
    if os.path.isdir(target):
        if os.path.isfile(os.path.join(target, "config.json")):
            if not any(os.path.isfile(os.path.join(target, name)) for name in TOKENIZER_FILES):
                raise ValueError(
                    f"{flag} '{spec}': '{target}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); save "
                    "the reward model's tokenizer there (tokenizer.save_pretrained(DIR))."
                )
            return
        if os.path.isfile(os.path.join(target, "reward_model.json")):
            raise ValueError(
                f"{flag} '{spec}': '{target}' is a reward model of train_reward.py saved as trunk/ and head (no "
                f"standard classifier holds its reward); pass {flag} reward_model:{target}."
            )
        raise ValueError(
            f"{flag} '{spec}': '{target}' has no config.json, so it is no transformers model; pass {flag} "
            "sequence_classifier:DIR with a directory written by save_pretrained (model and tokenizer)."
        )
    if os.path.exists(target):
        raise ValueError(f"{flag} '{spec}': '{target}' is a file, not a model directory or hub id.")
    if target.startswith((".", "/", "~")) or target.count("/") > 1:
        raise FileNotFoundError(
            f"{flag} '{spec}': directory '{target}' does not exist (a relative path is read from the working "
            f"directory, {os.getcwd()}); pass {flag} sequence_classifier:DIR with an existing directory or a hub id."
        )
    try:
        check_available(target, flag, kind="sequence classifier")
    except HubUnavailableError as e:
        raise HubUnavailableError(
            f"{flag} '{spec}': '{target}' is no directory here, and as a hub id it cannot be fetched: the Hugging Face "
            f"hub is unreachable (offline) and it is not in the local cache. Download it on a machine with internet "
            f"(`hf download {target} --local-dir DIR`), copy DIR here and pass {flag} sequence_classifier:DIR."
        ) from e


def check_sequence_classifier(spec: str, flag: str) -> PretrainedConfig:
    """The config of the one-output sequence classifier that `sequence_classifier:NAME_OR_DIR` names (no weights
    read); one line naming `flag` for a missing directory, an unreachable hub id, another kind of model or more than
    one output."""
    target = sequence_classifier_target(spec, flag)
    _check_classifier_files(target, spec, flag)
    config = AutoConfig.from_pretrained(target)
    architectures = config.architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"{flag} '{spec}' is a {architectures[0]}, not a sequence classifier; pass {flag} "
            "sequence_classifier:NAME_OR_DIR with a reward model that AutoModelForSequenceClassification loads with "
            "one output (e.g. one trained with TRL's RewardTrainer)."
        )
    if config.num_labels != 1:
        labels = ", ".join(str(name) for _, name in sorted(config.id2label.items()))
        raise ValueError(
            f"{flag} '{spec}' has {config.num_labels} outputs ({labels}), not one reward; pass {flag} "
            f"classifier:{target}#LABEL to score one label of a multi-label classifier."
        )
    return config


def check_labeler_source(spec: str | None, flag: str) -> None:
    """The start-up check of a labeler spec that names a sequence classifier (other forms are checked on loading)."""
    if spec and spec.startswith(SEQUENCE_CLASSIFIER):
        check_sequence_classifier(spec, flag)


def _padding_id(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, spec: str, flag: str) -> int:
    """The id that rows are padded with, the one the classifier's forward skips when it picks the token to read its
    score at (config.pad_token_id); the tokenizer pads with it. A config without one takes the tokenizer's PAD, or its
    EOS (transformers' convention for a tokenizer without PAD)."""
    pad_id = config.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError(
            f"{flag} '{spec}': its tokenizer has neither a PAD nor an EOS token and its config no pad_token_id, so "
            "rows of different lengths cannot be batched; set tokenizer.pad_token and config.pad_token_id, and save "
            "the model again."
        )
    token = tokenizer.convert_ids_to_tokens(pad_id)
    if token is None:
        raise ValueError(
            f"{flag} '{spec}': its config's pad_token_id {pad_id} is not a token of its tokenizer ({len(tokenizer)} "
            "tokens); set config.pad_token_id to its tokenizer's PAD id and save the model again."
        )
    config.pad_token_id = pad_id
    tokenizer.pad_token = token
    return pad_id


def _max_length(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most tokens the classifier takes: its tokenizer's model_max_length and its position embeddings."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    limits = [n for n in (tokenizer.model_max_length, positions) if n and n < 1e9]  # 1e30: the tokenizer sets none
    return min(limits) if limits else None


class SequenceClassifierLabeler(Labeler):
    """A reward model with its own tokenizer: the one output of an HF sequence classifier on prompt + response text.

    The policy's raw query and truncated response are decoded with the policy's tokenizer (PAD, the response's first
    EOS and everything after it dropped, special tokens skipped) and encoded again with the classifier's tokenizer:
    through its chat template when it has one ([user: prompt, assistant: response], no generation prompt), else the
    text prompt + response with the special tokens its tokenizer adds. `conversation_of` (optional) gives the chat
    messages of a query, used instead of its decoded text under a chat template. A row longer than the classifier
    takes loses tokens from the left of its prompt. Rows are right-padded with the id the classifier's forward skips
    when it reads the score (its last token that is not that id), so every row scores as it would alone.
    """

    def __init__(
        self,
        name_or_dir: str,
        tokenizer: PreTrainedTokenizerBase,
        pad_id: int,
        device,
        flag: str,
        conversation_of: ConversationOf | None = None,
        batch_size: int = SEQUENCE_CLASSIFIER_BATCH,
    ):
        self.name = f"{SEQUENCE_CLASSIFIER}{name_or_dir}"
        check_sequence_classifier(self.name, flag)
        model, info = AutoModelForSequenceClassification.from_pretrained(name_or_dir, output_loading_info=True)
        if info["missing_keys"]:
            raise ValueError(
                f"{flag} '{self.name}' cannot score text: its weights {sorted(info['missing_keys'])[:4]} are missing "
                "(an untrained score head); pass a trained reward model."
            )
        self.classifier_tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
        config = model.config.get_text_config()
        self.padding_id = _padding_id(config, self.classifier_tokenizer, self.name, flag)
        self.max_length = _max_length(config, self.classifier_tokenizer)
        self.chat = self.classifier_tokenizer.chat_template is not None
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer, self.pad_id, self.eos_id = tokenizer, pad_id, tokenizer.eos_token_id
        self.device, self.batch_size, self.conversation_of = device, batch_size, conversation_of
        self.warned_cut = False

    def response_texts(self, responses: torch.Tensor) -> list[str]:
        """Text of every response row: PAD, the first EOS and everything after it dropped, special tokens skipped."""
        rows = responses.reshape(-1, responses.shape[-1])
        keep = rows != self.pad_id
        if self.eos_id is not None:  # the reward model scores the response up to its first EOS (nplus N19)
            keep = keep & ((rows == self.eos_id).cumsum(-1) == 0)
        kept = [[t for t, k in zip(row, mask) if k] for row, mask in zip(rows.tolist(), keep.tolist())]
        return self.tokenizer.batch_decode(kept, skip_special_tokens=True)

    def prompts(self, queries: torch.Tensor) -> list[str | Conversation]:
        """Each query as the classifier's prompt: its chat messages (`conversation_of`, under a chat template) or its
        text (PAD dropped, special tokens skipped)."""
        ids = [[t for t in row if t != self.pad_id] for row in queries.tolist()]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if not (self.chat and self.conversation_of):
            return texts
        return [conversation or text for conversation, text in zip(map(self.conversation_of, ids), texts)]

    def encode(self, prompts: list[str | Conversation], responses: list[str]) -> list[list[int]]:
        """Token ids of each prompt + response in the classifier's tokenizer (its chat template when it has one)."""
        tok = self.classifier_tokenizer
        if self.chat:
            chats = [_messages(prompt) + [{"role": "assistant", "content": r}] for prompt, r in zip(prompts, responses)]
            texts = tok.apply_chat_template(chats, tokenize=False, add_generation_prompt=False)
            return tok(texts, add_special_tokens=False)["input_ids"]
        return tok([prompt + response for prompt, response in zip(prompts, responses)])["input_ids"]

    def fit(self, rows: list[list[int]], prompts: list[str | Conversation], responses: list[str]) -> list[list[int]]:
        """`rows` with each one longer than the classifier's max length cut from the left of its prompt (whole
        tokens of the classifier's tokenizer; the response alone too long keeps its last max-length tokens)."""
        too_long = [i for i, row in enumerate(rows) if self.max_length and len(row) > self.max_length]
        for i in too_long:
            rows[i] = self._cut_prompt(rows[i], prompts[i], responses[i])
        if too_long and not self.warned_cut:
            self.warned_cut = True
            print(
                f"warning: {self.name}: prompt + response longer than the reward model's {self.max_length} tokens; "
                "the prompt is cut from its left (said once per run)",
                file=sys.stderr,
            )
        return rows

    def _cut_prompt(self, row: list[int], prompt: str | Conversation, response: str) -> list[int]:
        """One row cut to max_length: tokens of the prompt's text (a conversation's last message) dropped from the
        left until it fits."""
        tok, limit = self.classifier_tokenizer, self.max_length
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        pieces = tok(text, add_special_tokens=False)["input_ids"]
        while len(row) > limit and pieces:
            pieces = pieces[len(row) - limit :]
            shorter = tok.decode(pieces)
            cut = shorter if isinstance(prompt, str) else [*prompt[:-1], {**prompt[-1], "content": shorter}]
            row = self.encode([cut], [response])[0]
        return row[len(row) - limit :] if len(row) > limit else row

    @torch.no_grad()
    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """The classifier's output (B, N), float32: logits[:, 0] of right-padded batches of its own tokens."""
        _check_shapes(queries, responses)
        n = responses.shape[1]
        prompts = [prompt for prompt in self.prompts(queries) for _ in range(n)]
        texts = self.response_texts(responses)
        rows = self.fit(self.encode(prompts, texts), prompts, texts)
        out = []
        for start in range(0, len(rows), self.batch_size):
            batch = self.classifier_tokenizer.pad(
                {"input_ids": rows[start : start + self.batch_size]},
                padding=True,
                padding_side="right",
                return_attention_mask=True,
                return_tensors="pt",
            ).to(self.device)
            # TRL loads its reward model as a sequence classifier and reads its score head (nplus N28); the classifier
            # reads it at each row's last token that is not config.pad_token_id
            # https://github.com/huggingface/trl/blob/14ef1aba152fddbc5a58f3a8a712b6e509e7e69d/trl/trainer/utils.py#L1069-L1116
            out.append(self.model(**batch).logits[:, 0].float())
        return torch.cat(out).view(responses.shape[:2]).to(responses.device)


def _messages(prompt: str | Conversation) -> Conversation:
    """A prompt as chat messages: a conversation as it is, a text as one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


# ---------------------------------------------------------------- VADER


class VaderLabeler(Labeler):
    """VADER's compound sentiment in [-1, 1] of the decoded truncated response (rule-based, offline)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, pad_id: int):
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as e:
            raise ImportError("the vader labeler needs the vaderSentiment package: pip install vaderSentiment") from e
        self.analyzer = SentimentIntensityAnalyzer()
        self.tokenizer, self.pad_id = tokenizer, pad_id
        self.name = "vader"
        self.measures = TASK_GOALS["sentiment"]

    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Compound sentiment (B, N) of each response text."""
        _check_shapes(queries, responses)
        texts = decode_without_pad(self.tokenizer, responses, self.pad_id)
        compound = [self.analyzer.polarity_scores(text)["compound"] for text in texts]
        return torch.tensor(compound, dtype=torch.float32, device=responses.device).view(responses.shape[:2])


# ---------------------------------------------------------------- human


class HumanLabeler(Labeler):
    """A person picks the best response of each row in the terminal (works with piped stdin too)."""

    interactive = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        pad_id: int,
        console: Console | None = None,
        stdin: TextIO | None = None,
    ):
        self.tokenizer, self.pad_id = tokenizer, pad_id
        self.console = console or Console(highlight=False)
        self.stdin = stdin
        self.name = "human"

    def _ask(self, num_responses: int) -> int:
        """Read an index in [0, num_responses) from stdin, asking again on invalid input; `q` or EOF stops."""
        stdin = self.stdin or sys.stdin
        while True:
            self.console.print(f"best response [0-{num_responses - 1}] (q to quit): ", end="")
            line = stdin.readline()
            if not line or line.strip().lower() in ("q", "quit"):
                self.console.print()
                raise LabelingStopped()
            answer = line.strip()
            if answer.isdigit() and int(answer) < num_responses:
                return int(answer)
            self.console.print(f"invalid answer {answer!r}: type a number from 0 to {num_responses - 1}, or q.")

    def best(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Show each query with its N responses and read the chosen index; raises LabelingStopped on `q` or Ctrl-C."""
        _check_shapes(queries, responses)
        query_texts = decode_without_pad(self.tokenizer, queries, self.pad_id)
        response_texts = decode_without_pad(self.tokenizer, responses, self.pad_id)
        n = responses.shape[1]
        choices = []
        for row, query in enumerate(query_texts):
            try:
                self.console.rule()
                self.console.print(Text.assemble(("query: ", "bold"), query))
                for i, response in enumerate(response_texts[row * n : (row + 1) * n]):
                    self.console.print(Text.assemble((f"[{i}] ", "bold cyan"), response))
                choices.append(self._ask(n))
            except KeyboardInterrupt:  # Ctrl-C stops as `q` does: the rows labelled so far are kept
                self.console.print()
                raise LabelingStopped() from None
        return torch.tensor(choices, dtype=torch.long, device=responses.device)

    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """One-hot (B, N) of the person's choices."""
        best = self.best(queries, responses)
        return torch.nn.functional.one_hot(best, responses.shape[1]).float()


# ---------------------------------------------------------------- parsing


def load_labeler(
    spec: str,
    tokenizer: PreTrainedTokenizerBase,
    pad_id: int,
    device,
    flag: str = "--labeler",
    conversation_of: ConversationOf | None = None,
) -> Labeler:
    """The labeler described by `spec` (LABELER_FORMS); `conversation_of`: see SequenceClassifierLabeler."""
    kind, _, target = spec.partition(":")
    if kind == "reward_model" and target:
        return RewardModelLabeler(target, tokenizer, pad_id, device, flag)
    if spec.startswith(SEQUENCE_CLASSIFIER):
        target = sequence_classifier_target(spec, flag)
        return SequenceClassifierLabeler(target, tokenizer, pad_id, device, flag, conversation_of)
    if kind == "classifier" and target:
        name, _, label = target.rpartition("#") if "#" in target else (target, "", "")
        return ClassifierLabeler(name, label or None, tokenizer, pad_id, device, flag)
    if spec == "vader":
        return VaderLabeler(tokenizer, pad_id)
    if spec == "human":
        return HumanLabeler(tokenizer, pad_id)
    forms = "\n  ".join(LABELER_FORMS)
    raise ValueError(f"unknown {flag} '{spec}'; valid forms are:\n  {forms}")
