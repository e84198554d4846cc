"""The model shapes the benchmarks build as random models (nothing is downloaded): names, sizes and their config.

GPT-2's shapes (`SHAPES`, `gpt2_config`) are OAI's family; Pythia's (`PYTHIA_SHAPES`, GPT-NeoX) are those of the
successor recipe (docs/nplus.md). `model_config` gives the config of either.
"""

from transformers import GPT2Config, GPTNeoXConfig, PretrainedConfig

SHAPES = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32),  # tests/conftest.py's tiny_gpt2_config
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),  # OAI's policy and reward trunk
    "gpt2-355m": dict(n_layer=24, n_head=16, n_embd=1024),  # gpt2-medium
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280),  # gpt2-large
    "gpt2-1.5b": dict(n_layer=48, n_head=25, n_embd=1600),  # gpt2-xl
}

PYTHIA_SHAPES = {
    # the published EleutherAI/pythia-* configs: 1,011,781,632, 2,775,208,960 and 6,857,302,016 parameters, the
    # untied embed_out included
    "pythia-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
    "pythia-2.8b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240),
    "pythia-6.9b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384, vocab_size=50432
    ),
}


def gpt2_config(shape: str) -> GPT2Config:
    """The GPT2Config of a named shape over GPT-2's 50257-token vocabulary and 1024 positions, dropout off (spec G7)."""
    dropout_off = dict(attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, summary_first_dropout=0.0)
    return GPT2Config(vocab_size=50257, n_positions=1024, **dropout_off, **SHAPES[shape])


def pythia_config(shape: str) -> GPTNeoXConfig:
    """The GPTNeoXConfig of a named Pythia shape: Pythia's 50304-token vocabulary (50432 at 6.9B), 2048 positions,
    rotary embeddings on a quarter of each head, parallel attention and MLP, an untied embed_out, dropout off."""
    sizes = {"vocab_size": 50304, **PYTHIA_SHAPES[shape]}
    return GPTNeoXConfig(
        max_position_embeddings=2048,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **sizes,
    )


def model_config(shape: str) -> PretrainedConfig:
    """The config of a GPT-2 or Pythia shape; ValueError naming the shapes for any other name."""
    if shape in SHAPES:
        return gpt2_config(shape)
    if shape in PYTHIA_SHAPES:
        return pythia_config(shape)
    raise ValueError(f"unknown shape '{shape}'; the shapes are {', '.join([*SHAPES, *PYTHIA_SHAPES])}.")
