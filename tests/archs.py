"""Tiny offline stand-ins for the supported base-model families: a random config and a tokenizer like the family's.

Each tokenizer is a byte-level BPE trained in-process (with the `tokenizers` library) on text of the demo's world, with
its special tokens set like the family's real tokenizer:

| family | like | BOS added to every encoding | EOS | PAD |
|---|---|---|---|---|
| gpt2 | GPT-2 | no | `<|endoftext|>` | none |
| gpt_neox | Pythia | no | `<|endoftext|>` (also BOS) | none |
| llama | Llama 3 | yes, `<|begin_of_text|>` | `<|end_of_text|>` | none |
| qwen2 | Qwen2 base | no (no BOS token) | `<|endoftext|>` | `<|endoftext|>`, i.e. EOS |

With `chat=True` (llama and qwen2) the tokenizer is the family's instruct tokenizer instead: the chat's special tokens
are added after the trained vocabulary, a chat template like the family's is set, and EOS is the token that ends an
assistant turn (as in the instruct models' own tokenizer files):

| family | like | a chat turn | EOS (ends a turn) | PAD |
|---|---|---|---|---|
| llama | Llama 3 Instruct | `<|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|>` | `<|eot_id|>` | none |
| qwen2 | Qwen2 Instruct | ChatML: `<|im_start|>ROLE\nTEXT<|im_end|>\n` | `<|im_end|>` | `<|endoftext|>` |
"""

import functools
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from demo import world

FAMILIES = ("gpt2", "gpt_neox", "llama", "qwen2")
VOCAB_SIZE = 600
"""BPE vocabulary size, special tokens included: enough for every word of the demo's world to be one token"""

BOS_TEXT = "<|begin_of_text|>"
"""the llama stand-in's BOS as text (Llama 3's), which a text may also hold as plain characters"""

_SPECIALS = {
    # family: (bos, eos, pad, tokens added to every encoding's front)
    "gpt2": ("<|endoftext|>", "<|endoftext|>", None, False),
    "gpt_neox": ("<|endoftext|>", "<|endoftext|>", None, False),
    "llama": ("<|begin_of_text|>", "<|end_of_text|>", None, True),
    "qwen2": (None, "<|endoftext|>", "<|endoftext|>", False),
}


def world_text(passages: int = 400, seed: int = 0) -> list[str]:
    """Passages of the demo's world: the training text of the tokenizers and of the tests' queries."""
    rng = random.Random(seed)
    args = world.Args()
    return [world.passage(rng, args) for _ in range(passages)]


@functools.cache
def _trained_bpe(specials: tuple[str, ...]) -> str:
    """A byte-level BPE trained on the world's text, serialized (cached: training takes about a second)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(world_text(), trainer=trainer)
    return bpe.to_str()


INSTRUCT_TEMPLATES = {
    # Llama 3 Instruct's template, without its default "Cutting Knowledge Date" system text
    "llama": (
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # ChatML as Qwen2 Instruct writes it, without its default system message
    "qwen2": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
        "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}
"""the chat template of each family's instruct tokenizer (`family_tokenizer(family, chat=True)`)"""
INSTRUCT_TOKENS = {
    # family: (the chat's special tokens, the EOS that ends an assistant turn)
    "llama": (("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    "qwen2": (("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
}


def family_tokenizer(family: str, chat: bool = False) -> PreTrainedTokenizerFast:
    """A tokenizer with the family's special-token conventions (see the module's table), as its hub files would give;
    chat=True: the family's instruct tokenizer, with its chat tokens, chat template and turn-ending EOS."""
    if chat and family not in INSTRUCT_TEMPLATES:
        raise ValueError(f"no chat template for {family!r}; one of {tuple(INSTRUCT_TEMPLATES)}")
    bos, eos, pad, adds_bos = _SPECIALS[family]
    specials = tuple(dict.fromkeys(t for t in (bos, eos, pad) if t is not None))
    backend = Tokenizer.from_str(_trained_bpe(specials))
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "model_max_length": 256}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in kwargs.items() if v is not None})
    if chat:
        tokens, turn_end = INSTRUCT_TOKENS[family]
        tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
        tokenizer.eos_token = turn_end
        tokenizer.chat_template = INSTRUCT_TEMPLATES[family]
    return tokenizer


def family_model(family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """A 2-layer, 32-wide random model of the family over the tokenizer's vocabulary, with dropout off, in eval mode."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    rotary = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "gpt2":
        config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=256, **common)
        config.attn_pdrop = config.embd_pdrop = config.resid_pdrop = config.summary_first_dropout = 0.0
        return GPT2LMHeadModel(config).eval()
    if family == "gpt_neox":
        config = GPTNeoXConfig(**rotary, rotary_pct=0.25, max_position_embeddings=256, **common)
        return GPTNeoXForCausalLM(config).eval()
    if family == "llama":
        config = LlamaConfig(**rotary, num_key_value_heads=2, max_position_embeddings=256, **common)
        return LlamaForCausalLM(config).eval()
    if family == "qwen2":
        config = Qwen2Config(**rotary, num_key_value_heads=2, max_position_embeddings=256, **common)
        return Qwen2ForCausalLM(config).eval()
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def save_family(family: str, directory: str, seed: int = 0, chat: bool = False) -> str:
    """Write a tiny random model of the family and its tokenizer (chat=True: the instruct tokenizer) to `directory`
    (a --base_model); returns it."""
    tokenizer = family_tokenizer(family, chat)
    family_model(family, tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


CHAT_TEMPLATES = {
    # family: (control tokens added as special tokens, chat template), shaped like the family's instruct models'
    "llama": (
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    ),
    "qwen2": (
        ("<|im_start|>", "<|im_end|>"),
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    ),
}
"""chat templates of Llama 3 (its BOS written by the template too) and Qwen2 (ChatML) instruct models, simplified"""


def with_chat_template(tokenizer: PreTrainedTokenizerFast, family: str) -> PreTrainedTokenizerFast:
    """`tokenizer` given its family's chat template and control tokens (added as special tokens, so the vocabulary
    grows: build the model after this); returns it."""
    control, template = CHAT_TEMPLATES[family]
    tokenizer.add_special_tokens({"additional_special_tokens": list(control)})
    tokenizer.chat_template = template
    return tokenizer
