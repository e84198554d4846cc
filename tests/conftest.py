"""Shared offline fixtures: the real GPT-2 tokenizer (built from local files) and tiny random GPT-2 models."""

import contextlib

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline

torch.set_num_threads(2)


def tiny_gpt2_config(**overrides) -> GPT2Config:
    """A 2-layer, 32-wide GPT-2 over the real 50257-token vocabulary, with dropout off."""
    kwargs = dict(n_layer=2, n_head=2, n_embd=32, n_positions=256, vocab_size=50257)
    kwargs.update(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A fresh tiny random GPT-2 language model in eval mode."""
    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config(**overrides)).eval()


@contextlib.contextmanager
def one_intra_op_thread():
    """torch on one intra-op thread: the tiny models' ops are far too small to gain from more (and two threads on a
    busy 2-core machine are many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One intra-op thread for one test."""
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a whole test module (`pytestmark = pytest.mark.usefixtures("single_thread")`)."""
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return gpt2_tokenizer_offline()


@pytest.fixture
def tiny_lm():
    return tiny_gpt2()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    tiny_gpt2().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def small_vocab_gpt2(tokens: list[int], seed: int = 0, strength: float = 10.0) -> GPT2LMHeadModel:
    """A tiny GPT-2 that samples almost only `tokens` (nearly uniformly), so planted preferences are discoverable."""
    model = tiny_gpt2(seed)
    with torch.no_grad():
        # hidden dim 0 is a constant `strength` after ln_f; the tied embedding's dim 0 is +1 for `tokens`, -1 otherwise
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = strength
        model.transformer.wte.weight[:, 0] = -1.0
        model.transformer.wte.weight[tokens, 0] = 1.0
    return model


@pytest.fixture(scope="session")
def small_vocab_words(tokenizer):
    words = [" the", " a", " and", " of", " to", " in", " was", " he", " she", " it", " on", " with", " happy", " sad"]
    return {w.strip(): tokenizer.encode(w)[0] for w in words}


@pytest.fixture(scope="session")
def small_vocab_model_dir(tmp_path_factory, tokenizer, small_vocab_words):
    path = tmp_path_factory.mktemp("small-vocab-gpt2")
    small_vocab_gpt2(list(small_vocab_words.values())).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
