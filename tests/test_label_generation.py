"""label_generation.py: generate (filter, labelers, metadata, human resume, train_reward reads it) and convert."""

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import label_generation
from lm_human_preference_details import cli
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labelers import VaderLabeler
from lm_human_preference_details.labels import (
    OAI_PAD_TOKEN,
    check_label_task,
    label_file_task,
    load_labels,
    read_label_rows,
)
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    load_causal_lm,
    load_reward_model,
    score_label_rows,
)
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline
from tests import archs
from tests.conftest import tiny_gpt2
from tests.planted import REPO, books_task, run_script
from tests.test_labelers import make_reward_model_dir


def run_label_generation(argv: list[str]) -> dict:
    """label_generation.py in-process, from its command line."""
    return label_generation.main(label_generation.parse(argv))


QUERY_LENGTH, RESPONSE_LENGTH, TRUNCATE_AFTER, PERIOD = 16, 8, 4, 13
WORDS = [" happy", " sad", " love", " hate", "."]
"""what the tiny model samples: about 1 in 5 tokens is '.', so ~60% of responses pass the filter (and ~40% fail)"""
VOCAB_SIZE = 12_000
"""the tiny model's vocabulary: the first GPT-2 ids, which cover the corpus below (sampling over it is fast)"""
SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "her sister", "the teacher", "a bird", "the child"]
VERBS = ["walked to", "looked at", "talked about", "thought about", "found", "saw", "visited", "left"]
OBJECTS = ["the house", "a river", "the garden", "the city", "a small boat", "the station", "the forest", "the school"]
ENDINGS = ["in the morning", "after dinner", "with a smile", "for a while", "before the rain", "at night"]


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def word_sampler_gpt2(tokens: list[int]):
    """A tiny GPT-2 over the first VOCAB_SIZE ids that samples (nearly uniformly) only `tokens`, whatever the input."""
    model = tiny_gpt2(vocab_size=VOCAB_SIZE, bos_token_id=None, eos_token_id=None)
    with torch.no_grad():
        # hidden dim 0 is a constant 10 after ln_f; the tied embedding's dim 0 is +1 for `tokens`, -1 otherwise
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = 10.0
        model.transformer.wte.weight[:, 0] = -1.0
        model.transformer.wte.weight[tokens, 0] = 1.0
    return model


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """A corpus of two-sentence passages and a tiny GPT-2 that samples sentiment words and '.'."""
    root = tmp_path_factory.mktemp("labels-world")
    rng = np.random.RandomState(0)

    def sentence() -> str:
        return " ".join(rng.choice(words) for words in (SUBJECTS, VERBS, OBJECTS, ENDINGS)).capitalize() + "."

    lines = [f"{sentence()} {sentence()}" for _ in range(200)]
    assert max(max(ids) for ids in tokenizer(lines)["input_ids"]) < VOCAB_SIZE
    corpus = root / "queries.txt"
    corpus.write_text("\n".join(lines) + "\n")
    model_dir = root / "model"
    word_sampler_gpt2([tokenizer.encode(w)[0] for w in WORDS]).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {"root": root, "corpus": str(corpus), "model": str(model_dir)}


def generate_flags(world, output, *extra: str) -> list[str]:
    return [
        "generate",
        "--base_model",
        world["model"],
        "--task.query_dataset",
        world["corpus"],
        "--task.query_length",
        str(QUERY_LENGTH),
        "--task.response_length",
        str(RESPONSE_LENGTH),
        "--task.truncate_after",
        str(TRUNCATE_AFTER),
        "--output",
        str(output),
        *extra,
    ]


def read_rows(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_meta(path) -> dict:
    with open(f"{path}.meta.json", encoding="utf-8") as f:
        return json.load(f)


def passes_filter_and_is_truncated(sample: list[int]) -> bool:
    """'.' at index >= truncate_after, everything after its first such occurrence is OAI's PAD, no PAD before."""
    tokens = np.array(sample)
    qualifying = np.flatnonzero((tokens == PERIOD) & (np.arange(len(tokens)) >= TRUNCATE_AFTER))
    if qualifying.size == 0:
        return False
    cut = qualifying[0] + 1
    return bool((tokens[cut:] == OAI_PAD_TOKEN).all() and (tokens[:cut] != OAI_PAD_TOKEN).all())


@pytest.fixture(scope="module")
def vader_labels(world, tmp_path_factory):
    """16 rows labelled by VADER, written by the real CLI entry point."""
    output = tmp_path_factory.mktemp("vader") / "labels.json"
    meta = run_label_generation(
        generate_flags(world, output, "--labeler", "vader", "--num_queries", "16", "--batch_size", "8")
    )
    return output, meta


# ---------------------------------------------------------------- sampling and filter


def test_sample_passing_responses_drops_failing_and_truncates(world, tokenizer):
    task = books_task(query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH, truncate_after=TRUNCATE_AFTER)
    policy = PolicyWithValueHead(load_causal_lm(world["model"]))
    contexts = torch.tensor([tokenizer.encode(" The cat sat.")] * 24)
    pad = tokenizer.pad_token_id
    responses, done, sampled, passed = label_generation.sample_passing_responses(
        policy,
        contexts,
        task,
        2,
        pad,
        torch.Generator().manual_seed(0),
        pass_rate=1.0,
        max_rounds=1,
        max_oversample=1,
    )
    # one round of 2 candidates per query, ~60% pass: some queries get both, the others stay unfilled (PAD)
    assert sampled == 48 and 0 < passed < sampled and 0 < done.sum() < 24
    assert (responses[~done] == pad).any()
    kept = responses[done].reshape(-1, RESPONSE_LENGTH)
    kept = torch.where(kept == pad, OAI_PAD_TOKEN, kept)
    assert all(passes_filter_and_is_truncated(row) for row in kept.tolist())
    responses, done, sampled, passed = label_generation.sample_passing_responses(
        policy,
        contexts[:6],
        task,
        3,
        pad,
        torch.Generator().manual_seed(0),
        pass_rate=1.0,
        max_rounds=8,
        max_oversample=8,
    )
    assert done.all() and passed >= 18 and sampled > passed
    kept = torch.where(responses == pad, OAI_PAD_TOKEN, responses).reshape(-1, RESPONSE_LENGTH)
    assert all(passes_filter_and_is_truncated(row) for row in kept.tolist())
    # without a truncate token every response passes: one round of exactly N per query
    no_filter = books_task(
        query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH, truncate_token=None, truncate_text=None
    )
    responses, done, sampled, passed = label_generation.sample_passing_responses(
        policy, contexts[:6], no_filter, 3, pad, torch.Generator().manual_seed(0), 1.0, 8, 8
    )
    assert done.all() and sampled == passed == 18 and not (responses == pad).any()


# ---------------------------------------------------------------- generate


def test_generate_vader_rows_pass_filter_and_match_labeler(vader_labels, world, tokenizer):
    output, meta = vader_labels
    rows = read_rows(output)
    assert len(rows) == 16 and sorted(rows[0]) == ["best", "query", "sample0", "sample1", "sample2", "sample3"]
    assert all(passes_filter_and_is_truncated(row[f"sample{i}"]) for row in rows for i in range(4))
    assert all(len(row["query"]) == QUERY_LENGTH and row["query"][0] != OAI_PAD_TOKEN for row in rows)
    labels = load_labels(str(output), QUERY_LENGTH, RESPONSE_LENGTH, tokenizer.pad_token_id, num_train=16)
    vader = VaderLabeler(tokenizer, tokenizer.pad_token_id)
    scores = vader.scores(labels.query, labels.samples)
    assert (scores.gather(1, labels.label[:, None])[:, 0] == scores.max(1).values).all()
    assert len(set(labels.label.tolist())) > 1


def test_generate_metadata_counts(vader_labels, tokenizer):
    output, meta = vader_labels
    assert meta == read_meta(output)
    counts = meta["counts"]
    assert counts["rows"] == 16 and counts["queries"] == counts["rows"] + counts["skipped_queries"]
    # at least 4 passing candidates per row; ~40% fail, so the filter dropped many
    assert counts["candidates_passed"] >= 16 * 4 and counts["candidates_sampled"] > counts["candidates_passed"]
    assert counts["filter_pass_rate"] == pytest.approx(counts["candidates_passed"] / counts["candidates_sampled"])
    assert meta["labeler"] == "vader" and meta["pad_id"] == OAI_PAD_TOKEN and meta["complete"]
    assert meta["tokenizer_fingerprint"] == label_generation.tokenizer_fingerprint(tokenizer)
    assert meta["task"]["truncate_after"] == TRUNCATE_AFTER and meta["seed"] == 1 and meta["data_seed"] == 0
    assert meta["wall_time_s"] > 0


def test_generated_labels_train_a_reward_model(vader_labels, world, tmp_path):
    output, _ = vader_labels
    rm_dir = tmp_path / "rm"
    run_script(
        "train_reward.py",
        "--base_model",
        world["model"],
        "--label_dataset",
        str(output),
        "--task.query_dataset",
        world["corpus"],
        "--task.query_length",
        str(QUERY_LENGTH),
        "--task.response_length",
        str(RESPONSE_LENGTH),
        "--labels.num_train",
        "16",
        "--batch_size",
        "8",
        "--rollout_batch_size",
        "8",
        "--normalize_samples",
        "8",
        "--output_dir",
        str(rm_dir),
        timeout=300,
    )
    _, metadata = load_reward_model(str(rm_dir))
    assert metadata["label_dataset"] == str(output) and metadata["num_train"] == 16


@pytest.mark.slow
def test_a_sentiment_labeler_of_descriptiveness_rows_is_said_at_every_step(world, tmp_path):
    # vader's best-of-4 picks on --task descriptiveness rows teach a reward model sentiment, which train_reward.py
    # recorded as a descriptiveness model without a word; train_policy.py scored a descriptiveness run with vader too
    output = tmp_path / "labels.json"
    flags = generate_flags(world, output, "--task", "descriptiveness", "--labeler", "vader", "--num_queries", "16")
    result = run_script("label_generation.py", *flags, timeout=300)
    measured = "measures positive sentiment, but --task descriptiveness is about physical descriptiveness, so its"
    assert f"warning: --labeler vader {measured} scores do not judge this task; pass a --labeler of physical " in (
        result.stdout
    )
    meta = read_meta(output)
    assert (meta["task_id"], meta["labeler_measures"]) == ("descriptiveness", "positive sentiment")
    task = ["--task.query_dataset", world["corpus"], "--task.query_length", str(QUERY_LENGTH)]
    task += ["--task.response_length", str(RESPONSE_LENGTH), "--task.truncate_after", str(TRUNCATE_AFTER)]
    reward = ["--task", "descriptiveness", "--base_model", world["model"], "--label_dataset", str(output), *task]
    reward += ["--labels.num_train", "16", "--batch_size", "8", "--rollout_batch_size", "8"]
    result = run_script("train_reward.py", *reward, "--normalize_samples", "8", "--output_dir", str(tmp_path / "rm"))
    warning = (
        f"--label_dataset '{output}' was labelled by vader, which measures positive sentiment (its "
        "labels.json.meta.json), but this run is --task descriptiveness, which is about physical descriptiveness: the "
        "reward model would learn positive sentiment; label the rows with a labeler of physical descriptiveness."
    )
    assert f"warning: {warning}" in result.stdout.splitlines()
    _, metadata = load_reward_model(str(tmp_path / "rm"))
    assert metadata["task_name"] == "descriptiveness" and metadata["label_warnings"] == [warning]
    policy = ["--task", "descriptiveness", "--base_model", world["model"], *task, "--output_dir", str(tmp_path / "p")]
    policy += ["--rewards.trained_model", "vader", "--rewards.gold_model", "vader"]
    result = run_script("train_policy.py", *policy, "--ppo.total_episodes", "8", "--ppo.batch_size", "8", timeout=300)
    for flag in ("--rewards.trained_model", "--rewards.gold_model"):
        assert (
            f"warning: {flag} vader {measured} scores do not judge this task; pass a {flag} of physical "
            "descriptiveness, such as reward_model:DIR of a train_reward.py --task descriptiveness run."
        ) in result.stdout.splitlines()


@pytest.mark.slow
def test_labels_without_their_meta_train_a_reward_model_that_says_their_task_was_not_checked(
    vader_labels, world, tmp_path
):
    # a user's label file without its .meta.json trained a reward model recorded as the run's --task, silently
    labels = tmp_path / "mine.json"
    shutil.copy(vader_labels[0], labels)
    task = ["--task.query_dataset", world["corpus"], "--task.query_length", str(QUERY_LENGTH)]
    task += ["--task.response_length", str(RESPONSE_LENGTH), "--task.truncate_after", str(TRUNCATE_AFTER)]
    reward = ["--base_model", world["model"], "--label_dataset", str(labels), *task, "--labels.num_train", "16"]
    reward += ["--batch_size", "8", "--rollout_batch_size", "8", "--normalize_samples", "8"]
    rm_dir = tmp_path / "rm"
    result = run_script("train_reward.py", *reward, "--output_dir", str(rm_dir))
    warning = (
        f"--label_dataset '{labels}': nothing tells which task its labels judge (it has no mine.json.meta.json beside "
        "it, which label_generation.py writes), so their task was not checked and the reward model is recorded as a "
        '--task sentiment model on trust; if they are --task sentiment labels, write {"task_id": "sentiment"} to '
        f"{labels}.meta.json to have it checked."
    )
    assert f"warning: {warning}" in result.stdout.splitlines()
    _, metadata = load_reward_model(str(rm_dir))
    assert metadata["label_task_checked"] is False and metadata["label_warnings"] == [warning]
    # a policy on that reward model says it again
    policy = ["--base_model", world["model"], "--rewards.trained_model", str(rm_dir), *task, "--dry_run"]
    result = run_script("train_policy.py", *policy, "--output_dir", str(tmp_path / "policy"))
    assert f"warning: the reward model '{rm_dir}' was trained with a warning: {warning}" in result.stdout.splitlines()
    # the fix it names: the file's task recorded, then checked
    with open(f"{labels}.meta.json", "w", encoding="utf-8") as f:
        json.dump({"task_id": "sentiment"}, f)
    result = run_script("train_reward.py", *reward, "--dry_run", "--output_dir", str(tmp_path / "rm2"))
    assert "warning" not in result.stdout
    # OAI's files, and the successor preset's pairs, name their task without a .meta.json
    assert label_file_task("sentiment/offline_5k.json") == ("sentiment", "one of OAI's sentiment label files")
    assert label_file_task("trl-lib/tldr-preference") == (
        "nplus_tldr",
        "the label file of the --task nplus_tldr preset",
    )
    assert check_label_task("descriptiveness/offline_5k.json", "descriptiveness", False) is None


def test_generate_reward_model_best_is_its_argmax(world, tiny_model_dir, tokenizer, tmp_path):
    rm_dir = make_reward_model_dir(tmp_path / "rm", tiny_model_dir, tokenizer)
    output = tmp_path / "rm_labels.json"
    run_label_generation(
        generate_flags(
            world,
            output,
            "--labeler",
            f"reward_model:{rm_dir}",
            "--num_queries",
            "6",
            "--num_labels",
            "3",
            "--batch_size",
            "6",
            "--seed",
            "3",
        )
    )
    labels = load_labels(str(output), QUERY_LENGTH, RESPONSE_LENGTH, tokenizer.pad_token_id, 6, "best_of_3")
    reward_model, _ = load_reward_model(rm_dir)
    with torch.no_grad():
        rewards = score_label_rows(reward_model, labels.query, labels.samples, tokenizer.pad_token_id)
    assert labels.label.tolist() == rewards.argmax(1).tolist()
    assert len(set(labels.label.tolist())) > 1
    assert read_meta(output)["labeler"] == f"reward_model:{rm_dir}"


@pytest.mark.parametrize("kind", ["scalar_rating", "scalar_compare"])
def test_generate_scalar_label_types_write_the_labelers_scores(world, tokenizer, tmp_path, kind):
    # OAI label_types.py#L58-L109: scalar_rating = query, sample, score; scalar_compare = query, sample0, sample1,
    # difference = score(sample1) - score(sample0)
    output = tmp_path / "labels.json"
    flags = ["--label_type", kind, "--labeler", "vader", "--num_queries", "8", "--batch_size", "8"]
    meta = run_label_generation(generate_flags(world, output, *flags))
    sample_fields = ["sample"] if kind == "scalar_rating" else ["sample0", "sample1"]
    label_field = "score" if kind == "scalar_rating" else "difference"
    rows = read_rows(output)
    assert len(rows) == 8 and sorted(rows[0]) == sorted(["query", *sample_fields, label_field])
    assert all(passes_filter_and_is_truncated(row[field]) for row in rows for field in sample_fields)
    assert meta["label_type"] == kind and meta["num_labels"] == len(sample_fields)
    pad = tokenizer.pad_token_id
    labels = load_labels(str(output), QUERY_LENGTH, RESPONSE_LENGTH, pad, 8, kind)
    scores = VaderLabeler(tokenizer, pad).scores(labels.query, labels.samples)  # (8, S)
    expected = scores[:, 0] if kind == "scalar_rating" else scores[:, 1] - scores[:, 0]
    torch.testing.assert_close(labels.label, expected, rtol=0, atol=0)
    assert len(set(labels.label.tolist())) > 1


def test_generate_human_labeler_only_picks_the_best(world, tmp_path):
    flags = ["--label_type", "scalar_rating", "--labeler", "human", "--num_queries", "2"]
    with pytest.raises(ValueError, match="only picks the best response.*--label_type best_of_N"):
        run_label_generation(generate_flags(world, tmp_path / "labels.json", *flags))
    assert not (tmp_path / "labels.json").exists()


def test_generate_skips_queries_without_enough_passing_responses(world, tmp_path):
    output = tmp_path / "skips.json"
    meta = run_label_generation(
        generate_flags(
            world,
            output,
            "--labeler",
            "vader",
            "--num_queries",
            "3",
            "--num_labels",
            "2",
            "--batch_size",
            "8",
            "--max_rounds",
            "1",
            "--max_oversample",
            "1",
        )
    )
    counts = meta["counts"]
    assert len(read_rows(output)) == counts["rows"] == 3
    assert counts["skipped_queries"] > 0 and counts["queries"] == 3 + counts["skipped_queries"]
    # one round of exactly 2 candidates for each of the 8 queries of every batch drawn
    assert counts["candidates_sampled"] % 16 == 0 and counts["candidates_sampled"] >= 2 * counts["queries"]


def test_generate_stops_with_the_filter_flags_when_responses_never_pass(world, tokenizer, tmp_path, capsys):
    never = tmp_path / "never-passes"  # samples only words, never the truncate token '.'
    word_sampler_gpt2([tokenizer.encode(w)[0] for w in (" happy", " sad")]).save_pretrained(never)
    tokenizer.save_pretrained(never)
    output = tmp_path / "labels.json"
    flags = generate_flags({**world, "model": str(never)}, output, "--batch_size", "4", "--num_labels", "2")
    start = time.perf_counter()
    with pytest.raises(SystemExit) as stop:
        cli.run(label_generation.main, label_generation.parse, flags)
    assert stop.value.code == 2 and time.perf_counter() - start < 30  # one batch, not an endless loop
    out, err = capsys.readouterr()
    assert "pass rate 0.00" in out  # the progress bar
    message = next(line for line in err.splitlines() if line.startswith("error:"))
    assert message.startswith("error: only 0.0% of ") and "below --min_pass_rate 0.02" in message
    for flag in ("--task.truncate_token 13", "--task.truncate_after 4", "--task.response_length 8"):
        assert flag in message
    assert "no rows were written" in message and not output.exists()


def test_generate_pass_rate_bound_keeps_the_rows_and_a_rerun_continues(world, tmp_path):
    stopped, fresh = tmp_path / "stopped.json", tmp_path / "fresh.json"
    common = ["--labeler", "vader", "--num_labels", "2", "--batch_size", "4", "--num_queries", "7"]
    # ~60% of the responses pass: a 90% bound stops after the first batch, whose rows are saved
    with pytest.raises(ValueError, match=r"below --min_pass_rate 0\.9: .* [1-4] rows are saved in"):
        run_label_generation(generate_flags(world, stopped, *common, "--min_pass_rate", "0.9"))
    kept = read_rows(stopped)
    assert 0 < len(kept) <= 4 and not read_meta(stopped)["complete"]
    run_label_generation(generate_flags(world, stopped, *common, "--min_pass_rate", "0"))
    run_label_generation(generate_flags(world, fresh, *common))
    assert read_rows(stopped) == read_rows(fresh) and read_rows(fresh)[: len(kept)] == kept
    assert read_meta(stopped)["counts"] == read_meta(fresh)["counts"]


def test_generate_refuses_to_resume_with_other_settings(vader_labels, world, tmp_path):
    output = tmp_path / "labels.json"
    shutil.copy(vader_labels[0], output)
    shutil.copy(f"{vader_labels[0]}.meta.json", f"{output}.meta.json")
    flags = generate_flags(world, output, "--labeler", "vader", "--num_queries", "16", "--batch_size", "8")
    with pytest.raises(ValueError, match="other settings.*'seed': \\(1, 2\\).*--overwrite"):
        run_label_generation([*flags, "--seed", "2"])
    # the same settings find the file complete and leave its rows unchanged
    before = output.read_text()
    assert run_label_generation(flags)["counts"]["rows"] == 16 and output.read_text() == before
    # so does a file written before --task.truncate_text: its task records the truncation id (13) alone
    meta = read_meta(output)
    assert (meta["task"].pop("truncate_text"), meta["task"]["truncate_token"]) == (".", 13)
    with open(f"{output}.meta.json", "w", encoding="utf-8") as f:
        json.dump(meta, f)
    assert run_label_generation(flags)["counts"]["rows"] == 16 and output.read_text() == before
    os.remove(f"{output}.meta.json")
    with pytest.raises(ValueError, match="not written by"):
        run_label_generation(flags)


def test_generate_extends_a_file_like_a_fresh_run_and_writes_raw_queries(world, tokenizer, tmp_path):
    extended, fresh = tmp_path / "extended.json", tmp_path / "fresh.json"
    common = ["--labeler", "vader", "--num_labels", "2", "--batch_size", "4", "--task.query_suffix", " So"]
    run_label_generation(generate_flags(world, extended, *common, "--num_queries", "5"))
    run_label_generation(generate_flags(world, extended, *common, "--num_queries", "7"))
    run_label_generation(generate_flags(world, fresh, *common, "--num_queries", "7"))
    assert read_rows(extended) == read_rows(fresh) and len(read_rows(fresh)) == 7
    assert read_meta(extended)["counts"] == read_meta(fresh)["counts"]
    # queries in OAI's data order, without the policy's suffix (the reward model never sees it, spec G4)
    task = books_task(query_dataset=world["corpus"], query_length=QUERY_LENGTH)
    expected = QueryStream(load_texts(world["corpus"]), tokenizer, task, 0, 1).next_batch(7)
    expected[expected == tokenizer.pad_token_id] = OAI_PAD_TOKEN
    assert [row["query"] for row in read_rows(fresh)] == expected.tolist()


def test_generate_unknown_labeler_fails_with_forms(world, tmp_path):
    with pytest.raises(ValueError, match="(?s)unknown --labeler 'gpt4'.*reward_model:DIR"):
        run_label_generation(generate_flags(world, tmp_path / "x.json", "--labeler", "gpt4"))
    assert not (tmp_path / "x.json").exists()


def run_generate(flags: list[str], answers: str) -> subprocess.CompletedProcess:
    """label_generation.py as a subprocess with `answers` piped to stdin."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(REPO / "label_generation.py"), *flags],
        input=answers,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_generate_human_labeler_stops_and_resumes(world, tmp_path):
    output = tmp_path / "human.json"
    flags = generate_flags(
        world, output, "--labeler", "human", "--num_queries", "4", "--num_labels", "3", "--batch_size", "3"
    )
    first = run_generate(flags, "x\n1\n0\nq\n")
    assert "Loading weights" not in first.stdout + first.stderr  # transformers' per-load bars are silenced
    assert "invalid answer 'x'" in first.stdout and "stopped: 2 of 4 rows" in first.stdout
    assert first.stdout.count("best response [0-2]") == 4  # 'x', '1', '0', 'q'
    rows = read_rows(output)
    assert [row["best"] for row in rows] == [1, 0] and not read_meta(output)["complete"]
    second = run_generate(flags, "2\n1\n")
    assert second.stdout.count("best response [0-2]") == 2 and "wrote 4 label rows" in second.stdout
    final = read_rows(output)
    assert final[:2] == rows and [row["best"] for row in final] == [1, 0, 2, 1]
    meta = read_meta(output)
    assert meta["complete"] and meta["counts"]["rows"] == 4 and meta["labeler"] == "human"
    assert all(passes_filter_and_is_truncated(row[f"sample{i}"]) for row in final for i in range(3))


# ---------------------------------------------------------------- convert


@pytest.fixture(scope="module")
def source_labels(tmp_path_factory, tokenizer, world):
    """OAI-style GPT-2 label rows of corpus text (re-encodes stably), PAD 50259, one sample with EOS."""
    path = tmp_path_factory.mktemp("convert") / "oai.json"
    with open(world["corpus"], encoding="utf-8") as f:
        lines = f.read().splitlines()[:12]
    rng = np.random.RandomState(0)

    def tokens(text: str, length: int) -> list[int]:
        ids = tokenizer.encode(text)[:length]
        return ids + [OAI_PAD_TOKEN] * (length - len(ids))

    rows = []
    for line in lines:
        first, second = line.split(". ", 1)
        samples = [tokens(" " + second.split()[j] + " the end.", RESPONSE_LENGTH) for j in range(4)]
        rows.append(
            {
                "query": tokens(first + ".", QUERY_LENGTH),
                **{f"sample{j}": s for j, s in enumerate(samples)},
                "best": int(rng.randint(4)),
            }
        )
    rows[0]["sample1"] = tokens(" so<|endoftext|>", RESPONSE_LENGTH)
    path.write_text(json.dumps(rows))
    return path


def convert_flags(source, target_dir, output, query_length=QUERY_LENGTH, response_length=RESPONSE_LENGTH):
    return [
        "convert",
        "--input",
        str(source),
        "--base_model",
        str(target_dir),
        "--output",
        str(output),
        "--task.query_length",
        str(query_length),
        "--task.response_length",
        str(response_length),
    ]


def decoded_rows(tokenizer, rows: list[dict], pad_id: int) -> list[list[str]]:
    """Every row's query and sample texts, PAD dropped."""
    fields = [k for k in rows[0] if k != "best"]
    return [[tokenizer.decode([t for t in row[k] if t != pad_id]) for k in fields] for row in rows]


def test_convert_gpt2_to_gpt2_keeps_tokens(source_labels, tiny_model_dir, tmp_path):
    output = tmp_path / "same.json"
    meta = run_label_generation(convert_flags(source_labels, tiny_model_dir, output))
    assert read_rows(output) == read_rows(source_labels)
    assert meta["pad_id"] == OAI_PAD_TOKEN and meta["counts"] == {
        "rows": 12,
        "truncated_queries": 0,
        "truncated_samples": 0,
    }


def test_convert_to_other_tokenizer_decodes_to_same_texts(source_labels, tokenizer, world, tmp_path):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    with open(world["corpus"], encoding="utf-8") as f:
        bpe.train_from_iterator(f.read().splitlines(), trainer)
    target_dir = tmp_path / "bpe"
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(target_dir)
    output = tmp_path / "bpe.json"
    meta = run_label_generation(convert_flags(source_labels, target_dir, output, 40, 24))
    target = label_generation.load_tokenizer(str(target_dir))
    assert meta["counts"]["truncated_queries"] == meta["counts"]["truncated_samples"] == 0
    converted, source = read_rows(output), read_rows(source_labels)
    assert [row["best"] for row in converted] == [row["best"] for row in source]
    assert converted[0]["query"] != source[0]["query"][:40]  # other ids
    assert decoded_rows(target, converted, OAI_PAD_TOKEN) == decoded_rows(tokenizer, source, OAI_PAD_TOKEN)
    labels = load_labels(str(output), 40, 24, target.pad_token_id, 12)
    assert labels.samples.max() < len(target)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_convert_gpt2_labels_to_a_family_with_bos_or_pad_eos(family, source_labels, tokenizer, tmp_path):
    # OAI's GPT-2 file -> the Llama stand-in (adds a BOS, no PAD) or the Qwen2 one (PAD = EOS): no BOS inside the
    # rows (model inputs get it), the target's own distinct PAD, the task's lengths, the same texts
    target_dir = archs.save_family(family, str(tmp_path / family))
    output = tmp_path / "converted.json"
    meta = run_label_generation(convert_flags(source_labels, target_dir, output, 40, 24))
    target = label_generation.load_tokenizer(target_dir)
    assert meta["counts"]["truncated_queries"] == meta["counts"]["truncated_samples"] == 0
    labels = load_labels(str(output), 40, 24, target.pad_token_id, 12)
    assert labels.query.shape == (12, 40) and labels.samples.shape == (12, 4, 24)
    tokens = torch.cat([labels.query.flatten(), labels.samples.flatten()])
    assert target.bos_token_id is None or not (tokens == target.bos_token_id).any()
    # the source's one sampled GPT-2 EOS, "<|endoftext|>", is Qwen2's EOS too, but plain text to Llama 3
    assert int((tokens == target.eos_token_id).sum()) == (1 if family == "qwen2" else 0)
    assert (labels.query[:, 0] != target.pad_token_id).all() and (labels.query == target.pad_token_id).any()
    assert target.pad_token_id != target.eos_token_id and tokens.max() <= target.pad_token_id
    converted, source = read_rows(output), read_rows(source_labels)
    assert [row["best"] for row in converted] == [row["best"] for row in source]
    pad = meta["pad_id"]
    assert decoded_rows(target, converted, pad) == decoded_rows(tokenizer, source, OAI_PAD_TOKEN)


def test_convert_takes_the_lengths_its_input_meta_records_unless_flags_give_them(
    source_labels, tiny_model_dir, tmp_path
):
    source = tmp_path / "short.json"
    shutil.copy(source_labels, source)
    (tmp_path / "short.json.meta.json").write_text(json.dumps({"task": {"query_length": 16, "response_length": 8}}))
    flags = ["convert", "--input", str(source), "--base_model", str(tiny_model_dir), "--output"]
    meta = run_label_generation([*flags, str(tmp_path / "a.json")])
    assert read_rows(tmp_path / "a.json") == read_rows(source_labels)  # not re-padded to the preset's 64 / 24
    assert meta["task"] == {"query_length": 16, "response_length": 8}
    meta = run_label_generation([*flags, str(tmp_path / "b.json"), "--task.query_length", "20"])
    assert meta["task"] == {"query_length": 20, "response_length": 8}  # a flag overrides, the other stays recorded
    (tmp_path / "short.json.meta.json").unlink()
    meta = run_label_generation([*flags, str(tmp_path / "c.json")])
    assert meta["task"] == {"query_length": 64, "response_length": 24}  # nothing recorded: the --task preset's


def test_convert_records_pad_when_50259_is_a_real_token(source_labels, tmp_path):
    target = gpt2_tokenizer_offline()
    target.add_tokens(["<x0>", "<x1>"])  # ids 50258, 50259: OAI's PAD id is a real token here
    target_dir = tmp_path / "wide"
    target.save_pretrained(target_dir)
    source = read_rows(source_labels)
    x1 = gpt2_tokenizer_offline().encode(" a <x1> b")  # plain BPE pieces in GPT-2, one added token in the target
    source[2]["sample3"] = x1 + [OAI_PAD_TOKEN] * (RESPONSE_LENGTH - len(x1))
    source_path = tmp_path / "with_x1.json"
    source_path.write_text(json.dumps(source))
    output = tmp_path / "wide.json"
    meta = run_label_generation(convert_flags(source_path, target_dir, output))
    assert meta["pad_id"] == target.pad_token_id == 50257
    rows = read_rows(output)
    assert 50259 in rows[2]["sample3"] and 50257 in rows[2]["sample3"]
    labels = load_labels(str(output), QUERY_LENGTH, RESPONSE_LENGTH, pad_id=-1, num_train=12)
    sample = labels.samples[2, 3].tolist()
    assert 50259 in sample and -1 in sample and 50257 not in sample
    _, _, file_pad = read_label_rows(str(output))
    assert file_pad == 50257


@pytest.mark.parametrize(
    "content, problem",
    [
        ({"query": [1, 2]}, "JSON list"),
        ([{"query": [1, 2], "sample": [3], "rating": 0.5}], "scalar_rating"),
        (
            [{"query": [1], "sample0": [3], "sample1": [4], "best": 0}, {"query": [1], "sample0": [3], "sample1": [4]}],
            "row 1 is missing field 'best'",
        ),
    ],
)
def test_convert_rejects_file_not_in_oai_schema(tmp_path, tiny_model_dir, content, problem):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(content))
    with pytest.raises(ValueError) as error:
        run_label_generation(convert_flags(bad, tiny_model_dir, tmp_path / "out.json"))
    message = str(error.value)
    assert problem in message and "OAI's schema" in message and "--input" in message
    assert not (tmp_path / "out.json").exists()


# ---------------------------------------------------------------- command line


def test_cli_subcommands_and_task_presets():
    argv = ["generate", "--task", "tldr", "--task.temperature", "0.3", "--labeler", "human"]
    args = label_generation.parse(argv)
    assert isinstance(args, label_generation.Generate) and args.task_id == "tldr" and args.labeler == "human"
    assert (args.task.query_length, args.task.truncate_text, args.task.temperature) == (500, "\n", 0.3)
    args = label_generation.parse(["convert", "--base_model", "m", "--task", "cnndm"])
    assert isinstance(args, label_generation.Convert)
    lengths, source = label_generation.convert_lengths(args)  # no .meta.json to read them from: the preset's
    assert (lengths.query_length, lengths.response_length, source) == (500, 75, "--task cnndm")
    assert args.source_tokenizer == "gpt2" and args.base_model == "m"
    with pytest.raises(SystemExit):
        label_generation.parse(["convert"])  # --base_model is required
