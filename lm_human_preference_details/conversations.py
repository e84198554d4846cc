"""Conversational rows, as TRL's dataset formats hold them: a value that is a list of {"role", "content"} messages
instead of a text. train_sft.py's pairs (nplus/sft_data.py) and train_reward.py's preference pairs (text_prefs.py) read
them here, rendered as the policy's queries are (prompts.py): the prompt through the tokenizer's chat template with its
generation prompt, the completion (or response) as the rest of the whole conversation's rendering.

A preference row without `prompt` (TRL's implicit prompt) holds the prompt in both `chosen` and `rejected`: the shared
prefix of the two texts, or every message but the last of the two conversations, which must then agree.
"""

import inspect
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details.tokenizer import added_bos_id

MESSAGE_KEYS = ("role", "content")


def is_conversation(value: Any) -> bool:
    """Whether a row's value is a conversation (a list, to be checked by `check_messages`) rather than a text."""
    return isinstance(value, list)


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """The messages of a conversational value; ValueError in one line naming `where` for an empty list or a message
    that is not a {"role", "content"} object of texts (ShareGPT's {"from", "value"} among them)."""
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"{where} is an empty conversation; expected a non-empty list of {{'role', 'content'}} messages."
        )
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not set(MESSAGE_KEYS) <= set(message):
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise ValueError(
                f"{where}: message {i} has keys {keys}, not 'role' and 'content'; write each message as "
                '{"role": ..., "content": ...}.'
            )
        if not all(isinstance(message[key], str) for key in MESSAGE_KEYS):
            raise ValueError(f"{where}: message {i} has a 'role' or 'content' that is not a text.")
    return [{key: m[key] for key in MESSAGE_KEYS} for m in value]


def check_chat_template(tokenizer: PreTrainedTokenizerBase, source: str, base_flag: str = "--base_model") -> None:
    """ValueError in one line when conversational rows of `source` meet a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{source} holds conversations (lists of role/content messages), but the tokenizer of {base_flag} has no "
            f"chat template to render them; pass a {base_flag} whose tokenizer has one, or rows of texts."
        )


def check_plain_message_text(tokenizer: PreTrainedTokenizerBase, source: str) -> None:
    """ValueError in one line when the installed transformers cannot encode a message's text as plain characters
    (apply_chat_template's sanitize_control_tokens), which `render_tokens` needs."""
    if "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters:
        raise ValueError(
            f"{source} holds conversations, but this transformers ({transformers.__version__}) cannot encode a "
            "message's text as plain characters (apply_chat_template's sanitize_control_tokens); upgrade transformers "
            "to 5.21 or later."
        )


def implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a preference row without a prompt: texts split where they first differ (at the
    start of that word), conversations into every message but the last (which must agree) and that last message.
    ValueError in one line when they share no prompt."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        shorter = min(len(chosen), len(rejected))
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), shorter)
        # the responses start with the whitespace in front of the word where the texts part
        cut = next((i for i in range(min(shared, shorter - 1), 0, -1) if chosen[i].isspace()), 0)
        if cut == 0 or cut in (len(chosen), len(rejected)):
            raise ValueError(
                f"{where}: 'chosen' and 'rejected' share no prompt in front of two different responses; a row "
                "without 'prompt' starts both texts with the same prompt."
            )
        return chosen[:cut], chosen[cut:], rejected[cut:]
    if not (is_conversation(chosen) and is_conversation(rejected)):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be texts or both be lists of messages.")
    chosen, rejected = check_messages(chosen, f"{where} 'chosen'"), check_messages(rejected, f"{where} 'rejected'")
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' differ before their last message; a row without 'prompt' holds the "
            "same prompt messages in both, each followed by one answer."
        )
    return chosen[:-1], chosen[-1:], rejected[-1:]


def render_texts(
    prompt: list[dict[str, str]], completion: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, where: str
) -> tuple[str, str]:
    """The prompt's rendering with the generation prompt and the completion's (the rest of the whole conversation's
    rendering), as texts holding the template's control tokens; ValueError when the template renders the conversation
    without that prompt in front."""
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
    if not whole.startswith(prompt_text):
        raise ValueError(
            f"{where}: the chat template renders the conversation without its prompt part (with the generation "
            "prompt) in front, so the completion cannot be told apart; use rows of texts instead."
        )
    return prompt_text, whole[len(prompt_text) :]


def render_tokens(
    prompt: list[dict[str, str]], completion: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, where: str
) -> tuple[list[int], list[int]]:
    """The prompt's tokens as the policy's queries are encoded (prompts.PromptQueries: with the generation prompt,
    the messages' text as plain characters, without a BOS the template writes, which the project puts in front of
    every context) and the completion's: the rest of the whole conversation's tokens, up to an EOS that ends it (the
    template's turn end, e.g. ChatML's `<|im_end|>` before its newline). ValueError as `render_texts`."""
    kwargs = dict(tokenize=True, return_dict=False, sanitize_control_tokens=True)
    prompt_tokens = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **kwargs)
    whole = tokenizer.apply_chat_template(prompt + completion, **kwargs)
    if whole[: len(prompt_tokens)] != prompt_tokens:
        raise ValueError(
            f"{where}: the chat template renders the conversation without its prompt part (with the generation "
            "prompt) in front, so the response cannot be told apart; use rows of texts instead."
        )
    response = whole[len(prompt_tokens) :]
    bos = added_bos_id(tokenizer)
    if bos is not None and prompt_tokens[:1] == [bos]:
        prompt_tokens = prompt_tokens[1:]
    return prompt_tokens, cut_after_eos(response, tokenizer)


def cut_after_eos(tokens: list[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """`tokens` without the whitespace the chat template writes after a final EOS (its turn end), so a rendered answer
    ends at EOS as the policy's responses do (an EOS appended after it would be a second one)."""
    eos = tokenizer.eos_token_id
    if eos is None or eos not in tokens:
        return tokens
    last = len(tokens) - 1 - tokens[::-1].index(eos)
    after = tokens[last + 1 :]
    return tokens[: last + 1] if not tokenizer.decode(after).strip() else tokens


def end_text_at_eos(completion: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """A rendered completion text without the whitespace after a final EOS text (`cut_after_eos` for texts)."""
    eos = tokenizer.eos_token
    stripped = completion.rstrip()
    return stripped if eos and stripped.endswith(eos) else completion
