"""tasks.py: the presets and TaskHParams, the per-text query construction (spec G3), the context formatting (G4), the
truncation token named by its text, the response truncation (P2), the filter (P3) and its pass-rate alarm.

Elsewhere: each preset's queries from its real sources in tests/test_sources.py; the query stream that calls
build_query in tests/test_data.py; the --task.* flag checks (`check_task`) among the scripts' flag checks in
tests/test_validation.py and tests/test_user_errors.py; one BOS in front of each architecture's contexts in
tests/test_architectures.py; the filter in whole runs in tests/test_train_policy.py and tests/test_label_generation.py.
"""

import dataclasses

import pytest
import torch
import tyro

from lm_human_preference_details.resumable import RESUME_IGNORED, setting_differences
from lm_human_preference_details.tasks import (
    TASKS,
    PassRateAlarm,
    TaskHParams,
    build_query,
    check_truncation_resolved,
    encode_context_affixes,
    encode_texts,
    format_contexts,
    passes_filter,
    resolve_truncation,
    task_differences,
    text_to_token,
    truncate_response,
)
from lm_human_preference_details.tokenizer import load_tokenizer
from tests import archs
from tests.archs import BOS_TEXT

PAD = 50257
P = 99  # pad id in the hand-written build_query cases


# ---------------------------------------------------------------- presets and TaskHParams


def test_tasks_match_launch_presets(tokenizer):
    # launch.py's truncate_token 13 and 198 are GPT-2's "." and "\n": the presets name the text, which GPT-2's
    # tokenizer resolves to OAI's ids
    tasks = {name: resolve_truncation(task, tokenizer) for name, task in TASKS.items()}
    assert {name: (task.truncate_text, task.truncate_token) for name, task in tasks.items()} == {
        "sentiment": (".", 13),
        "descriptiveness": (".", 13),
        "tldr": ("\n", 198),
        "cnndm": ("\n", 198),
    }
    for name in ("sentiment", "descriptiveness"):
        task = tasks[name]
        assert (task.query_dataset, task.query_length, task.response_length) == ("books", 64, 24)
        assert (task.start_text, task.end_text, task.truncate_token, task.truncate_after) == (".", ".", 13, 16)
        assert (task.query_prefix, task.query_suffix, task.temperature) == ("", "", 0.7)
    tldr, cnndm = tasks["tldr"], tasks["cnndm"]
    assert (tldr.query_length, tldr.response_length) == (500, 75)
    assert (tldr.query_prefix, tldr.query_suffix) == ("", "\n\nTL;DR:")
    assert (tldr.start_text, tldr.end_text, tldr.truncate_token, tldr.truncate_after, tldr.temperature) == (
        None,
        None,
        198,
        55,
        0.7,
    )
    assert (cnndm.query_prefix, cnndm.query_suffix, cnndm.start_text, cnndm.end_text) == (
        "Article:\n\n",
        "\n\nTL;DR:",
        None,
        "\n",
    )
    assert (cnndm.query_length, cnndm.response_length, cnndm.truncate_token, cnndm.truncate_after) == (500, 75, 198, 55)
    assert cnndm.temperature == 0.5
    assert all(task.penalty_reward_value == -1.0 for task in TASKS.values())


def test_books_presets_share_one_task():
    assert TASKS["sentiment"] == TASKS["descriptiveness"]  # they differ only in the reward model's labels


def test_task_hparams_parse_with_tyro():
    args = ["--query-length", "500", "--start-text", "None", "--truncate-token", "13", "--end-text", "."]
    task = tyro.cli(TaskHParams, default=TASKS["tldr"], args=args)
    assert (task.query_length, task.start_text, task.truncate_token, task.end_text) == (500, None, 13, ".")
    assert task.query_dataset == "tldr" and task.response_length == 75


def test_task_hparams_class_defaults_are_oai_lm_tasks_defaults():
    # OAI lm_tasks.py#L11-L34: lengths and dataset required; start '.', no end text, no truncation, penalty -1, T 1.0
    with pytest.raises(TypeError):
        TaskHParams(query_length=64, response_length=24)  # query_dataset is required
    task = TaskHParams(query_length=64, query_dataset="books", response_length=24)
    assert (task.query_prefix, task.query_suffix, task.start_text, task.end_text) == ("", "", ".", None)
    assert (task.truncate_token, task.truncate_after, task.penalty_reward_value, task.temperature) == (None, 0, -1, 1.0)


# ---------------------------------------------------------------- query construction (spec G3)


@pytest.mark.parametrize(
    "tokens, length, start, end, expected",
    [
        ([5, 13, 7, 8], 5, 13, None, [7, 8, P, P, P]),  # start found: keep what follows it
        ([13, 1, 13, 2], 5, 13, None, [1, 13, 2, P, P]),  # only the first start token counts
        ([1, 2, 13], 4, 13, None, [1, 2, 13, P]),  # start is the last token: text kept whole
        ([1, 2, 3], 4, 13, None, None),  # start not found: skipped
        ([1, 2, 3, 4, 5, 6], 4, None, None, [1, 2, 3, 4]),  # truncation, no padding needed
        ([1, 2], 4, None, None, [1, 2, P, P]),  # right padding
        ([1, 13, 2, 13, 3], 5, None, 13, [1, 13, 2, 13, P]),  # end: up to the last occurrence
        ([1, 2, 3, 13], 3, None, 13, None),  # end only searched after truncation: skipped
        ([1, 2, 3], 3, None, 13, None),  # end not found: skipped
        ([9, 13, 1, 2, 13, 3, 4], 6, 13, 13, [1, 2, 13, P, P, P]),  # start then end
        ([9, 13, 1, 2, 3, 13, 4], 3, 13, 13, None),  # end lies beyond query_length after the start trim
        ([], 3, None, None, None),  # empty text: skipped
    ],
)
def test_build_query_oai_steps(tokens, length, start, end, expected):
    assert build_query(tokens, length, start, end, P) == expected


def test_build_query_tv1(tokenizer):
    tokens = encode_texts(tokenizer, ["usually, he would", "she thought about it"])
    queries = [build_query(t, 5, None, None, tokenizer.pad_token_id) for t in tokens]
    assert queries == [[23073, 11, 339, 561, 50257], [7091, 1807, 546, 340, 50257]]


def test_build_query_rejects_nonpositive_length():
    with pytest.raises(ValueError, match="query_length"):
        build_query([1, 2], 0, None, None, P)


def test_text_to_token_single_tokens(tokenizer):
    assert text_to_token(tokenizer, ".") == 13
    assert text_to_token(tokenizer, "\n") == 198
    assert text_to_token(tokenizer, None) is None
    assert text_to_token(tokenizer, "") is None
    with pytest.raises(ValueError, match="--task.end_text.*TL;DR"):
        text_to_token(tokenizer, "TL;DR:", "--task.end_text")


def test_encode_texts_treats_special_strings_as_text(tokenizer):
    (tokens,) = encode_texts(tokenizer, ["a [PAD] b<|endoftext|>"])
    assert PAD not in tokens and tokenizer.eos_token_id not in tokens


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_special_token_text_in_data_is_plain_text(family, family_dirs):
    tokenizer = load_tokenizer(family_dirs[family])
    text = f"a {BOS_TEXT} b <|endoftext|> c <|end_of_text|> d [PAD] e"
    (ids,) = encode_texts(tokenizer, [text])
    assert not set(ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(ids) == text


# ---------------------------------------------------------------- context formatting (spec G4)


def test_format_contexts_tldr_suffix(tokenizer):
    prefix, suffix = encode_context_affixes(tokenizer, TASKS["tldr"])
    assert prefix == [] and suffix == tokenizer("\n\nTL;DR:")["input_ids"]
    queries = torch.tensor([[23073, 11, 339, 561, PAD], [7091, 1807, 546, 340, PAD]])
    contexts = format_contexts(queries, prefix, suffix)
    assert contexts.shape == (2, 5 + len(suffix)) and contexts.dtype == torch.long
    assert torch.equal(contexts[:, :5], queries)
    assert contexts[:, 5:].tolist() == [suffix, suffix]


def test_format_contexts_cnndm_prefix_and_suffix(tokenizer):
    prefix, suffix = encode_context_affixes(tokenizer, TASKS["cnndm"])
    assert prefix == tokenizer("Article:\n\n")["input_ids"]
    queries = torch.tensor([[1, 2, PAD]])
    contexts = format_contexts(queries, prefix, suffix)
    assert contexts.tolist() == [prefix + [1, 2, PAD] + suffix]


def test_format_contexts_rejects_1d():
    with pytest.raises(ValueError, match="shape"):
        format_contexts(torch.tensor([1, 2]), [], [])


# ---------------------------------------------------------------- the truncation token, by text


@pytest.mark.parametrize("family", archs.FAMILIES)
def test_preset_truncation_text_resolves_to_each_tokenizers_own_id(family, family_dirs):
    tokenizer = load_tokenizer(family_dirs[family])
    for name, text in (("sentiment", "."), ("tldr", "\n")):
        task = resolve_truncation(TASKS[name], tokenizer)
        assert (
            task.truncate_text == text
            and task.truncate_token == tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))[0]
            and encode_texts(tokenizer, [text]) == [[task.truncate_token]]
        )
        assert resolve_truncation(task, tokenizer) == task  # once: resolving a resolved task changes nothing
    dot = resolve_truncation(TASKS["sentiment"], tokenizer).truncate_token
    assert dot == (15 if family == "llama" else 14)  # not GPT-2's 13


def test_truncation_text_of_several_tokens_or_naming_another_token_is_refused(family_dirs, tokenizer):
    llama = load_tokenizer(family_dirs["llama"])
    with pytest.raises(ValueError, match=r"--task.truncate_text 'TL;DR:' must be exactly one token") as error:
        resolve_truncation(dataclasses.replace(TASKS["sentiment"], truncate_text="TL;DR:"), llama)
    assert "\n" not in str(error.value)
    conflict = dataclasses.replace(TASKS["sentiment"], truncate_token=13)  # GPT-2's "." with the llama tokenizer
    with pytest.raises(ValueError, match=r"--task.truncate_token 13 and --task.truncate_text '.' \(token 15 in"):
        resolve_truncation(conflict, llama)
    assert resolve_truncation(conflict, tokenizer).truncate_token == 13  # the same token in GPT-2's: no conflict
    by_id = dataclasses.replace(TASKS["sentiment"], truncate_token=198, truncate_text=None)
    assert resolve_truncation(by_id, llama) == by_id  # an explicit id is used as it is


def test_task_check_compares_the_resolved_truncation_id(family_dirs, tokenizer):
    llama = load_tokenizer(family_dirs["llama"])
    gpt2_task = resolve_truncation(TASKS["sentiment"], tokenizer)
    old_saved = {k: v for k, v in dataclasses.asdict(gpt2_task).items() if k != "truncate_text"}  # saved before it
    assert old_saved["truncate_token"] == 13 and task_differences(old_saved, gpt2_task) == {}
    assert task_differences(old_saved, TASKS["sentiment"]) == {}  # not resolved yet (a dry run): decided later
    assert task_differences(old_saved, resolve_truncation(TASKS["sentiment"], llama)) == {"truncate_token": (13, 15)}
    saved = dataclasses.asdict(gpt2_task)
    assert task_differences(saved, TASKS["sentiment"]) == {}
    newline = dataclasses.replace(TASKS["sentiment"], truncate_text="\n")
    assert task_differences(saved, newline) == {"truncate_text": (".", "\n")}
    by_id = dataclasses.replace(gpt2_task, truncate_text=None)  # the same token named by id: the same task
    assert task_differences(saved, by_id) == {}
    # a checkpoint written before truncate_text resumes: its settings hold the same (resolved) id
    before = {"task": old_saved, "seed": 1}
    assert setting_differences(before, {"task": dataclasses.asdict(gpt2_task), "seed": 1}, RESUME_IGNORED) == {}
    changed = {"task": dataclasses.asdict(resolve_truncation(TASKS["sentiment"], llama)), "seed": 1}
    assert setting_differences(before, changed, RESUME_IGNORED) == {"task.truncate_token": (13, 15)}


def test_a_preset_whose_truncation_text_was_not_resolved_is_refused_where_the_filter_applies(tokenizer):
    import label_generation
    from lm_human_preference_details.evaluation import sample_and_score
    from lm_human_preference_details.rewards import normalize_reward

    unresolved = TASKS["sentiment"]  # truncate_text '.', no id yet: its filter would silently pass every response
    calls = [
        lambda: sample_and_score(None, None, None, unresolved, tokenizer, None, {}, None),
        lambda: normalize_reward(None, None, None, None, unresolved, 8, 0, None),
        lambda: label_generation.sample_passing_responses(None, None, unresolved, 4, 0, None, 1.0, 1, 1),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"truncation text '\.' has no token id: call tasks.resolve_truncation"):
            call()
    check_truncation_resolved(resolve_truncation(unresolved, tokenizer))  # resolved: passes
    check_truncation_resolved(dataclasses.replace(unresolved, truncate_text=None))  # no truncation at all: passes


# ---------------------------------------------------------------- response truncation (spec P2) and the filter (P3)


def test_truncate_response_pads_after_first_qualifying_token():
    # truncate_token 13, truncate_after 2 (spec P2): a 13 before index 2 does not count, the 13 itself is kept
    responses = torch.tensor(
        [
            [13, 5, 6, 13, 7, 13],  # first 13 at index 0 is too early; the one at 3 truncates
            [5, 6, 13, 8, 9, 10],  # 13 exactly at index truncate_after counts
            [13, 13, 5, 6, 7, 8],  # only early 13s: unchanged
            [1, 2, 3, 4, 5, 13],  # 13 last: nothing to pad
        ]
    )
    expected = torch.tensor(
        [
            [13, 5, 6, 13, PAD, PAD],
            [5, 6, 13, PAD, PAD, PAD],
            [13, 13, 5, 6, 7, 8],
            [1, 2, 3, 4, 5, 13],
        ]
    )
    assert torch.equal(truncate_response(responses, 13, 2, PAD), expected)
    assert torch.equal(truncate_response(responses, None, 2, PAD), responses)


def test_passes_filter_needs_truncate_token_at_or_after_truncate_after():
    responses = torch.tensor(
        [[13, 5, 6, 13, PAD, PAD], [5, 6, 13, PAD, PAD, PAD], [13, 13, 5, 6, 7, 8], [1, 2, 3, 4, 5, 13]]
    )
    assert passes_filter(responses, 13, 2).tolist() == [True, True, False, True]
    assert passes_filter(responses, None, 2).tolist() == [True] * 4


def test_pass_rate_alarm_fires_every_interval_while_the_rate_stays_low():
    task = TaskHParams(query_length=4, query_dataset="books", response_length=24, truncate_token=13, truncate_after=16)
    alarm = PassRateAlarm(threshold=0.1, interval=3)
    rates = [0.0, 0.05, 0.0, 0.02, 0.5, 0.0, 0.0, 0.0, 0.09, 0.0]
    fired = {update: alarm.update(rate, update, task) for update, rate in enumerate(rates)}
    # checks at updates 0, 3, 6, 9: fires when every rate since the last check was low (update 4 passed 50%)
    assert [update for update, warning in fired.items() if warning] == [0, 3, 9]
    assert "updates 1-3, highest 0.050" in fired[3] and "updates 7-9, highest 0.090" in fired[9]
    for flag in ("--task.truncate_token 13", "--task.truncate_after 16", "--task.response_length 24"):
        assert flag in fired[0]
    assert "--task.penalty_reward_value -1.0" in fired[0]
    # a rate that reached 0.5 and fell blames the training, not the filter's flags
    assert "fell below 0.1 (updates 7-9, highest 0.090) after 0.500 at update 4" in fired[9]
    assert "--ppo.lr" in fired[9] and "Check these flags" not in fired[9] and "Check these flags" in fired[3]
    assert not any(PassRateAlarm(0.0, 1).update(0.0, update, task) for update in range(3))  # 0: never
