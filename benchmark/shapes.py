"""The GPT-2 shapes the benchmarks build as random models (nothing is downloaded): names, sizes and their config."""

from transformers import GPT2Config

SHAPES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32),  # tests/conftest.py's tiny_gpt2_config
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),  # OAI's policy and reward trunk
    "gpt2-355m": dict(n_layer=24, n_head=16, n_embd=1024),  # gpt2-medium
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280),  # gpt2-large
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600),  # gpt2-xl
}


def gpt2_config(shape: str) -> GPT2Config:
    """The GPT2Config of a named shape over GPT-2's 50257-token vocabulary and 1024 positions, dropout off (spec G7)."""
    dropout_off = dict(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0)
    return GPT2Config(vocab_size=50257, n_positions=1024, **dropout_off, **SHAPES[shape])
