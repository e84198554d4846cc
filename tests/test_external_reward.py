"""A reward model with its own tokenizer (--rewards.trained_model sequence_classifier:NAME_OR_DIR, nplus N28): what
it scores (decoded prompt + response in its own tokenizer or chat template), where it reads the score, its errors,
and a policy run against it."""

import json

import huggingface_hub
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2ForSequenceClassification,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

import evaluate
import label_generation
import train_policy
from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.labelers import check_labeler_source, load_labeler
from lm_human_preference_details.modeling import RewardModel
from lm_human_preference_details.rewards import (
    LabelerReward,
    attach_conversations,
    check_reward_source,
    is_programmatic,
    load_reward,
    reward_input_path,
)
from lm_human_preference_details.tokenizer import tokenizer_fingerprint
from lm_human_preference_details.validation import labeler_path
from tests import archs
from tests.conftest import QUERY_TEXTS
from tests.planted import run_script

pytestmark = pytest.mark.usefixtures("single_thread")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""a ChatML chat template, as Qwen2's chat tokenizers have"""
QUERIES = QUERY_TEXTS[:2]
RESPONSES = [[" He smiled at the road.", " The letter was from his son"], [" Nobody answered.", " It was the stranger"]]
"""two responses to each query, as the policy's tokens decode (before any EOS)"""
CPU = torch.device("cpu")


def chatml(messages: list[dict]) -> str:
    """The ChatML text of `messages`, written out by hand (what CHATML renders without a generation prompt)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def rm_tokenizer(chat: bool, family: str = "qwen2") -> PreTrainedTokenizerFast:
    """A stand-in tokenizer of tests/archs.py (not GPT-2's) with ChatML's control tokens, and its template if `chat`;
    it asks for left padding, which the reward must not use."""
    tok = archs.family_tokenizer(family)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML if chat else None
    tok.padding_side = "left"
    return tok


def save_classifier(path, tok, arch: str = "qwen2", num_labels: int = 1, pad_token_id: int | None = -1) -> str:
    """A tiny random sequence classifier over `tok` with a scaled-up score head (scores of order 1), and `tok`, in
    `path`; `pad_token_id` -1: the tokenizer's PAD."""
    pad = tok.pad_token_id if pad_token_id == -1 else pad_token_id
    common = dict(vocab_size=len(tok), num_labels=num_labels, pad_token_id=pad)
    torch.manual_seed(0)
    if arch == "qwen2":
        config = Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, **common,
        )  # fmt: skip
        model = Qwen2ForSequenceClassification(config)
    else:  # GPT-2: learned absolute positions, so a row padded on the left scores differently
        config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=256, **common)
        config.attn_pdrop = config.embd_pdrop = config.resid_pdrop = config.summary_first_dropout = 0.0
        model = GPT2ForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.mul_(30.0)
    model.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def policy_batch(tokenizer, junk_after_eos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded raw queries (2, Lq) and responses (2, 2, 12) of the GPT-2 policy: each response's text, its EOS,
    then (`junk_after_eos`) tokens that the reward must never see, then PAD."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    rows = [tokenizer.encode(q) for q in QUERIES]
    width = max(map(len, rows))
    queries = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    junk = tokenizer.encode(" and then everything") if junk_after_eos else []
    responses = []
    for texts in RESPONSES:
        encoded = [(tokenizer.encode(text) + [eos] + junk)[:12] for text in texts]
        responses.append([row + [pad] * (12 - len(row)) for row in encoded])
    return queries, torch.tensor(responses)


def alone(model, ids: list[int]) -> float:
    """The plain transformers score of one unpadded row."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    """(arch, chat) -> a saved qwen2-like-tokenizer sequence classifier."""
    saved = {}

    def get(arch: str, chat: bool) -> str:
        if (arch, chat) not in saved:
            path = tmp_path_factory.mktemp(f"rm-{arch}-{'chat' if chat else 'plain'}")
            saved[arch, chat] = save_classifier(path, rm_tokenizer(chat), arch)
        return saved[arch, chat]

    return get


# ---------------------------------------------------------------- what it scores and where it reads the score


@pytest.mark.parametrize("chat", [True, False], ids=["chat-template", "plain-text"])
@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_scores_are_a_plain_transformers_call_on_prompt_and_response_text(classifiers, tokenizer, arch, chat):
    path = classifiers(arch, chat)
    reward = load_reward(f"sequence_classifier:{path}", tokenizer, tokenizer.pad_token_id, CPU)
    assert isinstance(reward, LabelerReward) and reward.metadata is None  # a programmatic reward: no RM checks
    queries, responses = policy_batch(tokenizer)
    scores = reward.labeler.scores(queries, responses)
    assert scores.dtype == torch.float32 and scores.shape == (2, 2)
    # the expected input, by hand: the texts before the EOS, in the classifier's own tokenizer and template
    model, tok = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    expected = torch.zeros(2, 2)
    for b, query in enumerate(QUERIES):
        for i, response in enumerate(RESPONSES[b]):
            if chat:
                text = chatml([{"role": "user", "content": query}, {"role": "assistant", "content": response}])
                ids = tok(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(query + response)["input_ids"]
            expected[b, i] = alone(model, ids)  # each row on its own: no padding anywhere
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert expected.std() > 0.1  # rows score differently, so a row read at another token is seen
    # the reward the policy maximizes is those scores, one response per query
    torch.testing.assert_close(reward(queries, responses[:, 1]), expected[:, 1], atol=1e-5, rtol=1e-5)


def test_rows_are_padded_with_the_id_the_classifier_skips_to_read_its_score(tmp_path, tokenizer):
    # a GPT-2-like tokenizer without PAD and a config without pad_token_id: both get EOS (transformers' convention)
    no_pad = save_classifier(tmp_path / "no-pad", rm_tokenizer(False, "gpt2"), "gpt2", pad_token_id=None)
    # a config whose pad_token_id differs from the tokenizer's PAD: the classifier skips the config's when it reads
    other = rm_tokenizer(False)
    other_pad = save_classifier(
        tmp_path / "other-pad", other, "gpt2", pad_token_id=other.convert_tokens_to_ids("<|im_end|>")
    )
    queries, responses = policy_batch(tokenizer)
    labelers = {}
    for path in (other_pad, no_pad):
        labeler = labelers[path] = load_labeler(f"sequence_classifier:{path}", tokenizer, tokenizer.pad_token_id, CPU)
        model, tok = (
            AutoModelForSequenceClassification.from_pretrained(path).eval(),
            AutoTokenizer.from_pretrained(path),
        )
        expected = torch.tensor(
            [[alone(model, tok(q + r)["input_ids"]) for r in rs] for q, rs in zip(QUERIES, RESPONSES)]
        )
        torch.testing.assert_close(labeler.scores(queries, responses), expected, atol=1e-5, rtol=1e-5)
    im_end, eos = other.convert_tokens_to_ids("<|im_end|>"), labelers[no_pad].classifier_tokenizer.eos_token_id
    assert labelers[other_pad].model.config.pad_token_id == labelers[other_pad].padding_id == im_end
    assert labelers[no_pad].model.config.pad_token_id == labelers[no_pad].padding_id == eos


def test_response_ends_at_its_first_eos_and_special_tokens_are_skipped(classifiers, tokenizer):
    labeler = load_labeler(f"sequence_classifier:{classifiers('gpt2', True)}", tokenizer, tokenizer.pad_token_id, CPU)
    _, responses = policy_batch(tokenizer)
    assert labeler.response_texts(responses) == [text for texts in RESPONSES for text in texts]
    _, plain = policy_batch(tokenizer, junk_after_eos=False)  # the same texts, PAD right after the EOS
    queries, _ = policy_batch(tokenizer)
    torch.testing.assert_close(labeler.scores(queries, responses), labeler.scores(queries, plain), atol=0, rtol=0)


def test_conversation_of_gives_the_chat_messages_of_a_query(classifiers, tokenizer):
    queries, responses = policy_batch(tokenizer)
    first = tokenizer.encode(QUERIES[0])
    seen = []

    def conversation_of(ids: list[int]) -> list[dict] | None:
        seen.append(ids)
        return (
            [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "A story?"}]
            if ids == first
            else None
        )

    chat = load_reward(
        f"sequence_classifier:{classifiers('gpt2', True)}", tokenizer, tokenizer.pad_token_id, CPU,
        conversation_of=conversation_of,
    )  # fmt: skip
    scores = chat.labeler.scores(queries, responses)
    assert seen == [tokenizer.encode(q) for q in QUERIES]  # the query's ids, without PAD
    model = chat.labeler.model
    tok = chat.labeler.classifier_tokenizer
    messages = [
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "A story?"}],
        [{"role": "user", "content": QUERIES[1]}],  # None: the decoded query
    ]
    expected = [
        [alone(model, tok(chatml([*m, {"role": "assistant", "content": r}]), add_special_tokens=False)["input_ids"])
         for r in rs]
        for m, rs in zip(messages, RESPONSES)
    ]  # fmt: skip
    torch.testing.assert_close(scores, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    # without a chat template the decoded query text is the prompt; attach_conversations reaches the labeler
    plain = load_reward(f"sequence_classifier:{classifiers('gpt2', False)}", tokenizer, tokenizer.pad_token_id, CPU)
    before = plain.labeler.scores(queries, responses)
    attach_conversations(conversation_of, plain, None)
    assert plain.labeler.conversation_of is conversation_of
    torch.testing.assert_close(plain.labeler.scores(queries, responses), before, atol=0, rtol=0)


def test_a_row_longer_than_the_classifier_takes_is_cut_from_the_left_of_its_prompt(tmp_path, tokenizer, capsys):
    tok = rm_tokenizer(False)
    tok.model_max_length = 24
    path = save_classifier(tmp_path / "short", tok, "gpt2")
    labeler = load_labeler(f"sequence_classifier:{path}", tokenizer, tokenizer.pad_token_id, CPU)
    assert labeler.max_length == 24
    queries, responses = policy_batch(tokenizer)
    scores = labeler.scores(queries, responses)
    model = labeler.model
    for b, query in enumerate(QUERIES):
        pieces = tok(query, add_special_tokens=False)["input_ids"]
        assert len(tok(query + RESPONSES[b][0])["input_ids"]) > 24  # the prompt must be cut
        for i, response in enumerate(RESPONSES[b]):
            # the longest end of the prompt (in the classifier's tokens) that fits with the whole response
            fitting = (tok(tok.decode(pieces[k:]) + response)["input_ids"] for k in range(len(pieces) + 1))
            ids = next(row for row in fitting if len(row) <= 24)
            assert ids[-len(tok(response)["input_ids"]) :] == tok(response)["input_ids"]
            assert scores[b, i].item() == pytest.approx(alone(model, ids), abs=1e-5)
    assert capsys.readouterr().err.count("the prompt is cut from its left") == 1
    labeler.scores(queries, responses)
    assert "cut" not in capsys.readouterr().err  # said once


# ---------------------------------------------------------------- a train_reward.py directory through it


def test_train_reward_directory_as_sequence_classifier_scores_as_reward_model(tmp_path, tiny_model_dir, tokenizer):
    model = RewardModel.from_base(tiny_model_dir)
    with torch.no_grad():
        model.gain.fill_(1.7)
        model.bias.fill_(-0.6)
        model.head.bias.fill_(0.3)
    pad = tokenizer.pad_token_id
    model.save(str(tmp_path), {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), "pad_token_id": pad})
    tokenizer.save_pretrained(str(tmp_path))
    project = load_reward(f"reward_model:{tmp_path}", tokenizer, pad, CPU)
    external = load_reward(f"sequence_classifier:{tmp_path}", tokenizer, pad, CPU)
    queries, with_eos = policy_batch(tokenizer, junk_after_eos=False)
    for b, query in enumerate(QUERIES):  # texts whose tokens re-encode the same way, joined or apart
        assert all(tokenizer.encode(query + r) == tokenizer.encode(query) + tokenizer.encode(r) for r in RESPONSES[b])
    without_eos = with_eos.masked_fill(with_eos == tokenizer.eos_token_id, pad)
    with torch.no_grad():
        same = project(queries, without_eos[:, 0])
        torch.testing.assert_close(external(queries, without_eos[:, 0]), same, atol=1e-5, rtol=1e-5)
        # the documented difference: the response's EOS is dropped, so the score is read at the token before it
        torch.testing.assert_close(external(queries, with_eos[:, 0]), same, atol=1e-5, rtol=1e-5)
        assert (project(queries, with_eos[:, 0]) - same).abs().max() > 1e-3


# ---------------------------------------------------------------- normalization and the flag's forms


def test_sequence_classifier_is_a_programmatic_reward_that_may_be_normalized(classifiers, tmp_path):
    spec = f"sequence_classifier:{classifiers('gpt2', False)}"
    assert is_programmatic(spec) and reward_input_path(spec) == classifiers("gpt2", False)
    assert labeler_path(spec) == classifiers("gpt2", False)
    check_reward_source(spec, 256)  # not normalized by train_reward.py: --rewards.normalize_samples applies
    check_labeler_source(spec, "--rewards.gold_model")
    assert reward_input_path("sequence_classifier:org/reward-model") == "org/reward-model"
    evaluate.check_reward_input("sequence_classifier:org/reward-model", {})  # a hub id: its loader names a missing one


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Offline mode with an empty hub cache, so hub models must fail fast."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


@pytest.mark.parametrize(
    ("case", "error", "message"),
    [
        (
            "two-outputs",
            ValueError,
            r"has 2 outputs \(LABEL_0, LABEL_1\), not one reward; pass {flag} classifier:.*#LABEL",
        ),
        ("causal-lm", ValueError, r"is a GPT2LMHeadModel, not a sequence classifier"),
        ("missing-dir", FileNotFoundError, r"directory '\./no/such/rm' does not exist"),
        ("offline-hub-id", HubUnavailableError, r"'someone/rm' is no directory here.*offline.*hf download someone/rm"),
        ("no-way-to-pad", ValueError, r"neither a PAD nor an EOS token and its config no pad_token_id"),
        ("pad-not-a-token", ValueError, r"its config's pad_token_id 9999 is not a token of its tokenizer"),
        ("label", ValueError, r"takes no #LABEL; pass {flag} classifier:.*#POSITIVE"),
        ("trunk-reward-model", ValueError, r"saved as trunk/ and head .*; pass {flag} reward_model:"),
        ("empty", ValueError, r"names no model"),
    ],
)
@pytest.mark.parametrize("flag", ["--rewards.trained_model", "--rewards.gold_model", "--labeler"])
def test_bad_sequence_classifier_is_one_line_naming_the_flag(
    case, error, message, flag, tmp_path, tiny_model_dir, tokenizer, offline_hub
):
    target = {"missing-dir": "./no/such/rm", "offline-hub-id": "someone/rm", "empty": ""}.get(case, str(tmp_path))
    if case == "two-outputs":
        save_classifier(tmp_path, rm_tokenizer(False), "gpt2", num_labels=2)
    elif case == "causal-lm":
        target = tiny_model_dir
    elif case == "no-way-to-pad":
        tok = PreTrainedTokenizerFast(tokenizer_object=archs.family_tokenizer("qwen2").backend_tokenizer)
        save_classifier(tmp_path, tok, "gpt2", pad_token_id=None)
    elif case == "pad-not-a-token":
        save_classifier(tmp_path, rm_tokenizer(False), "gpt2", pad_token_id=9999)
    elif case == "label":
        target = f"{save_classifier(tmp_path, rm_tokenizer(False), 'gpt2')}#POSITIVE"
    elif case == "trunk-reward-model":
        (tmp_path / "trunk").mkdir()
        (tmp_path / "reward_model.json").write_text(json.dumps({"checkpoint": "trunk"}))
    spec = f"sequence_classifier:{target}"
    pattern = message.format(flag=flag)
    if case not in ("no-way-to-pad", "pad-not-a-token"):  # the start-up check reads no tokenizer
        with pytest.raises(error, match=pattern) as caught:
            check_reward_source(spec, 0) if flag == "--rewards.trained_model" else check_labeler_source(spec, flag)
        assert "\n" not in str(caught.value) and flag in str(caught.value)
    with pytest.raises(error, match=pattern) as caught:
        if flag == "--rewards.trained_model":
            load_reward(spec, tokenizer, tokenizer.pad_token_id, CPU)
        else:
            load_labeler(spec, tokenizer, tokenizer.pad_token_id, CPU, flag=flag)
    assert "\n" not in str(caught.value) and flag in str(caught.value)


def test_a_bad_sequence_classifier_stops_the_scripts_before_anything_is_written(tmp_path, tiny_model_dir, query_file):
    multi = f"sequence_classifier:{save_classifier(tmp_path / 'multi', rm_tokenizer(False), 'gpt2', num_labels=2)}"
    output_dir = tmp_path / "policy"
    for flag in ("--rewards.trained_model", "--rewards.gold_model"):
        flags = ["--base_model", tiny_model_dir, "--task.query_dataset", query_file, "--output_dir", str(output_dir)]
        flags += ["--rewards.trained_model", "vader", flag, multi, "--dry_run"]  # a dry run loads no model
        with pytest.raises(ValueError, match=f"{flag} 'sequence_classifier:.*' has 2 outputs"):
            train_policy.main(train_policy.parse(flags))
        assert not output_dir.exists()
    output = tmp_path / "labels.json"
    flags = ["generate", "--base_model", tiny_model_dir, "--task.query_dataset", query_file, "--output", str(output)]
    with pytest.raises(ValueError, match="--labeler 'sequence_classifier:.*' has 2 outputs"):
        label_generation.main(label_generation.parse([*flags, "--labeler", multi]))
    assert not output.exists()


# ---------------------------------------------------------------- a policy trained against it


def test_train_policy_maximizes_a_sequence_classifier_with_its_own_chat_template(
    classifiers, tmp_path, tiny_model_dir, query_file
):
    spec = f"sequence_classifier:{classifiers('qwen2', True)}"
    output_dir = tmp_path / "policy"
    result = run_script(
        "train_policy.py",
        *("--base_model", tiny_model_dir, "--rewards.trained_model", spec, "--rewards.gold_model", spec),
        *("--rewards.normalize_samples", "16", "--task.query_dataset", query_file, "--task.query_length", "16"),
        *("--task.response_length", "8", "--task.start_text", "None", "--task.end_text", "None"),
        *("--task.truncate_token", "None", "--task.truncate_after", "0", "--ppo.total_episodes", "16"),
        *("--ppo.batch_size", "8", "--ppo.noptepochs", "1", "--log_interval", "1", "--save_interval", "0"),
        *("--output_dir", str(output_dir)),
        timeout=300,
    )
    assert "reward normalization on 16 samples of the initial policy" in result.stdout + result.stderr
    saved = json.loads((output_dir / "args.json").read_text())["rewards"]
    assert saved["trained_model"] == saved["gold_model"] == spec
    normalization = saved["normalization"]
    assert normalization["samples"] == 16 and normalization["std"] > 0
    assert normalization["gain"] == pytest.approx(1 / normalization["std"])
