"""GPT-2 policy (+ value head), KV-cached sampler and reward model with OAI's "pads are invisible" semantics.

https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py
"""

import copy
import inspect
import json
import math
import os
import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StaticCache,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from lm_human_preference_details import decoding_graph, lora
from lm_human_preference_details.files import check_complete_save
from lm_human_preference_details.hub import check_available
from lm_human_preference_details.kernels import (
    categorical_uniforms,
    logprobs_from_logits,
    sample_categorical,
    use_fused_gelu,
)
from lm_human_preference_details.tokenizer import (
    TOKENIZER_FILES,
    check_same_tokenizer,
    generation_tokenizer,
    load_tokenizer,
)

VALUE_HEAD_FILE = "value_head.safetensors"
REWARD_HEAD_FILE = "reward_head.safetensors"
REWARD_CONFIG_FILE = "reward_model.json"
REWARD_TRUNK_DIR = "trunk"
REWARD_MODEL_FLAG = "--rewards.trained_model"
CRITIC_DIR = "critic"
"""OUTPUT_DIR/critic of train_policy.py: a separate critic (--ppo.value_model), saved beside the policy"""
CRITIC_CONFIG_FILE = "critic.json"
CRITIC_TRUNK_DIR = "trunk"
"""a saved critic's files (nplus/critic.py): its metadata, and its trunk's save_pretrained directory"""
# trunks whose reward model is saved as a standard `*ForSequenceClassification` checkpoint (a bias-free `score`
# layer): model type -> the final LayerNorm, whose bias absorbs the reward's constant term. Llama and Qwen2 end in an
# RMSNorm without bias, so no weight of their classifiers can hold the constant: they keep the trunk format.
CLASSIFIER_EXPORT = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm"}
SUPPORTED_MODEL_TYPES = ("gpt2", "gpt_neox", "llama", "qwen2")
"""config.model_type of the architectures whose pad semantics (spec G2) and tokenizers are tested
(docs/architectures.md); other models are refused when loaded"""


# ---------------------------------------------------------------- loading


def _looks_like_path(name_or_dir: str) -> bool:
    """True for names that can only be a filesystem path (not a hub id such as `gpt2` or `owner/name`)."""
    return name_or_dir.startswith((".", "/", "~")) or name_or_dir.endswith("/") or name_or_dir.count("/") > 1


def _config_without_dropout(name_or_dir: str):
    """The model config with every `*dropout` / `*pdrop` probability set to 0."""
    config = AutoConfig.from_pretrained(name_or_dir)
    # no dropout anywhere, reward training included: OAI only calls the transformer with do_dropout=False
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L40-L59
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/policy.py#L48
    for key, value in config.to_dict().items():
        is_prob = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
        if key.endswith(("dropout", "pdrop")) and is_prob:
            setattr(config, key, 0.0)
    return config


def check_supported_architecture(model_type: str, name_or_dir: str, flag: str, kind: str = "model") -> None:
    """ValueError unless the model's architecture (config.model_type) is one of SUPPORTED_MODEL_TYPES."""
    # pads are invisible (spec G2) only where the attention takes the project's mask and position ids: tested for
    # these architectures alone (tests/test_modeling.py, tests/test_architectures.py)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{kind} '{name_or_dir}' ({flag}) is a '{model_type}' model, an untested architecture; the "
            f"supported model types are {', '.join(SUPPORTED_MODEL_TYPES)} (docs/architectures.md): pass {flag} a "
            "model of one of them."
        )


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""A save_pretrained directory holds one of these."""


def _check_safetensors_complete(path: str) -> None:
    """ValueError when a .safetensors file is shorter or longer than its header says (truncated, e.g. a killed copy)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(header_size) if 0 < header_size <= size - 8 else b""
    try:
        entries = json.loads(header)
        end = max((v["data_offsets"][1] for k, v in entries.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError):
        end = None
    if end is None or size != 8 + header_size + end:
        raise ValueError(
            f"'{path}' is truncated or not a safetensors file ({size} bytes on disk); copy or save the model again."
        )


def check_model_dir(name_or_dir: str, flag: str, kind: str = "model", tokenizer: bool = False) -> None:
    """ValueError when a local `name_or_dir` is not a save_pretrained directory: a file, no config.json, no or
    truncated weights, (`tokenizer`) no tokenizer files, or an unsupported architecture. Hub ids (no such local path)
    pass."""
    path = os.path.expanduser(name_or_dir)
    if not os.path.exists(path):
        return
    fix = f"pass {flag} DIR with a directory written by save_pretrained (model and tokenizer), or a hub id"
    if not os.path.isdir(path):
        raise ValueError(f"{kind} '{name_or_dir}' is a file, not a model directory; {fix}.")
    adapters = os.path.isfile(os.path.join(path, "adapter_config.json"))  # peft adapters of a base model (LoRA)
    if not adapters and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{kind} directory '{name_or_dir}' has no config.json, so it is not a model; {fix}.")
    weight_files = ("adapter_model.safetensors",) if adapters else WEIGHT_FILES
    if not any(os.path.isfile(os.path.join(path, name)) for name in weight_files):
        raise ValueError(f"{kind} directory '{name_or_dir}' has no weights ({weight_files[0]}); {fix}.")
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            _check_safetensors_complete(os.path.join(path, name))
    if tokenizer and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(
            f"{kind} directory '{name_or_dir}' has no tokenizer files (tokenizer.json or tokenizer_config.json); "
            f"save the tokenizer there too (tokenizer.save_pretrained(DIR)) or {fix}."
        )
    if (model_type := _config_model_type(path)) is not None:
        check_supported_architecture(model_type, name_or_dir, flag, kind)


def _config_model_type(directory: str) -> str | None:
    """The model_type of a directory's config.json; None without one (LoRA adapters: their base model is checked when
    it loads) or when it is not a JSON object naming one (transformers then names the problem)."""
    try:
        with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def model_vocab_size(name_or_dir: str) -> int:
    """Rows of the model's input embedding (config.vocab_size): token ids it can embed."""
    return AutoConfig.from_pretrained(os.path.expanduser(name_or_dir)).vocab_size


def _load_pretrained(auto_cls, name_or_dir: str, flag: str, kind: str, strict: bool = False) -> PreTrainedModel:
    """`auto_cls.from_pretrained` in float32 with dropout off and in eval mode; clear errors when missing.

    `strict`: ValueError when the checkpoint lacks weights of the model (transformers would initialise them randomly).
    """
    if _looks_like_path(name_or_dir) and not os.path.isdir(os.path.expanduser(name_or_dir)):
        raise FileNotFoundError(
            f"{kind} directory '{name_or_dir}' does not exist; pass {flag} DIR with a directory written by "
            f"save_pretrained, or a Hugging Face hub id such as gpt2."
        )
    name_or_dir = os.path.expanduser(name_or_dir)
    check_complete_save(name_or_dir, flag)
    check_model_dir(name_or_dir, flag, kind)
    check_available(name_or_dir, flag, kind=kind)
    config = _config_without_dropout(name_or_dir)
    check_supported_architecture(config.model_type, name_or_dir, flag, kind)
    use_fused_gelu(config)  # same formula as GPT-2's gelu_new, one fused kernel
    model, info = auto_cls.from_pretrained(name_or_dir, config=config, dtype=torch.float32, output_loading_info=True)
    if strict and info["missing_keys"]:
        raise ValueError(
            f"{kind} '{name_or_dir}' lacks the weights {sorted(info['missing_keys'])[:4]}; pass {flag} DIR with a "
            f"directory written by this project's save functions."
        )
    check_finite_weights(model, f"{kind} '{name_or_dir}' ({flag})")
    return model.eval()


def check_finite_weights(
    model: nn.Module, what: str, fix: str = "it diverged or was saved broken: pass a checkpoint saved before that."
) -> None:
    """ValueError naming the first parameters of `model` that hold NaN or infinite values (one host sync)."""
    named = list(model.named_parameters())
    counts = torch.stack([(~torch.isfinite(p.detach())).sum() for _, p in named]).tolist() if named else []
    bad = [name for (name, _), count in zip(named, counts) if count]
    if bad:
        raise ValueError(f"{what} has non-finite (NaN or infinite) weights in {bad[:3]}; {fix}")


def load_causal_lm(name_or_dir: str, flag: str = "--base_model") -> PreTrainedModel:
    """A causal LM (e.g. GPT-2 with its tied LM head) from a local dir or hub id, float32, dropout off, eval mode; a
    directory of peft adapters (a LoRA run's OUTPUT_DIR/adapter) gives its base model with the adapters merged."""
    if lora.is_adapter_dir(name_or_dir):
        directory = os.path.expanduser(name_or_dir)
        return lora.merge_adapters(load_causal_lm(lora.adapter_base_model(directory, flag), flag), directory)
    return _load_pretrained(AutoModelForCausalLM, name_or_dir, flag, kind="model")


# ---------------------------------------------------------------- padding semantics (spec G2)


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of the real-token mask: a token's position is the number of real tokens before it."""
    # OAI position ids: pads get the position of the next real token
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L265-L269
    mask = mask.long()
    return torch.cumsum(mask, dim=1) - mask


def _last_real_index(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the most recent real position at or before each position (cumulative max of real indices)."""
    arange = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, arange, 0).cummax(dim=1).values


def _gather_positions(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden[b, index[b, t]] for every (b, t): (B, T, D), (B, T') -> (B, T', D)."""
    return hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def _check_first_token_real(mask: torch.Tensor, pad_id: int) -> None:
    """ValueError unless every row starts with a real token (OAI asserts this before copying hidden states)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L333-L340
    if not bool(mask[:, 0].all()):
        rows = torch.nonzero(~mask[:, 0]).flatten().tolist()
        raise ValueError(
            f"rows {rows[:8]} start with the PAD token {pad_id}; the first token of every sequence must be real. "
            f"Pad on the right (queries are right-padded, spec G3), never on the left."
        )


def _attention_mask(model: PreTrainedModel, key_mask: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """(B, 1, Q, K) attention mask in the form transformers builds for `model`: query i (at key slot
    `query_slots[i]`) attends to key j iff j <= query_slots[i] and key_mask[b, j]; boolean for SDPA, additive float
    (0 or the dtype's minimum) for eager attention.

    Passed in place of the (B, K) mask, it is used as given: transformers then skips its test of whether the 2-D mask
    is all ones, a device-to-host sync per forward, and uses the mask it would have built when the test fails.
    """
    keys = torch.arange(key_mask.shape[1], device=key_mask.device)
    visible = (keys <= query_slots[:, None])[None, None] & key_mask[:, None, None, :]  # (B, 1, Q, K)
    if model.config._attn_implementation == "sdpa":
        return visible
    return torch.where(visible, torch.zeros((), dtype=model.dtype, device=visible.device), torch.finfo(model.dtype).min)


def _uses_4d_mask(model: PreTrainedModel) -> bool:
    """True for models whose attention takes `_attention_mask`'s full causal mask (SDPA or eager, no local layers)."""
    config = model.config
    return config._attn_implementation in ("sdpa", "eager") and getattr(config, "sliding_window", None) is None


def _key_mask_argument(model: PreTrainedModel, key_mask: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """The `attention_mask` argument for `model`: `_attention_mask` where the model takes it, else the 2-D mask."""
    return _attention_mask(model, key_mask, query_slots) if _uses_4d_mask(model) else key_mask.long()


_CACHE_KEYWORDS: dict[type, str] = {}


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword under which `model`'s forward takes a KV cache: `cache` from transformers 5.24 on, `past_key_values`
    in the 5.x releases before; looked up once per model class.

    A forward drops a keyword it does not know (into **kwargs): passed under the other release's name, the cache would
    be ignored and the first decoding step would fail on mismatched shapes.
    """
    cls = type(model)
    if cls not in _CACHE_KEYWORDS:
        parameters = inspect.signature(cls.forward).parameters
        _CACHE_KEYWORDS[cls] = "cache" if "cache" in parameters else "past_key_values"
    return _CACHE_KEYWORDS[cls]


@contextmanager
def _checkpointed_blocks(model: PreTrainedModel):
    """Within this block, a forward that records gradients recomputes the activations of `model`'s blocks in the
    backward, when activation checkpointing is enabled on it (`reduce_training_memory`).

    transformers checkpoints a block only in training mode, and then drops its KV cache; the project keeps every model
    in eval mode and samples with a KV cache, so only the blocks' own flag is switched on, only here, and dropout
    modules stay in eval mode.
    """
    blocks = []
    if torch.is_grad_enabled():
        blocks = [
            m
            for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing and not m.training
        ]
    for block in blocks:
        block.training = True
    try:
        yield
    finally:
        for block in blocks:
            block.training = False


def with_bos(tokens: torch.Tensor, bos_token_id: int | None) -> torch.Tensor:
    """(B, T) tokens with `bos_token_id` put in front of every row, (B, 1 + T); unchanged when it is None."""
    if bos_token_id is None:
        return tokens
    return torch.cat([tokens.new_full((tokens.shape[0], 1), bos_token_id), tokens], dim=1)


def pad_invisible_hidden(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    pad_id: int,
    start: int = 0,
    check_first_token: bool = True,
    bf16: bool = False,
) -> torch.Tensor:
    """OAI transformer output, the final-LayerNorm hidden states at positions `start`.. (B, T - start, D; a negative
    `start` counts from the end): pads invisible, and each PAD position holds the last real position's state.

    `bf16`: the transformer runs under bfloat16 autocast; the hidden states are returned in float32 either way.
    """
    mask = tokens != pad_id  # (B, T)
    if check_first_token:
        _check_first_token_real(mask, pad_id)
    # PAD ids -> 0 before the embedding lookup; PAD keys masked out of attention for every query row
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L294-L297
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L133-L141
    with _checkpointed_blocks(model), torch.autocast(tokens.device.type, torch.bfloat16, enabled=bf16):
        output = model.base_model(
            input_ids=tokens.masked_fill(~mask, 0),
            attention_mask=_key_mask_argument(model, mask, torch.arange(mask.shape[1], device=mask.device)),
            position_ids=position_ids_from_mask(mask),
            use_cache=False,
        )
    hidden = output.last_hidden_state.float()
    # after ln_f, every PAD position takes the hidden state of the most recent real position
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L333-L340
    return _gather_positions(hidden, _last_real_index(mask)[:, start:])


# ---------------------------------------------------------------- policy


def _check_temperature(temperature: float) -> None:
    """ValueError for a non-positive temperature."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; OAI's tasks use 0.7 (--task.temperature).")


def _tempered_logits(lm: PreTrainedModel, hidden: torch.Tensor, pad_id: int, temperature: float) -> torch.Tensor:
    """LM-head logits (..., V) / temperature in float32; a PAD inside the vocab gets probability 0."""
    vocab_size = lm.config.vocab_size
    # temperature divides the logits for sampling and for every log-prob evaluation (spec G6); it divides the D-wide
    # hidden state here, (h / T) W^T = (h W^T) / T up to float rounding, which saves a pass over the (..., V) logits
    # and another in the backward
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/policy.py#L119-L121
    # logits sliced to the model vocab so special tokens outside it cannot be produced
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/policy.py#L58-L59
    logits = lm.get_output_embeddings()(hidden / temperature).float()
    if 0 <= pad_id < vocab_size:
        # DEVIATION (pad-logit): OAI's PAD lies outside the vocab; a PAD inside it gets the most negative finite logit
        # (probability exactly 0, while entropies stay finite, unlike -inf); in place, the head's backward needs
        # only its inputs, and before the slice: FSDP2 cannot hook a module output that is a view written in place
        logits[..., pad_id] = torch.finfo(logits.dtype).min
    return logits[..., :vocab_size]


class PolicyWithValueHead(nn.Module):
    """A causal LM and a scalar value head sharing one trunk, as OAI's Policy (spec 1.2)."""

    def __init__(self, lm: PreTrainedModel):
        super().__init__()
        self.lm = lm
        # value head initialised to exactly zero (std 0, bias 0): initial values are 0
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L248-L258
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.train(lm.training)  # the heads follow the mode of the model they wrap (eval after loading)
        self.bf16_autocast = False  # see reduce_training_memory

    def forward(
        self,
        query_responses: torch.Tensor,
        context_length: int,
        pad_id: int,
        temperature: float,
        training_arithmetic: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered logits (B, L, V) and values (B, L) at the positions that predict the L response tokens.

        Every row must start with a real token. Unlike `sample` and the reward model, this hot-path forward does not
        check it (`check_first_token=False`): the check would cost a device-to-host sync per call, and its inputs are
        contexts that `sample` already checked followed by sampled (always real) tokens.
        `training_arithmetic`: the arithmetic of a training forward (bf16 autocast when `reduce_training_memory` set
        it) without recording gradients too; by default only forwards that record gradients use it.
        """
        _check_temperature(temperature)
        if not 1 <= context_length < query_responses.shape[1]:
            raise ValueError(
                f"context_length {context_length} must be in [1, {query_responses.shape[1]}) for query_responses of "
                f"shape {tuple(query_responses.shape)}; pass the width of the context part."
            )
        # the last token predicts nothing: the causal trunk runs on the first T-1 tokens only
        bf16 = self.bf16_autocast and (torch.is_grad_enabled() or training_arithmetic)
        # only the response part: outputs at [ctx-1 : -1] predict the response tokens (LM head on L positions only)
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/policy.py#L114-L126
        hidden = pad_invisible_hidden(
            self.lm, query_responses[:, :-1], pad_id, context_length - 1, check_first_token=False, bf16=bf16
        )  # (B, L, D)
        logits = _tempered_logits(self.lm, hidden, pad_id, temperature)  # (B, L, V)
        values = self.value_head(hidden).squeeze(-1)  # (B, L)
        return logits, values

    def save(self, output_dir: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """`lm.save_pretrained(output_dir)`, the value head in `value_head.safetensors` beside it, and the tokenizer.

        The directory works with plain transformers: AutoTokenizer and AutoModelForCausalLM generate padded batches out
        of the box (the tokenizer is saved by `generation_tokenizer`: left padding with EOS, and generation_config
        names that PAD); `load_tokenizer` on it gives back the project's tokenizer with its own PAD.
        """
        if tokenizer is not None:
            tokenizer = generation_tokenizer(tokenizer, self.lm.get_input_embeddings().num_embeddings)
            self.lm.generation_config.pad_token_id = tokenizer.pad_token_id
        self.lm.save_pretrained(output_dir)
        state = {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(state, os.path.join(output_dir, VALUE_HEAD_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)

    @classmethod
    def load(cls, output_dir: str, flag: str = "--base_model") -> "PolicyWithValueHead":
        """Inverse of `save`: the LM (dropout off, eval mode) and its value head."""
        policy = cls(load_causal_lm(output_dir, flag))
        path = os.path.join(output_dir, VALUE_HEAD_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"'{path}' is missing; {flag} must point at a directory written by PolicyWithValueHead.save "
                f"(for a plain language model use PolicyWithValueHead(load_causal_lm(DIR)))."
            )
        policy.value_head.load_state_dict(load_file(path))
        return policy


@torch.no_grad()
def training_logprobs_and_values(
    policy: PolicyWithValueHead,
    query_responses: torch.Tensor,
    context_length: int,
    pad_id: int,
    temperature: float,
    micro_batch: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tempered log-probs and values (B, L) of the responses by the arithmetic of the policy's training forward (bf16
    autocast when `reduce_training_memory` set it), `micro_batch` rows at a time as the PPO loss runs it."""
    responses = query_responses[:, context_length:]
    logprobs, values = [], []
    for rows, row_responses in zip(query_responses.split(micro_batch), responses.split(micro_batch)):
        logits, row_values = policy(rows, context_length, pad_id, temperature, training_arithmetic=True)
        logprobs.append(logprobs_from_logits(logits, row_responses))
        values.append(row_values)
    return torch.cat(logprobs), torch.cat(values)


def _sample_next(
    policy: PolicyWithValueHead, hidden: torch.Tensor, uniform: torch.Tensor, pad_id: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Next token, its tempered log-prob and the value, each (B,), from the last position's hidden state (B, D)."""
    logits = _tempered_logits(policy.lm, hidden, pad_id, temperature)  # (B, V)
    # pure categorical sampling from the tempered distribution (top_k=0, top_p=1); the log-prob of the sampled
    # token and the value head come from the same pass
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/sample.py#L24-L43
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/policy.py#L97-L112
    tokens, logprobs = sample_categorical(logits, uniform)
    return tokens, logprobs, policy.value_head(hidden).squeeze(-1).float()


def _decode_step(
    policy: PolicyWithValueHead,
    cache: StaticCache,
    token: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    key_mask: torch.Tensor,
    uniform: torch.Tensor,
    pad_id: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step at fixed shapes, no host sync and no random draw: `token` (B, 1) at `position` (B, 1) goes
    into cache slot `slot` (1,) (attending to the real keys of `key_mask` (B, K) up to it), then `_sample_next`."""
    lm = policy.lm
    output = lm.base_model(
        input_ids=token,
        attention_mask=_key_mask_argument(lm, key_mask, slot),
        position_ids=position,
        use_cache=True,
        **{cache_keyword(lm.base_model): cache},
    )
    return _sample_next(policy, output.last_hidden_state[:, 0], uniform, pad_id, temperature)


def _decoding_graph(
    policy: PolicyWithValueHead,
    batch_size: int,
    total_length: int,
    pad_id: int,
    temperature: float,
    device: torch.device,
) -> decoding_graph.DecodingGraph:
    """The policy's captured decoding step for this shape (`decoding_graph`), with its KV cache emptied."""

    def make() -> decoding_graph.DecodingGraph:
        cache = _static_cache(policy.lm.config, total_length, device)
        # by weak reference: the graphs are kept by policy and must not keep it alive
        policy_ref = weakref.ref(policy)

        def step(token, position, slot, key_mask, uniform):
            return _decode_step(policy_ref(), cache, token, position, slot, key_mask, uniform, pad_id, temperature)

        return decoding_graph.DecodingGraph(step, cache, batch_size, total_length, device)

    # pad_id and temperature are Python constants of the step, baked into the captured kernels
    key = (batch_size, total_length, str(device), pad_id, temperature, torch.is_autocast_enabled(device.type))
    graph = decoding_graph.GRAPHS.get(policy, key, make)
    graph.cache.reset()
    return graph


def _static_cache(config, max_cache_len: int, device: torch.device) -> StaticCache:
    """A StaticCache whose layers' position counters are on `device` already: transformers makes each on the host and
    moves it at the layer's first update, a host-to-device copy that waits for the queued kernels (once per layer)."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    for layer in cache.layers:
        layer.cumulative_length = torch.zeros((), dtype=layer.cumulative_length.dtype, device=device)
    return cache


@torch.no_grad()
def sample(
    policy: PolicyWithValueHead,
    contexts: torch.Tensor,
    response_length: int,
    temperature: float,
    pad_id: int,
    generator: torch.Generator | None = None,
    check_first_token: bool = True,
    compile: bool = False,
    max_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fixed-length KV-cached categorical sampling: responses, tempered logprobs and values, each (B, L).

    `check_first_token=False` skips the leading-PAD check and its device-to-host sync, for contexts built by
    QueryStream, whose queries always start with a real token. `compile`: every decoding step after the first runs
    as one graph of the same kernels, captured once per shape (a CUDA graph on CUDA devices, run eagerly elsewhere;
    `decoding_graph`): the same samples.
    `max_rows`: decode at most this many rows at a time (the KV cache and the step's logits scale with it); every row
    gets the random numbers it gets when all rows decode together (None: all at once).
    """
    _check_temperature(temperature)
    if response_length < 1:
        raise ValueError(f"response_length must be >= 1, got {response_length} (--task.response_length).")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows} (--rollout_micro_batch_size).")
    if check_first_token:
        _check_first_token_real(contexts != pad_id, pad_id)
    # each step's uniforms for every row, drawn up front one step after the other: the numbers a draw inside each
    # step would give, as nothing else draws from `generator`; rows decoded apart take their own rows of them
    batch_size = contexts.shape[0]
    uniforms = [categorical_uniforms(batch_size, generator, contexts.device) for _ in range(response_length)]
    if max_rows is None or max_rows >= batch_size:
        return _decode(policy, contexts, uniforms, pad_id, temperature, compile)
    outputs = [
        _decode(policy, contexts[start : start + max_rows], [u[start : start + max_rows] for u in uniforms], pad_id,
                temperature, compile)
        for start in range(0, batch_size, max_rows)
    ]  # fmt: skip
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def _decode(
    policy: PolicyWithValueHead,
    contexts: torch.Tensor,
    uniforms: list[torch.Tensor],
    pad_id: int,
    temperature: float,
    compile: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample` of `contexts` (B, C) with each step's uniforms (B, 1) given: responses, logprobs and values (B, L)."""
    lm = policy.lm
    batch_size, context_length = contexts.shape
    response_length = len(uniforms)
    device = contexts.device
    mask = contexts != pad_id  # (B, C)
    total_length = context_length + response_length
    # the episode's real keys (sampled tokens are always real)
    key_mask = torch.ones(batch_size, total_length, dtype=torch.bool, device=device)
    key_mask[:, :context_length] = mask
    responses = torch.empty(batch_size, response_length, dtype=torch.long, device=device)
    logprobs = torch.empty(batch_size, response_length, dtype=torch.float32, device=device)
    values = torch.empty(batch_size, response_length, dtype=torch.float32, device=device)
    # static shapes: keys/values of the whole episode preallocated and written in place (a growing cache copies all
    # of it at every step), slot by slot; `position` is the pad-aware position of the token fed in
    if compile:
        graph = _decoding_graph(policy, batch_size, total_length, pad_id, temperature, device)
        cache = graph.cache
    else:
        cache = _static_cache(lm.config, total_length, device)
    # first token from the context's last position (after PAD replacement: the last real token), then
    # response_length-1 KV-cached steps; no stop at EOS, so every response has exactly L tokens
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/sample.py#L26-L31
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/sample.py#L62-L82
    output = lm.base_model(
        input_ids=contexts.masked_fill(~mask, 0),
        attention_mask=_key_mask_argument(lm, key_mask, torch.arange(context_length, device=device)),
        position_ids=position_ids_from_mask(mask),
        use_cache=True,
        **{cache_keyword(lm.base_model): cache},
    )
    hidden = _gather_positions(output.last_hidden_state, _last_real_index(mask)[:, -1:])[:, 0]  # (B, D)
    token, logprobs[:, 0], values[:, 0] = _sample_next(policy, hidden, uniforms[0], pad_id, temperature)
    responses[:, 0] = token
    position = mask.long().sum(dim=1, keepdim=True)  # (B, 1): the next token's position = real tokens so far
    if compile:
        graph.start(key_mask, token, position, context_length)
        for t in range(1, response_length):
            responses[:, t], logprobs[:, t], values[:, t] = graph.step(uniforms[t])
        return responses, logprobs, values
    slot = torch.full((1,), context_length, dtype=torch.long, device=device)
    for t in range(1, response_length):
        token, logprobs[:, t], values[:, t] = _decode_step(
            policy, cache, token[:, None].clone(), position, slot, key_mask, uniforms[t], pad_id, temperature
        )
        responses[:, t] = token
        position, slot = position + 1, slot + 1
    return responses, logprobs, values


# ---------------------------------------------------------------- reward model


def reward_head_std(hidden_size: int) -> float:
    """OAI's reward-head init std, 1/sqrt(n_embd + 1) (0.0360609 for GPT-2 124M)."""
    return 1.0 / math.sqrt(hidden_size + 1)


class RewardModel(nn.Module):
    """reward = gain * head(h at the last real token of query ⊕ response) + bias (spec R1-R3).

    `bos_token_id`: the BOS that the trunk's tokenizer adds in front of every encoding (`added_bos_id`; None for
    GPT-2): the forward puts it in front of every query ⊕ response, the one place where reward inputs get it.
    """

    def __init__(self, trunk: PreTrainedModel, bos_token_id: int | None = None):
        super().__init__()
        self.trunk = trunk
        self.bos_token_id = bos_token_id
        hidden_size = trunk.config.hidden_size
        # reward head: weight ~ N(0, 1/sqrt(n_embd+1)), bias 0
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L248-L258
        self.head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.head.weight, std=reward_head_std(hidden_size))
        nn.init.zeros_(self.head.bias)
        # scalar gain/bias, initialised to 1/0, trainable in the reward phase
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L48-L57
        self.gain = nn.Parameter(torch.tensor(1.0))
        self.bias = nn.Parameter(torch.tensor(0.0))
        self.train(trunk.training)  # the heads follow the mode of the model they wrap (eval after loading)
        self.bf16_autocast = False  # see reduce_training_memory

    def forward(self, query_responses: torch.Tensor, pad_id: int, check_first_token: bool = True) -> torch.Tensor:
        """Rewards (B,) read at position -1, i.e. at the last real token after the PAD replacement."""
        bf16 = self.bf16_autocast and torch.is_grad_enabled()
        if check_first_token:
            _check_first_token_real(query_responses != pad_id, pad_id)
        tokens = with_bos(query_responses, self.bos_token_id)
        # the head output at index -1 of query ⊕ response (a trailing PAD holds the last real token's state)
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L130-L138
        last = pad_invisible_hidden(self.trunk, tokens, pad_id, -1, check_first_token=False, bf16=bf16)[:, 0]  # (B, D)
        return self.gain * self.head(last).squeeze(-1) + self.bias

    @classmethod
    def from_base(cls, name_or_dir: str, flag: str = "--base_model", bos_token_id: int | None = None) -> "RewardModel":
        """A fresh reward model on a pretrained trunk (AutoModel, no LM head), float32, dropout off, eval mode;
        `bos_token_id`: `added_bos_id` of the base model's tokenizer."""
        return cls(_load_pretrained(AutoModel, name_or_dir, flag, kind="model"), bos_token_id)

    def save(self, output_dir: str, metadata: dict) -> None:
        """The reward model and `reward_model.json` (metadata, gain, bias); `metadata["pad_token_id"]` is the PAD id.

        GPT-2 and GPT-NeoX trunks are saved as a standard `*ForSequenceClassification` checkpoint that computes this
        reward exactly (see `classifier_checkpoint`); other trunks as `trunk/` (save_pretrained) plus head, gain and
        bias in `reward_head.safetensors`, with no config.json at the top, so that standard classification loaders
        fail.
        """
        # OAI checkpoints trunk, head, gain and bias together
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L161-L167
        if "pad_token_id" not in metadata:
            raise ValueError("RewardModel.save needs metadata['pad_token_id'], the tokenizer's PAD id.")
        classifier = classifier_checkpoint(self, metadata["pad_token_id"])
        if classifier is not None:
            classifier.save_pretrained(output_dir)
        else:
            self.trunk.save_pretrained(os.path.join(output_dir, REWARD_TRUNK_DIR))
            tensors = {
                "head.weight": self.head.weight,
                "head.bias": self.head.bias,
                "gain": self.gain,
                "bias": self.bias,
            }
            tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            save_file(tensors, os.path.join(output_dir, REWARD_HEAD_FILE))
        info = {
            **metadata,
            "checkpoint": "classifier" if classifier is not None else "trunk",
            "bos_token_id": self.bos_token_id,
            "gain": self.gain.item(),
            "bias": self.bias.item(),
            "hidden_size": self.trunk.config.hidden_size,
            "vocab_size": self.trunk.config.vocab_size,
        }
        with open(os.path.join(output_dir, REWARD_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)


@torch.no_grad()
def classifier_checkpoint(model: RewardModel, pad_id: int) -> PreTrainedModel | None:
    """The reward model as a standard `*ForSequenceClassification` model with the same reward; None when impossible.

    gain * (w.h + b) + bias = w'.(h + d) with w' = gain * w and d = (gain * b + bias) w' / |w'|^2: the gain goes into
    the bias-free score layer and the constant into the final LayerNorm's bias (d is parallel to w', so only the score
    sees it). The classifier reads the score at the last token that is not `pad_id` (config.pad_token_id), so the
    embedding gets a zero row for a PAD outside it; right-padded text then gives the project's reward.
    """
    trunk = model.trunk
    norm_name = CLASSIFIER_EXPORT.get(trunk.config.model_type)
    weight = model.gain * model.head.weight  # (1, D)
    constant = model.gain * model.head.bias + model.bias  # (1,)
    squared_norm = weight.square().sum()
    if norm_name is None or not (squared_norm > 0 and torch.isfinite(squared_norm) and torch.isfinite(constant).all()):
        return None
    config = copy.deepcopy(trunk.config)
    config.num_labels, config.id2label, config.label2id = 1, {0: "reward"}, {"reward": 0}
    config.pad_token_id = pad_id
    embeddings = trunk.get_input_embeddings().weight  # (V, D)
    config.vocab_size = max(embeddings.shape[0], pad_id + 1)
    with torch.device("meta"):
        classifier = AutoModelForSequenceClassification.from_config(config)
    prefix = classifier.base_model_prefix
    state = {f"{prefix}.{k}": v.detach() for k, v in trunk.state_dict().items()}
    embedding_name = next(name for name, module in trunk.named_modules() if module is trunk.get_input_embeddings())
    state[f"{prefix}.{embedding_name}.weight"] = torch.cat(
        [embeddings.detach(), embeddings.new_zeros(config.vocab_size - embeddings.shape[0], embeddings.shape[1])]
    )
    norm_bias = f"{prefix}.{norm_name}.bias"
    state[norm_bias] = state[norm_bias] + constant * weight[0] / squared_norm
    state["score.weight"] = weight.detach().clone()
    classifier.load_state_dict(state, strict=True, assign=True)
    return classifier.eval()


def reduce_training_memory(model: PolicyWithValueHead | RewardModel, gradient_checkpointing: bool, bf16: bool) -> None:
    """Memory savers for the forward passes that record gradients (training); sampling and scoring are unchanged.

    `gradient_checkpointing`: transformers' activation checkpointing (non-reentrant) of every block, whose backward
    recomputes the block's activations instead of storing them: the same gradients for ~30% more compute.
    `bf16`: the trunk runs under bfloat16 autocast; weights, gradients, heads and logits stay float32.
    Both are off by default: OAI trains in float32 and stores every activation.
    """
    trunk = model.lm if isinstance(model, PolicyWithValueHead) else model.trunk
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(trunk, "activation_checkpointing_enable"):
            trunk.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers releases before the rename
            trunk.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        trunk.disable_input_require_grads()  # only reentrant checkpointing needs embeddings that require grad
    model.bf16_autocast = bf16


def score_label_rows(
    reward_model: RewardModel, query: torch.Tensor, samples: torch.Tensor, pad_id: int, check_first_token: bool = True
) -> torch.Tensor:
    """Rewards (B, N) of every response of B label rows, in one batched forward of B*N query ⊕ response rows.

    `check_first_token=False` skips the leading-PAD check and its host sync, for labels that `load_labels` checked.
    """
    b, n, length = samples.shape
    query_responses = torch.cat([query.repeat_interleave(n, dim=0), samples.reshape(b * n, length)], dim=1)
    return reward_model(query_responses, pad_id, check_first_token).view(b, n)


def saved_kind(directory: str) -> str | None:
    """What the project saved in `directory`: "reward model" (train_reward.py), "policy" (train_policy.py) or None."""
    if os.path.isfile(os.path.join(directory, REWARD_CONFIG_FILE)):
        return "reward model"
    if os.path.isfile(os.path.join(directory, VALUE_HEAD_FILE)):
        return "policy"
    return None


def read_reward_metadata(output_dir: str, flag: str = REWARD_MODEL_FLAG) -> dict:
    """`reward_model.json` of a reward model directory (no weights loaded); FileNotFoundError naming what is there."""
    config_path = os.path.join(output_dir, REWARD_CONFIG_FILE)
    if saved_kind(output_dir) == "policy":
        raise ValueError(
            f"{flag} '{output_dir}' holds a policy written by train_policy.py, not a reward model; pass the "
            f"--output_dir of train_reward.py as {flag}."
        )
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"reward model '{output_dir}' not found ('{config_path}' is missing); pass {flag} DIR with a directory "
            f"written by train_reward.py."
        )
    with open(config_path, encoding="utf-8") as f:
        return json.load(f)


def load_reward_model(output_dir: str, flag: str = REWARD_MODEL_FLAG) -> tuple[RewardModel, dict]:
    """Inverse of `RewardModel.save`: the model (dropout off, eval mode) and the saved metadata.

    A classifier checkpoint loads with gain 1 and bias 0 (they are folded into its weights, see
    `classifier_checkpoint`); the metadata keeps the trained gain and bias.
    """
    check_complete_save(output_dir, flag)
    metadata = read_reward_metadata(output_dir, flag)
    # reward models saved before BOS handling record none: they were trained, and are scored, without one
    bos_token_id = metadata.get("bos_token_id")
    if metadata.get("checkpoint") == "trunk":
        return _load_trunk_checkpoint(output_dir, flag, bos_token_id), metadata
    classifier = _load_pretrained(AutoModelForSequenceClassification, output_dir, flag, "reward model", strict=True)
    model = RewardModel(classifier.base_model, bos_token_id)
    with torch.no_grad():
        model.head.weight.copy_(classifier.score.weight)
        model.head.bias.zero_()
    return model, metadata


def _load_trunk_checkpoint(output_dir: str, flag: str, bos_token_id: int | None) -> RewardModel:
    """A reward model saved as `trunk/` plus `reward_head.safetensors`."""
    path = os.path.join(output_dir, REWARD_HEAD_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"'{path}' is missing; pass {flag} DIR with a directory written by train_reward.py.")
    trunk = _load_pretrained(AutoModel, os.path.join(output_dir, REWARD_TRUNK_DIR), flag, kind="reward model")
    tensors = load_file(path)
    head_size, trunk_size = tensors["head.weight"].shape[-1], trunk.config.hidden_size
    if head_size != trunk_size:
        raise ValueError(
            f"reward head in '{output_dir}' expects hidden size {head_size} but the trunk has hidden size "
            f"{trunk_size}; the checkpoint is inconsistent, re-save it with RewardModel.save."
        )
    model = RewardModel(trunk, bos_token_id)
    with torch.no_grad():
        model.head.weight.copy_(tensors["head.weight"])
        model.head.bias.copy_(tensors["head.bias"])
        model.gain.copy_(tensors["gain"])
        model.bias.copy_(tensors["bias"])
    check_finite_weights(model, f"reward model '{output_dir}' ({flag})")
    return model


class RewardScorer:
    """Rewards of raw text: `RewardScorer.from_pretrained(DIR)(queries, responses)` -> (B,) float tensor.

    Queries and responses are tokenized separately with the reward model's tokenizer and cut to the task's
    query_length / response_length (what the model was trained on), as the scripts feed it: query ⊕ response.
    """

    def __init__(self, model: RewardModel, tokenizer: PreTrainedTokenizerBase, task: dict):
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer
        self.query_length, self.response_length = task.get("query_length"), task.get("response_length")

    @classmethod
    def from_pretrained(cls, output_dir: str, device: str | torch.device = "cpu") -> "RewardScorer":
        """The reward model and tokenizer that train_reward.py wrote to `output_dir`."""
        model, metadata = load_reward_model(output_dir, flag="reward model directory")
        tokenizer = load_tokenizer(output_dir, flag="reward model directory")
        if "tokenizer_fingerprint" in metadata:
            check_same_tokenizer(metadata, tokenizer, f"the reward model '{output_dir}'", "its saved tokenizer differs")
        return cls(model.to(device), tokenizer, metadata.get("task") or {})

    def _encode(self, texts: list[str], length: int | None) -> torch.Tensor:
        """(B, length) right-padded tokens, cut to `length` (padded to the longest text when None)."""
        padding = "max_length" if length else "longest"
        return self.tokenizer(
            texts,
            add_special_tokens=False,
            padding=padding,
            truncation=bool(length),
            max_length=length,
            return_tensors="pt",
        )["input_ids"]

    @torch.no_grad()
    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        """Rewards (B,) of each query followed by its response."""
        if len(queries) != len(responses):
            raise ValueError(f"got {len(queries)} queries but {len(responses)} responses; pass one response per query.")
        query_tokens = self._encode(queries, self.query_length)  # (B, Lq)
        empty = torch.nonzero(query_tokens[:, 0] == self.tokenizer.pad_token_id).flatten().tolist()
        if empty:
            raise ValueError(f"queries {empty[:8]} are empty; the reward model needs a real first token.")
        tokens = torch.cat([query_tokens, self._encode(responses, self.response_length)], 1)
        device = next(self.model.parameters()).device
        return self.model(tokens.to(device), self.tokenizer.pad_token_id).float().cpu()
