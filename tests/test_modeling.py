import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2Model

from lm_human_preference_details import hub
from lm_human_preference_details.kernels import categorical_uniforms, sample_categorical
from lm_human_preference_details.modeling import (
    REWARD_HEAD_FILE,
    PolicyWithValueHead,
    RewardModel,
    cache_keyword,
    load_causal_lm,
    load_reward_model,
    pad_invisible_hidden,
    position_ids_from_mask,
    reduce_training_memory,
    reward_head_std,
    sample,
)
from lm_human_preference_details.tokenizer import load_tokenizer
from tests import archs
from tests.conftest import tiny_gpt2

PAD = 50257
EOS = 50256
ROUNDING = 4e-6
"""float32 rounding of the tiny models' logits, values and rewards; pads made visible change them by > 1e-3"""


def _family_lm(family: str, tmp_path) -> tuple:
    """A tiny random causal LM of the family, its PAD id and eight real token ids: GPT-2 over the real vocabulary
    (PAD 50257), the other families over their stand-in tokenizers (tests/archs.py) with the PAD that
    `load_tokenizer` adds (outside the embedding), as the scripts get them."""
    if family == "gpt2":
        return tiny_gpt2(), PAD, [23073, 8, 11, 339, 561, 7091, 1807, 546]
    tokenizer = load_tokenizer(archs.save_family(family, str(tmp_path)))
    lm = archs.family_model(family, archs.family_tokenizer(family))
    assert tokenizer.pad_token_id >= lm.config.vocab_size
    ids = tokenizer("the old man saw the cat by the river", add_special_tokens=False)["input_ids"]
    return lm, tokenizer.pad_token_id, ids[:8]


def _random_value_head(policy: PolicyWithValueHead) -> PolicyWithValueHead:
    """Give the value head non-zero weights so value comparisons are meaningful."""
    torch.manual_seed(1)
    with torch.no_grad():
        policy.value_head.weight.normal_()
        policy.value_head.bias.fill_(0.3)
    return policy


def _bias_towards(lm, token: int, scale: float = 1000.0):
    """Make `token` dominate every next-token distribution via the final LayerNorm bias (tied LM head)."""
    with torch.no_grad():
        wte = lm.transformer.wte.weight
        wte[token] *= 5
        lm.transformer.ln_f.bias.copy_(scale * wte[token])
    return lm


def test_position_ids_from_mask_oai_exclusive_cumsum():
    # TV2: OAI query [23073, P, P] + 3 response tokens; and the left-padded layout
    mask = torch.tensor([[1, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert position_ids_from_mask(mask).tolist() == [[0, 1, 1, 1, 2, 3], [0, 0, 0, 1, 2, 3]]


def test_pad_invisible_hidden_real_positions_match_unpadded(tiny_lm):
    # TV3 (a): [q, P, P, r...] at real positions == [q, r...] without pads
    padded = torch.tensor([[23073, PAD, PAD, 11, 339, 561]])
    plain = torch.tensor([[23073, 11, 339, 561]])
    with torch.no_grad():
        hidden_padded = pad_invisible_hidden(tiny_lm, padded, PAD)
        hidden_plain = pad_invisible_hidden(tiny_lm, plain, PAD)
    torch.testing.assert_close(hidden_padded[:, [0, 3, 4, 5]], hidden_plain, atol=1e-5, rtol=0)
    logits_padded = tiny_lm.get_output_embeddings()(hidden_padded)
    logits_plain = tiny_lm.get_output_embeddings()(hidden_plain)
    torch.testing.assert_close(logits_padded[:, [0, 3, 4, 5]], logits_plain, atol=1e-5, rtol=0)


def test_pad_invisible_hidden_pad_rows_copy_previous_real(tiny_lm):
    # TV3 (b): every PAD row equals the most recent real row (incl. trailing pads); batch rows differ in padding
    tokens = torch.tensor([[23073, PAD, PAD, 11, 339, PAD], [7091, 1807, 546, 340, PAD, PAD]])
    with torch.no_grad():
        hidden = pad_invisible_hidden(tiny_lm, tokens, PAD)
    assert torch.equal(hidden[0, 1], hidden[0, 0]) and torch.equal(hidden[0, 2], hidden[0, 0])
    assert torch.equal(hidden[0, 5], hidden[0, 4])
    assert torch.equal(hidden[1, 4], hidden[1, 3]) and torch.equal(hidden[1, 5], hidden[1, 3])
    assert not torch.allclose(hidden[0, 3], hidden[0, 0])
    # the positions from `start` on, as the policy's forward (context_length - 1) and the reward model (-1) ask them
    with torch.no_grad():
        torch.testing.assert_close(pad_invisible_hidden(tiny_lm, tokens, PAD, 2), hidden[:, 2:], atol=1e-6, rtol=0)
        torch.testing.assert_close(pad_invisible_hidden(tiny_lm, tokens, PAD, -1), hidden[:, -1:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_policy_forward_internal_pads_same_response_logits(family, tmp_path):
    # TV3 (c): a context with pads inside gives the same response logits and values as the unpadded context, on
    # every supported architecture (rotary positions included: positions skip the pads)
    lm, pad, ids = _family_lm(family, tmp_path)
    policy = _random_value_head(PolicyWithValueHead(lm))
    context, response = ids[:2], ids[2:5]
    with torch.no_grad():
        logits_pad, values_pad = policy(torch.tensor([context + [pad, pad] + response]), 4, pad, 0.7)
        logits_plain, values_plain = policy(torch.tensor([context + response]), 2, pad, 0.7)
    assert logits_pad.shape == (1, 3, lm.config.vocab_size)
    torch.testing.assert_close(logits_pad, logits_plain, atol=ROUNDING, rtol=0)
    torch.testing.assert_close(values_pad, values_plain, atol=ROUNDING, rtol=0)


def test_pad_invisible_hidden_rejects_leading_pad(tiny_lm):
    tokens = torch.tensor([[23073, 11, PAD], [PAD, 11, 339]])
    with pytest.raises(ValueError, match=r"rows \[1\] start with the PAD"):
        pad_invisible_hidden(tiny_lm, tokens, PAD)


def test_load_causal_lm_disables_dropout(tmp_path):
    tiny_gpt2(attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1, summary_first_dropout=0.1).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attn_pdrop"] == 0.1
    lm = load_causal_lm(str(tmp_path))
    config = lm.config.to_dict()
    dropout_keys = [k for k in config if k.endswith(("dropout", "pdrop"))]
    assert len(dropout_keys) >= 3 and all(config[k] == 0 for k in dropout_keys)
    assert all(not module.training for module in lm.modules())
    assert all(m.p == 0 for m in lm.modules() if isinstance(m, torch.nn.Dropout))
    assert lm.dtype == torch.float32
    tokens = torch.tensor([[23073, 11, 339, 561]])
    lm.train()  # even in train mode the forward is deterministic: dropout is off in the config
    with torch.no_grad():
        assert torch.equal(lm(tokens).logits, lm(tokens).logits)


def test_load_causal_lm_fused_gelu_matches_gelu_new(tmp_path):
    reference = tiny_gpt2()
    assert reference.config.activation_function == "gelu_new"
    reference.save_pretrained(tmp_path)
    lm = load_causal_lm(str(tmp_path))
    assert lm.config.activation_function == "gelu_pytorch_tanh"
    tokens = torch.tensor([[23073, 11, 339, 561], [7091, 1807, 546, 340]])
    with torch.no_grad():
        torch.testing.assert_close(lm(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-5)


def test_load_causal_lm_missing_local_dir_raises(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="--base_model") as info:
        load_causal_lm(missing)
    assert missing in str(info.value)


def test_load_causal_lm_offline_hub_name_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(hub.HubUnavailableError, match="--base_model"):
        load_causal_lm("gpt2-nonexistent-xyz")
    assert time.monotonic() - start < 5


def test_policy_value_head_zero_at_init(tiny_lm):
    # TV14: initial values are exactly 0
    policy = PolicyWithValueHead(tiny_lm)
    assert torch.count_nonzero(policy.value_head.weight) == 0 and policy.value_head.bias.item() == 0
    with torch.no_grad():
        _, values = policy(torch.tensor([[23073, PAD, 11, 339, 561]]), 2, PAD, 0.7)
    assert values.shape == (1, 3) and torch.equal(values, torch.zeros(1, 3))


def test_policy_forward_rejects_bad_context_length(tiny_lm):
    with pytest.raises(ValueError, match="context_length"):
        PolicyWithValueHead(tiny_lm)(torch.tensor([[23073, 11]]), 2, PAD, 0.7)


def test_sample_shapes_fixed_length(tiny_lm):
    contexts = torch.tensor([[23073, 11, PAD], [7091, 1807, 546], [13, PAD, PAD]])
    responses, logprobs, values = sample(PolicyWithValueHead(tiny_lm), contexts, 5, 0.7, PAD)
    assert responses.shape == logprobs.shape == values.shape == (3, 5)
    assert responses.dtype == torch.long and logprobs.dtype == values.dtype == torch.float32
    assert bool((logprobs <= 0).all())


def test_sample_eos_does_not_stop(tiny_lm):
    policy = PolicyWithValueHead(_bias_towards(tiny_lm, EOS))
    contexts = torch.tensor([[23073, 11, PAD, PAD], [7091, 1807, 546, 340]])
    responses, _, _ = sample(policy, contexts, 8, 1.0, PAD, torch.Generator().manual_seed(0))
    assert responses.shape == (2, 8)
    assert (responses == EOS).float().mean() > 0.9


def test_sample_never_samples_pad_inside_vocab():
    lm = _bias_towards(tiny_gpt2(vocab_size=50258), PAD)
    policy = PolicyWithValueHead(lm)
    contexts = torch.tensor([[23073, 11, PAD], [7091, 1807, 546]])
    with torch.no_grad():
        raw_logits = lm(torch.tensor([[23073, 11]])).logits
        logits, _ = policy(torch.tensor([[23073, 11, 339, 561]]), 2, PAD, 1.0)
    assert bool((raw_logits.argmax(-1) == PAD).all())  # without the mask PAD would always win
    assert bool((logits[..., PAD] == torch.finfo(torch.float32).min).all())
    responses, logprobs, _ = sample(policy, contexts, 6, 1.0, PAD, torch.Generator().manual_seed(0))
    assert not bool((responses == PAD).any())
    assert bool(torch.isfinite(logprobs).all())


def test_sample_categorical_frequencies_match_softmax():
    # the first and last tokens have probability 0: an inverse-CDF sampler must never return them
    logits = torch.tensor([torch.finfo(torch.float32).min, 0.5, -1.0, 2.0, 0.0, torch.finfo(torch.float32).min])
    rows = 40000
    uniforms = categorical_uniforms(rows, torch.Generator().manual_seed(0), logits.device)
    tokens, logprobs = sample_categorical(logits.expand(rows, -1), uniforms)
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[0] == 0 and counts[5] == 0
    sigma = (rows * probs * (1 - probs)).sqrt().double()
    assert bool(((counts - rows * probs.double()).abs() <= 5 * sigma + 1e-9).all()), counts
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[tokens], rtol=0, atol=1e-6)


@pytest.mark.floor
@pytest.mark.parametrize("family", archs.FAMILIES)
def test_sample_matches_full_forward(family, tmp_path):
    # the KV-cached sampler's log-probs and values equal a full forward's, pads inside the contexts, on every
    # supported architecture
    lm, pad, (a, b, c, d, e, *_) = _family_lm(family, tmp_path)
    policy = _random_value_head(PolicyWithValueHead(lm))
    contexts = torch.tensor([[a, c, pad, pad, e], [b, c, d, a, e], [e, pad, pad, pad, pad]])
    responses, logprobs, values = sample(policy, contexts, 6, 0.7, pad, torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, values_forward = policy(torch.cat([contexts, responses], 1), contexts.shape[1], pad, 0.7)
    logprobs_forward = logits.gather(-1, responses[..., None])[..., 0] - torch.logsumexp(logits, -1)
    torch.testing.assert_close(logprobs, logprobs_forward, atol=ROUNDING, rtol=0)
    torch.testing.assert_close(values, values_forward, atol=ROUNDING, rtol=0)
    assert not torch.allclose(values[:, 0], values[:, 1])


def test_sample_seeded_generator_deterministic(tiny_lm):
    policy = PolicyWithValueHead(tiny_lm)
    contexts = torch.tensor([[23073, 11, PAD], [7091, 1807, 546]])
    first = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(7))
    second = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(7))
    other = sample(policy, contexts, 6, 0.7, PAD, torch.Generator().manual_seed(8))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], other[0])


def test_sample_temperature_applied(tiny_lm):
    policy = PolicyWithValueHead(tiny_lm)
    contexts = torch.tensor([[23073, 11, PAD], [7091, 1807, 546]])
    responses, logprobs, _ = sample(policy, contexts, 4, 0.5, PAD, torch.Generator().manual_seed(0))
    query_responses = torch.cat([contexts, responses], 1)
    with torch.no_grad():
        logits_half, _ = policy(query_responses, 3, PAD, 0.5)
        logits_one, _ = policy(query_responses, 3, PAD, 1.0)
    torch.testing.assert_close(logits_half, 2 * logits_one, atol=1e-5, rtol=1e-6)

    def logprobs_of(logits):
        return logits.gather(-1, responses[..., None])[..., 0] - torch.logsumexp(logits, -1)

    torch.testing.assert_close(logprobs, logprobs_of(logits_half), atol=1e-5, rtol=0)
    assert (logprobs - logprobs_of(logits_one)).abs().max() > 1e-3


def test_reward_head_init_matches_oai():
    # TV14: reward head std 1/sqrt(769) for GPT-2 124M's width; bias 0; gain 1, bias 0, both trainable
    assert reward_head_std(768) == pytest.approx(0.0360609, abs=1e-7)
    torch.manual_seed(0)
    trunk = GPT2Model(GPT2Config(n_layer=1, n_head=12, n_embd=768, n_positions=8, vocab_size=16))
    reward_model = RewardModel(trunk)
    assert reward_model.head.weight.shape == (1, 768)
    assert reward_model.head.weight.std().item() == pytest.approx(0.0360609, rel=0.05)
    assert reward_model.head.bias.item() == 0
    assert reward_model.gain.item() == 1 and reward_model.bias.item() == 0
    assert reward_model.gain.requires_grad and reward_model.bias.requires_grad
    names = {name for name, _ in reward_model.named_parameters()}
    assert {"gain", "bias", "head.weight", "head.bias"} <= names


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_reward_model_reads_last_real_token(family, tmp_path):
    # a padded and an unpadded copy of query ⊕ response get the same reward, on every supported architecture
    lm, pad, (a, b, c, d, *_) = _family_lm(family, tmp_path)
    reward_model = RewardModel(lm.base_model)
    with torch.no_grad():
        padded = reward_model(torch.tensor([[a, pad, b, c, d, pad, pad]]), pad)
        plain = reward_model(torch.tensor([[a, b, c, d]]), pad)
        shorter = reward_model(torch.tensor([[a, b, c]]), pad)
    assert padded.shape == (1,)
    torch.testing.assert_close(padded, plain, atol=ROUNDING, rtol=0)
    assert not torch.allclose(plain, shorter)


def test_reward_model_batched_forward_matches_rows(tiny_lm):
    reward_model = RewardModel(tiny_lm.transformer)
    with torch.no_grad():
        reward_model.gain.fill_(2.0)
        reward_model.bias.fill_(-0.5)
        tokens = torch.tensor([[23073, 11, 339, PAD], [7091, 1807, 546, 340], [13, PAD, 198, PAD]])
        batched = reward_model(tokens, PAD)
        rows = torch.cat([reward_model(row[None], PAD) for row in tokens])
        raw = reward_model.head(pad_invisible_hidden(tiny_lm.transformer, tokens, PAD)[:, -1]).squeeze(-1)
    torch.testing.assert_close(batched, rows, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched, 2.0 * raw - 0.5, atol=1e-6, rtol=0)


def test_reward_model_save_load_roundtrip(tiny_lm, tmp_path):
    reward_model = RewardModel(tiny_lm.transformer)
    with torch.no_grad():
        reward_model.gain.fill_(1.7)
        reward_model.bias.fill_(0.25)
    reward_model.save(str(tmp_path), {"pad_token_id": PAD, "base_model": "tiny"})
    loaded, metadata = load_reward_model(str(tmp_path))
    assert metadata["pad_token_id"] == PAD and metadata["base_model"] == "tiny"
    assert metadata["gain"] == pytest.approx(1.7) and metadata["hidden_size"] == 32 and metadata["vocab_size"] == 50257
    assert all(not module.training for module in loaded.modules())
    tokens = torch.tensor([[23073, 11, 339, PAD], [7091, 1807, 546, 340]])
    with torch.no_grad():
        # gain and bias are folded into the saved weights: equal up to float rounding
        torch.testing.assert_close(loaded(tokens, PAD), reward_model(tokens, PAD), atol=1e-5, rtol=0)


def test_load_reward_model_missing_dir_raises(tmp_path):
    missing = str(tmp_path / "reward")
    with pytest.raises(FileNotFoundError, match="--rewards.trained_model") as info:
        load_reward_model(missing)
    assert missing in str(info.value)


def test_reward_model_save_needs_the_pad_id(tiny_lm, tmp_path):
    with pytest.raises(ValueError, match="pad_token_id"):
        RewardModel(tiny_lm.transformer).save(str(tmp_path), {})


def test_load_reward_model_head_size_mismatch_raises(tiny_lm, tmp_path):
    reward_model = RewardModel(tiny_lm.transformer)
    with torch.no_grad():
        reward_model.head.weight.zero_()  # a zero head cannot be folded into a classifier: saved as trunk + head
    reward_model.save(str(tmp_path), {"pad_token_id": PAD})
    path = os.path.join(tmp_path, REWARD_HEAD_FILE)
    tensors = load_file(path)
    tensors["head.weight"] = torch.zeros(1, 48)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"48.*32"):
        load_reward_model(str(tmp_path))


def test_reward_model_from_base_dropout_off(tiny_model_dir):
    reward_model = RewardModel.from_base(tiny_model_dir)
    assert isinstance(reward_model.trunk, GPT2Model)
    assert reward_model.trunk.config.attn_pdrop == 0 and reward_model.trunk.config.resid_pdrop == 0
    assert all(not module.training for module in reward_model.modules())


def test_policy_save_loads_with_auto_model(tiny_lm, tmp_path):
    policy = _random_value_head(PolicyWithValueHead(tiny_lm))
    policy.save(str(tmp_path))
    assert os.path.isfile(tmp_path / "value_head.safetensors")
    tokens = torch.tensor([[23073, 11, 339, 561]])
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    loaded = PolicyWithValueHead.load(str(tmp_path))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, tiny_lm(tokens).logits)
        assert torch.equal(loaded(tokens, 2, PAD, 0.7)[0], policy(tokens, 2, PAD, 0.7)[0])
    assert torch.equal(loaded.value_head.weight, policy.value_head.weight)
    assert torch.equal(loaded.value_head.bias, policy.value_head.bias)


# ---------------------------------------------------------------- memory savers for large models


def _count_attention_calls(model) -> dict:
    """Count the forward calls of every attention module of `model` (a checkpointed block runs its forward twice)."""
    calls = {"n": 0}
    for module in model.modules():
        if type(module).__name__ == "GPT2Attention":
            module.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    return calls


def test_gradient_checkpointing_gives_the_same_gradients_and_sampling(tiny_lm, one_thread):
    tokens = torch.randint(0, 50257, (4, 20), generator=torch.Generator().manual_seed(0))
    tokens[1, 14:] = PAD  # PADs inside the sequence: the OAI padding semantics go through the checkpointed blocks
    plain = _random_value_head(PolicyWithValueHead(tiny_lm))
    checkpointed = _random_value_head(PolicyWithValueHead(tiny_gpt2()))
    reduce_training_memory(checkpointed, gradient_checkpointing=True, bf16=False)
    calls = _count_attention_calls(checkpointed)
    grads = []
    for policy in (plain, checkpointed):
        logits, values = policy(tokens, 12, PAD, 0.7)
        (logits.log_softmax(-1).mean() + values.square().mean()).backward()
        grads.append({name: p.grad for name, p in policy.named_parameters()})
    assert calls["n"] == 2 * 2  # 2 blocks, each recomputed in the backward
    for name, grad in grads[0].items():  # measured: bit-identical on CPU; tolerance 1e-6
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=0, msg=name)
    assert not any(m.training for m in checkpointed.modules())  # eval mode kept (dropout off, spec G7)
    # the KV-cached sampler and no-grad forwards are untouched: no recompute, the same samples
    calls["n"] = 0
    samples = [sample(p, tokens[:, :12], 6, 0.7, PAD, torch.Generator().manual_seed(1)) for p in (plain, checkpointed)]
    with torch.no_grad():
        checkpointed(tokens, 12, PAD, 0.7)
    assert calls["n"] == 6 * 2 + 2
    assert all(torch.equal(a, b) for a, b in zip(*samples))
    # the reward model's trunk (an AutoModel without LM head) the same way
    rewards_grads = []
    for gradient_checkpointing in (False, True):
        torch.manual_seed(0)
        reward_model = RewardModel(tiny_gpt2().transformer)
        reduce_training_memory(reward_model, gradient_checkpointing, bf16=False)
        reward_model(tokens, PAD).square().sum().backward()
        rewards_grads.append({name: p.grad for name, p in reward_model.named_parameters()})
    for name, grad in rewards_grads[0].items():
        torch.testing.assert_close(rewards_grads[1][name], grad, atol=1e-6, rtol=0, msg=name)


def test_bf16_autocast_loss_curve_tracks_float32(one_thread):
    # best-of-4 labels with a planted preference (the best sample holds token 1000), 12 Adam steps of the reward loss
    generator = torch.Generator().manual_seed(0)
    queries = torch.randint(0, 5000, (64, 8), generator=generator)
    samples = torch.randint(0, 5000, (64, 4, 6), generator=generator)
    best = torch.randint(0, 4, (64,), generator=generator)
    samples[torch.arange(64), best, 2] = 1000
    curves = []
    for bf16 in (False, True):
        torch.manual_seed(0)
        reward_model = RewardModel(tiny_gpt2().transformer)
        reduce_training_memory(reward_model, gradient_checkpointing=False, bf16=bf16)
        optimizer = torch.optim.Adam(reward_model.parameters(), lr=3e-3)
        curve = []
        for step in range(12):
            rows = slice(step % 4 * 16, step % 4 * 16 + 16)
            query_responses = torch.cat([queries[rows].repeat_interleave(4, 0), samples[rows].reshape(-1, 6)], 1)
            rewards = reward_model(query_responses, PAD).view(16, 4)
            assert rewards.dtype == torch.float32  # heads and rewards stay float32
            loss = torch.nn.functional.cross_entropy(rewards, best[rows])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        curves.append(curve)
        with torch.no_grad():  # scoring without gradients stays float32: exactly the plain forward
            assert torch.equal(
                reward_model(query_responses, PAD), RewardModel.forward(reward_model, query_responses, PAD)
            )
    fp32, bf16 = curves
    assert fp32[0] > 1.3 and fp32[-1] < 0.01  # the loss falls from ln 4 to ~0: a real curve to track
    # measured: at most 0.0024 apart (0.018 with other data, where the loss falls fastest); tolerance 0.03 per step
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.03, (fp32, bf16)
    assert fp32 != bf16  # bf16 did run


def test_cache_keyword_is_the_name_the_forward_takes():
    # transformers 5.24 renamed the forward's `past_key_values` to `cache`; 5.17-5.23 drop an unknown `cache=` into
    # **kwargs, so the sampler passes the cache under the name the installed model's forward declares
    class Before(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    class After(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return input_ids

    assert cache_keyword(Before()) == "past_key_values"
    assert cache_keyword(After()) == "cache"
    assert cache_keyword(tiny_gpt2().transformer) == "cache"  # transformers 5.24, installed here
