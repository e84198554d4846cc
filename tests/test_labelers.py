"""labelers.py: every labeler on tiny offline models, the spec parser and its errors."""

import io
import time

import huggingface_hub
import pytest
import torch
from rich.console import Console
from transformers import GPT2Config, GPT2ForSequenceClassification

from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.labelers import (
    ClassifierLabeler,
    HumanLabeler,
    LabelingStopped,
    RewardModelLabeler,
    VaderLabeler,
    decode_without_pad,
    judge_task_mismatch,
    load_labeler,
    sentiment_measured,
)
from lm_human_preference_details.modeling import RewardModel
from lm_human_preference_details.tasks import NPLUS_TASKS, TASK_GOALS, TASKS
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline, tokenizer_fingerprint


def make_reward_model_dir(
    path, model_dir: str, tokenizer, fingerprint: str | None = None, task_name: str | None = None
) -> str:
    """A reward model directory as train_reward.py writes it (random head), on the tiny trunk of `model_dir`, recording
    `task_name` (None: none, as before train_reward.py recorded it)."""
    torch.manual_seed(0)
    model = RewardModel.from_base(model_dir)
    metadata = {
        "base_model": model_dir,
        "tokenizer": model_dir,
        "pad_token_id": tokenizer.pad_token_id,
        "tokenizer_fingerprint": fingerprint or tokenizer_fingerprint(tokenizer),
        "task": {},
        **({"task_name": task_name} if task_name else {}),
    }
    model.save(str(path), metadata)
    tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A tiny GPT-2 sentiment classifier (labels NEGATIVE/POSITIVE) saved with a tokenizer that pads with EOS."""
    path = tmp_path_factory.mktemp("tiny-classifier")
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        n_positions=64,
        vocab_size=50257,
        num_labels=2,
        id2label={0: "NEGATIVE", 1: "POSITIVE"},
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
        pad_token_id=50256,
    )
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    classifier_tokenizer = gpt2_tokenizer_offline()
    classifier_tokenizer.pad_token = classifier_tokenizer.eos_token
    classifier_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Offline mode with an empty hub cache, so hub models must fail fast."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def encode_rows(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """Right-padded token rows of `texts`, each cut to `length` tokens."""
    rows = [tokenizer.encode(t)[:length] for t in texts]
    return torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])


def test_decode_without_pad_drops_pad_keeps_eos(tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    bye = tokenizer.encode(" Bye")
    tokens = torch.tensor([tokenizer.encode("Hello there.") + [pad] * 3, bye + [eos] + [pad] * (5 - len(bye))])
    assert tokens.shape == (2, 6)
    texts = decode_without_pad(tokenizer, tokens.view(1, 2, 6), pad)
    assert texts == ["Hello there.", " Bye<|endoftext|>"]


def test_load_labeler_unknown_spec_lists_valid_forms(tokenizer):
    with pytest.raises(ValueError) as error:
        load_labeler("gpt4", tokenizer, tokenizer.pad_token_id, "cpu", flag="--labeler")
    message = str(error.value)
    assert "--labeler 'gpt4'" in message
    assert all(form in message for form in ("reward_model:DIR", "classifier:NAME_OR_DIR", "vader", "human"))
    with pytest.raises(ValueError, match="valid forms"):
        load_labeler("reward_model:", tokenizer, tokenizer.pad_token_id, "cpu")


def test_reward_model_labeler_scores_query_response_rows(tmp_path, tiny_model_dir, tokenizer):
    rm_dir = make_reward_model_dir(tmp_path / "rm", tiny_model_dir, tokenizer)
    labeler = load_labeler(f"reward_model:{rm_dir}", tokenizer, tokenizer.pad_token_id, "cpu")
    assert isinstance(labeler, RewardModelLabeler) and labeler.name == f"reward_model:{rm_dir}"
    pad = tokenizer.pad_token_id
    queries = torch.tensor([[10, 11, pad], [12, 13, 14]])
    responses = torch.randint(0, 1000, (2, 3, 4))
    responses[0, 1, 2:] = pad  # a truncated response
    scores = labeler.scores(queries, responses)
    assert scores.shape == (2, 3)
    with torch.no_grad():
        for b in range(2):
            for i in range(3):
                single = labeler.model(torch.cat([queries[b], responses[b, i]])[None], pad)[0]
                assert torch.allclose(scores[b, i], single, atol=1e-5)
    assert labeler.best(queries, responses).tolist() == scores.argmax(1).tolist()


def test_reward_model_labeler_rejects_other_tokenizer(tmp_path, tiny_model_dir, tokenizer):
    rm_dir = make_reward_model_dir(tmp_path / "rm", tiny_model_dir, tokenizer, fingerprint="0123456789abcdef")
    with pytest.raises(ValueError) as error:
        load_labeler(f"reward_model:{rm_dir}", tokenizer, tokenizer.pad_token_id, "cpu")
    assert "0123456789abcdef" in str(error.value) and tokenizer_fingerprint(tokenizer) in str(error.value)


def test_reward_model_labeler_missing_dir_names_flag(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="--rewards.gold_model reward_model:DIR"):
        load_labeler(
            f"reward_model:{tmp_path / 'nope'}", tokenizer, tokenizer.pad_token_id, "cpu", flag="--rewards.gold_model"
        )


def test_classifier_labeler_scores_log_prob_of_label(classifier_dir, tokenizer):
    pad = tokenizer.pad_token_id
    texts = ["What a lovely day", "This is awful", "ok", "I hate waiting in line"]
    responses = encode_rows(tokenizer, texts, 6).view(2, 2, 6)
    queries = torch.tensor([[1, 2], [3, pad]])
    positive = load_labeler(f"classifier:{classifier_dir}#POSITIVE", tokenizer, pad, "cpu")
    assert isinstance(positive, ClassifierLabeler) and positive.name.endswith("#POSITIVE")
    scores = positive.scores(queries, responses)
    # expected: the classifier run on each text alone (no padding), log-softmax of label 1
    with torch.no_grad():
        expected = torch.stack(
            [
                torch.log_softmax(
                    positive.model(**positive.classifier_tokenizer(t, return_tensors="pt")).logits[0], -1
                )[1]
                for t in decode_without_pad(tokenizer, responses, pad)
            ]
        ).view(2, 2)
    assert torch.allclose(scores, expected, atol=1e-5)
    # the default label is the last one; '#0' and '#negative' select NEGATIVE
    default = load_labeler(f"classifier:{classifier_dir}", tokenizer, pad, "cpu")
    assert torch.allclose(default.scores(queries, responses), scores, atol=1e-6)
    for spec in (f"classifier:{classifier_dir}#0", f"classifier:{classifier_dir}#negative"):
        negative = load_labeler(spec, tokenizer, pad, "cpu").scores(queries, responses)
        assert torch.allclose(negative.exp() + scores.exp(), torch.ones(2, 2), atol=1e-5)


def test_classifier_says_once_that_it_cuts_a_response_longer_than_it_takes(classifier_dir, tokenizer, capsys):
    labeler = ClassifierLabeler(classifier_dir, "POSITIVE", tokenizer, tokenizer.pad_token_id, "cpu", "--labeler")
    assert labeler.max_length == 64  # its n_positions
    queries = torch.tensor([tokenizer.encode(" The old man walked")])
    fine = tokenizer.encode(" fine")[0]
    assert torch.isfinite(labeler.scores(queries, torch.full((1, 1, 64), fine))).all()  # fits: scored whole
    assert "warning" not in capsys.readouterr().err
    for _ in range(2):  # 192 tokens: the first 64 are scored
        assert torch.isfinite(labeler.scores(queries, torch.full((1, 1, 192), fine))).all()
    err = capsys.readouterr().err
    assert err.count("a response longer than the classifier's 64 tokens is cut to its first ones") == 1, err


def test_classifier_labeler_unknown_label_lists_labels(classifier_dir, tokenizer):
    with pytest.raises(ValueError) as error:
        load_labeler(f"classifier:{classifier_dir}#HAPPY", tokenizer, tokenizer.pad_token_id, "cpu")
    assert "HAPPY" in str(error.value) and "0=NEGATIVE" in str(error.value) and "1=POSITIVE" in str(error.value)


def test_classifier_labeler_rejects_model_that_cannot_score(tiny_model_dir, tokenizer):
    with pytest.raises(ValueError) as error:
        load_labeler(f"classifier:{tiny_model_dir}", tokenizer, tokenizer.pad_token_id, "cpu")
    message = str(error.value)
    assert tiny_model_dir in message and "GPT2LMHeadModel" in message and "sequence classifier" in message


def test_classifier_labeler_offline_hub_fails_fast_naming_flag(offline_hub, tokenizer):
    start = time.perf_counter()
    with pytest.raises(HubUnavailableError) as error:
        load_labeler(
            "classifier:distilbert/distilbert-base-uncased-finetuned-sst-2-english#POSITIVE",
            tokenizer,
            tokenizer.pad_token_id,
            "cpu",
            flag="--labeler",
        )
    assert time.perf_counter() - start < 5
    assert "--labeler classifier:DIR#POSITIVE" in str(error.value) and "offline" in str(error.value)


def test_vader_labeler_prefers_positive_response(tokenizer):
    texts = ["This is terrible, awful and sad.", "I love this, it is wonderful and great!", "The box is on the table."]
    responses = encode_rows(tokenizer, texts, 12).view(1, 3, 12)
    labeler = load_labeler("vader", tokenizer, tokenizer.pad_token_id, "cpu")
    assert isinstance(labeler, VaderLabeler)
    scores = labeler.scores(torch.tensor([[1]]), responses)
    assert scores[0, 1] > scores[0, 2] > scores[0, 0]
    assert labeler.best(torch.tensor([[1]]), responses).tolist() == [1]


def test_human_labeler_reasks_on_invalid_input_and_quits(tokenizer):
    pad = tokenizer.pad_token_id
    queries = encode_rows(tokenizer, ["Once upon a time", "It was late"], 5)
    responses = encode_rows(tokenizer, ["a cat.", "a dog.", "a bird.", "rain.", "snow.", "sun."], 3).view(2, 3, 3)
    screen = io.StringIO()
    labeler = HumanLabeler(tokenizer, pad, console=Console(file=screen, width=120), stdin=io.StringIO("x\n7\n2\n 0 \n"))
    assert labeler.interactive and load_labeler("human", tokenizer, pad, "cpu").interactive
    assert labeler.best(queries, responses).tolist() == [2, 0]
    shown = screen.getvalue()
    assert "Once upon a time" in shown and "[1] a dog." in shown and "snow." in shown
    assert shown.count("invalid answer") == 2
    labeler.stdin = io.StringIO("1\nq\n")
    with pytest.raises(LabelingStopped):
        labeler.best(queries, responses)
    labeler.stdin = io.StringIO("1\n")  # stdin closed after one answer: stop cleanly
    with pytest.raises(LabelingStopped):
        labeler.best(queries, responses)
    labeler.stdin = io.StringIO("2\n1\n")
    assert labeler.scores(queries, responses).tolist() == [[0, 0, 1], [0, 1, 0]]


def test_each_judge_says_what_it_measures_and_a_judge_of_another_task_is_named(
    classifier_dir, tiny_model_dir, tokenizer, tmp_path
):
    # vader judging a descriptiveness policy scored it without a word that VADER measures sentiment
    assert set(TASK_GOALS) == set(TASKS) | set(NPLUS_TASKS)  # every --task says what its judges measure
    pad = tokenizer.pad_token_id
    vader = load_labeler("vader", tokenizer, pad, "cpu")
    positive = load_labeler(f"classifier:{classifier_dir}#POSITIVE", tokenizer, pad, "cpu")
    negative = load_labeler(f"classifier:{classifier_dir}#NEGATIVE", tokenizer, pad, "cpu")
    rm_dir = make_reward_model_dir(tmp_path / "rm", tiny_model_dir, tokenizer, task_name="descriptiveness")
    descriptive = load_labeler(f"reward_model:{rm_dir}", tokenizer, pad, "cpu")
    unknown = load_labeler(
        f"reward_model:{make_reward_model_dir(tmp_path / 'old', tiny_model_dir, tokenizer)}", tokenizer, pad, "cpu"
    )
    assert vader.measures == positive.measures == "positive sentiment" and negative.measures == "negative sentiment"
    assert descriptive.measures == "physical descriptiveness" and unknown.measures is None
    assert judge_task_mismatch(vader.measures, "vader", "descriptiveness", "--gold") == (
        "--gold vader measures positive sentiment, but --task descriptiveness is about physical descriptiveness, so "
        "its scores do not judge this task; pass a --gold of physical descriptiveness, such as reward_model:DIR of a "
        "train_reward.py --task descriptiveness run."
    )
    for task in ("tldr", "cnndm", "nplus_tldr"):
        assert "is about summary quality" in judge_task_mismatch(vader.measures, "vader", task, "--labeler")
    assert judge_task_mismatch(vader.measures, "vader", "sentiment", "--gold") is None
    assert "measures negative sentiment" in judge_task_mismatch(negative.measures, negative.name, "sentiment", "--gold")
    assert judge_task_mismatch(descriptive.measures, descriptive.name, "descriptiveness", "--gold") is None
    assert judge_task_mismatch(descriptive.measures, descriptive.name, "sentiment", "--gold") is not None
    # what is not known is not claimed: a reward model without a task name, a classifier of other labels
    assert judge_task_mismatch(unknown.measures, unknown.name, "descriptiveness", "--gold") is None
    assert sentiment_measured({0: "LABEL_0", 1: "LABEL_1"}, 1) is None
    assert sentiment_measured({0: "negative", 1: "neutral", 2: "positive"}, 2) == "positive sentiment"
