"""Scoring functions that pick the best of N responses: a reward model, an HF classifier, VADER, or a human.

OAI released only the label schema, no labeling code; these labelers write OAI-style best-of-N labels
(label_generation.py) and can act as a "gold" judge during policy training.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L55
"""

import os
import sys
from abc import ABC, abstractmethod
from typing import TextIO

import torch
from rich.console import Console
from rich.text import Text
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from lm_human_preference_details.hub import HubUnavailableError, check_available
from lm_human_preference_details.modeling import load_reward_model, score_label_rows
from lm_human_preference_details.tokenizer import check_same_tokenizer

LABELER_FORMS = (
    "reward_model:DIR (a reward model written by train_reward.py)",
    "classifier:NAME_OR_DIR[#LABEL] (an HF sequence classifier; LABEL = a name of its config.id2label or an index, "
    "default the last label)",
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
    """Log-probability of one label of an HF sequence classifier (or the logit of a 1-output regressor) on the text."""

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

    @torch.no_grad()
    def scores(self, queries: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """log p(label | response text) (B, N), in batches of the classifier's own tokens."""
        _check_shapes(queries, responses)
        texts = decode_without_pad(self.tokenizer, responses, self.pad_id)
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
    spec: str, tokenizer: PreTrainedTokenizerBase, pad_id: int, device, flag: str = "--labeler"
) -> Labeler:
    """The labeler described by `spec`: reward_model:DIR, classifier:NAME_OR_DIR[#LABEL], vader or human."""
    kind, _, target = spec.partition(":")
    if kind == "reward_model" and target:
        return RewardModelLabeler(target, tokenizer, pad_id, device, flag)
    if kind == "classifier" and target:
        name, _, label = target.rpartition("#") if "#" in target else (target, "", "")
        return ClassifierLabeler(name, label or None, tokenizer, pad_id, device, flag)
    if spec == "vader":
        return VaderLabeler(tokenizer, pad_id)
    if spec == "human":
        return HumanLabeler(tokenizer, pad_id)
    forms = "\n  ".join(LABELER_FORMS)
    raise ValueError(f"unknown {flag} '{spec}'; valid forms are:\n  {forms}")
