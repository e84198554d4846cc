"""A critic of its own (nplus N16, --ppo.value_model): a trunk and a scalar head that give per-token values, trained
with the policy by one optimizer, in place of OAI's value head on the policy's trunk (spec §1.2, G8).

The critic reads the policy's tokens with the project's pad semantics (spec G2): its values at the positions that
predict each response token are those a `PolicyWithValueHead` value head would give on the same trunk.
"""

import json
import os

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from lm_human_preference_details.files import check_complete_save
from lm_human_preference_details.modeling import (
    CRITIC_CONFIG_FILE,
    CRITIC_DIR,
    CRITIC_TRUNK_DIR,
    PolicyWithValueHead,
    RewardModel,
    _load_pretrained,
    check_finite_weights,
    load_causal_lm,
    load_reward_model,
    pad_invisible_hidden,
    read_reward_metadata,
    saved_kind,
    with_bos,
)
from lm_human_preference_details.rewards import reward_model_dir
from lm_human_preference_details.tokenizer import check_same_tokenizer, tokenizer_fingerprint

FLAG = "--ppo.value_model"
CRITIC_HEAD_FILE = "critic_head.safetensors"
SOURCES = ("reward", "policy")
"""--ppo.value_model's named sources; anything else is a directory"""


class Critic(nn.Module):
    """values = head(h) at the positions that predict the response tokens, h the trunk's final hidden states of
    context ⊕ response with pads invisible (spec G2), as `PolicyWithValueHead`'s value head reads its trunk.

    `bos_token_id`: a BOS put in front of every input (a critic from a reward model whose tokenizer adds one: it was
    trained, and reads, with it); None: the policy's tokens as they are.
    """

    def __init__(self, trunk: PreTrainedModel, bos_token_id: int | None = None):
        super().__init__()
        self.trunk = trunk
        self.bos_token_id = bos_token_id
        # a new head starts at exactly zero, as OAI's value head (spec G8): every initial value is 0
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/language/model.py#L248-L258
        self.head = nn.Linear(trunk.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.train(trunk.training)
        self.bf16_autocast = False  # see modeling.reduce_training_memory
        self.metadata: dict = {}  # what `save` records beside the weights: where the critic came from, the tokenizer

    def forward(
        self, query_responses: torch.Tensor, context_length: int, pad_id: int, training_arithmetic: bool = False
    ) -> torch.Tensor:
        """Values (B, L) at the positions [C - 1, C + L - 1) of context ⊕ response, those that predict the L response
        tokens (the policy's value head's positions, spec P7); no leading-PAD check, as the policy's forward."""
        bf16 = self.bf16_autocast and (torch.is_grad_enabled() or training_arithmetic)
        # the last token predicts nothing; a BOS in front shifts every position by one
        tokens = with_bos(query_responses[:, :-1], self.bos_token_id)
        start = context_length - 1 + tokens.shape[1] - (query_responses.shape[1] - 1)
        hidden = pad_invisible_hidden(self.trunk, tokens, pad_id, start, check_first_token=False, bf16=bf16)
        return self.head(hidden).squeeze(-1)  # (B, L)

    @classmethod
    def from_reward_model(cls, directory: str, flag: str = FLAG) -> "Critic":
        """The reward model that train_reward.py wrote to `directory`, as a critic (`of_reward_model`)."""
        return cls.of_reward_model(load_reward_model(directory, flag)[0])

    @classmethod
    def of_reward_model(cls, reward_model: RewardModel) -> "Critic":
        """A critic on the reward model's trunk and BOS, whose head is the reward model's with gain and bias folded
        in, head' = gain * head + bias: every value starts as the normalized score of its prefix."""
        # the critic is the reward model, its normalization bias included (nplus N14, N16)
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L478-L491
        critic = cls(reward_model.trunk, reward_model.bos_token_id)
        with torch.no_grad():
            critic.head.weight.copy_(reward_model.gain * reward_model.head.weight)
            critic.head.bias.copy_(reward_model.gain * reward_model.head.bias + reward_model.bias)
        return critic

    @classmethod
    def from_policy_base(cls, base_model: str) -> "Critic":
        """A critic on a copy of --base_model's trunk (LM head dropped) with a zero head (spec G8)."""
        return cls(load_causal_lm(base_model).base_model)

    def save(self, directory: str) -> None:
        """The trunk in `trunk/` (save_pretrained), the head in critic_head.safetensors, and in critic.json the
        `metadata` (the tokenizer's fingerprint and PAD, where the critic came from) with its BOS."""
        self.trunk.save_pretrained(os.path.join(directory, CRITIC_TRUNK_DIR))
        head = {f"head.{k}": v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(head, os.path.join(directory, CRITIC_HEAD_FILE))
        info = {**self.metadata, "bos_token_id": self.bos_token_id, "vocab_size": self.trunk.config.vocab_size}
        with open(os.path.join(directory, CRITIC_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)

    @classmethod
    def load(cls, directory: str, flag: str = FLAG) -> tuple["Critic", dict]:
        """Inverse of `save`: the critic (dropout off, eval mode) and its critic.json."""
        check_complete_save(directory, flag)
        with open(os.path.join(directory, CRITIC_CONFIG_FILE), encoding="utf-8") as f:
            metadata = json.load(f)
        head_path = os.path.join(directory, CRITIC_HEAD_FILE)
        if not os.path.isfile(head_path):
            raise FileNotFoundError(f"{flag} '{directory}': '{head_path}' is missing; pass a critic saved by a run.")
        trunk = _load_pretrained(AutoModel, os.path.join(directory, CRITIC_TRUNK_DIR), flag, kind="critic")
        critic = cls(trunk, metadata.get("bos_token_id"))
        tensors = load_file(head_path)
        critic.head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items()})
        check_finite_weights(critic, f"critic '{directory}' ({flag})")
        return critic, metadata


class PolicyWithCritic(nn.Module):
    """The policy's logits and the critic's values from one call, as `PolicyWithValueHead` gives its own: the PPO
    update trains both through one optimizer over this module's parameters (nplus N16). The policy's value head is
    frozen (requires_grad off): unused, it gets neither gradients nor optimizer state."""

    def __init__(self, policy: PolicyWithValueHead, critic: Critic):
        super().__init__()
        self.policy, self.critic = policy, critic
        policy.value_head.requires_grad_(False)

    def forward(
        self,
        query_responses: torch.Tensor,
        context_length: int,
        pad_id: int,
        temperature: float,
        training_arithmetic: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered logits (B, L, V) of the policy and values (B, L) of the critic at the response positions."""
        # policy and critic in one module, one forward for the loss (nplus N16, N24)
        # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L304-L311
        logits, _ = self.policy(query_responses, context_length, pad_id, temperature, training_arithmetic)
        return logits, self.critic(query_responses, context_length, pad_id, training_arithmetic)


@torch.no_grad()
def rollout_values(
    critic: Critic, query_responses: torch.Tensor, context_length: int, pad_id: int, rows: int
) -> torch.Tensor:
    """The rollout's values (B, L): one critic forward after sampling, `rows` episodes at a time (the sampler's values
    are the policy's value head's)."""
    return torch.cat([critic(chunk, context_length, pad_id) for chunk in query_responses.split(rows)])


def check_value_model_flag(value_model: str | None, trained_model: str, lora_rank: int) -> None:
    """What the flags alone tell about --ppo.value_model: ValueError or FileNotFoundError in one line naming it."""
    if value_model is None:
        return
    if lora_rank:
        raise ValueError(
            f"{FLAG} {value_model} with --lora.rank {lora_rank}: LoRA runs keep the value head on the policy's trunk, "
            "a separate critic with LoRA adapters is not supported; drop one of the two flags."
        )
    if value_model == "reward" and reward_model_dir(trained_model) is None:
        raise ValueError(
            f"{FLAG} reward starts the critic from the reward model, but --rewards.trained_model is the programmatic "
            f"reward '{trained_model}'; pass {FLAG} policy, or {FLAG} DIR with a reward model written by "
            "train_reward.py."
        )
    if value_model not in SOURCES and not os.path.isdir(os.path.expanduser(value_model)):
        raise FileNotFoundError(
            f"{FLAG} '{value_model}' is not a directory; pass reward, policy, or the directory of a reward model "
            f"(train_reward.py) or of a critic (OUTPUT_DIR/{CRITIC_DIR} of train_policy.py)."
        )


def load_critic(
    value_model: str | None,
    trained_model: str,
    base_model: str,
    tokenizer: PreTrainedTokenizerBase,
    policy: PolicyWithValueHead,
) -> Critic | None:
    """The critic that --ppo.value_model names (float32, eval mode, on the policy's device), its `metadata` set; None
    without one (OAI's value head on the policy's trunk). ValueError naming the flag when it cannot read the policy's
    tokens."""
    if value_model is None:
        return None
    directory = reward_model_dir(trained_model) if value_model == "reward" else os.path.expanduser(value_model)
    policy_tokens = f"the policy uses the tokenizer of '{base_model}'"
    if value_model == "policy":
        # N+ starts the critic from the reward model (nplus N16); this one starts as OAI's value head (zero head,
        # spec G8, all values 0) on a trunk of its own, a copy of the policy's
        critic, described = Critic.from_policy_base(base_model), f"the policy's trunk ({base_model})"
    elif os.path.isfile(os.path.join(directory, CRITIC_CONFIG_FILE)):
        critic, saved = Critic.load(directory)
        check_same_tokenizer(saved, tokenizer, f"the critic '{directory}' ({FLAG})", policy_tokens)
        described = f"the critic '{directory}'"
    elif saved_kind(directory) == "reward model":
        saved = read_reward_metadata(directory, FLAG)
        check_same_tokenizer(saved, tokenizer, f"the reward model '{directory}' ({FLAG})", policy_tokens)
        critic, described = Critic.from_reward_model(directory), f"the reward model '{directory}'"
    else:
        raise ValueError(
            f"{FLAG} '{value_model}' holds neither a reward model (train_reward.py) nor a critic "
            f"(OUTPUT_DIR/{CRITIC_DIR} of train_policy.py); pass one of them, reward or policy."
        )
    check_reads_policy_tokens(critic, policy, value_model)
    device = next(policy.parameters()).device
    metadata = {
        "value_model": value_model,
        "initialized_from": described,
        "tokenizer": base_model,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "hidden_size": critic.trunk.config.hidden_size,
    }
    critic.metadata = metadata
    return critic.to(device).eval()


def check_reads_policy_tokens(critic: Critic, policy: PolicyWithValueHead, value_model: str) -> None:
    """ValueError unless the critic's trunk embeds every token the policy can produce (its vocabulary)."""
    critic_rows = critic.trunk.get_input_embeddings().num_embeddings
    policy_vocab = policy.lm.config.vocab_size
    if critic_rows < policy_vocab:
        raise ValueError(
            f"{FLAG} '{value_model}': the critic's trunk embeds {critic_rows} tokens but the policy's vocabulary has "
            f"{policy_vocab}; the critic reads the policy's tokens: pass a model trained from the same --base_model."
        )
