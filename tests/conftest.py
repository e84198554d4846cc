"""Shared offline fixtures: the real GPT-2 tokenizer (built from local files) and tiny random GPT-2 models."""

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
