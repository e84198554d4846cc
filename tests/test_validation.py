"""Bad input is caught before anything is deleted, overwritten or trained, and non-finite values stop a run before it
saves: every row of the bad-input table of docs/reliability.md names a test here or in the test files it cites."""

import dataclasses
import errno
import json
import os
import re
import shutil

import pytest
import torch

import evaluate
import label_generation
import train_policy
import train_reward
from lm_human_preference_details import ppo_plumbing, validation
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import labels_meta_path, save_labels
from lm_human_preference_details.modeling import PolicyWithValueHead, RewardModel, check_model_dir, load_causal_lm
from lm_human_preference_details.settings import with_run
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import tiny_gpt2
from tests.planted import REPO, books_task, write_query_file
from tests.test_cli import run
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task

QUERY_LENGTH, RESPONSE_LENGTH = 16, 8
SAMPLES = range(4)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir, query_file):
    return save_reward_model(tmp_path_factory.mktemp("reward"), tiny_model_dir, tiny_task(query_file))


def tree(path) -> dict[str, bytes]:
    """Every file below `path` (relative name -> content): compares a directory before and after."""
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                files[os.path.relpath(full, path)] = f.read()
    return files


# ---------------------------------------------------------------- flags: one clear error before anything runs


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ppo.noptepochs", "0"], "--ppo.noptepochs must be an integer >= 1"),
        (["--log_interval", "0"], "--log_interval must be an integer >= 1"),
        (["--rollout_micro_batch_size", "0"], "--rollout_micro_batch_size must be an integer >= 1"),
        (["--rewards.adaptive_kl.target", "0"], "--rewards.adaptive_kl.target must be a finite number > 0"),
        (["--rewards.adaptive_kl.horizon", "0"], "--rewards.adaptive_kl.horizon must be an integer >= 1"),
        (["--ppo.batch_size", "0"], "--ppo.batch_size must be an integer >= 1"),
        (["--ppo.total_episodes", "0"], "--ppo.total_episodes must be an integer >= 1"),
        (["--ppo.lr", "0"], "--ppo.lr must be a finite number > 0"),
        (["--ppo.lr", "-1e-5"], "--ppo.lr must be a finite number > 0"),
        (["--rewards.kl_coef", "-0.1"], "--rewards.kl_coef must be a finite number >= 0"),
        (["--task.truncate_after", "24"], "no response can pass the filter: --task.truncate_after 24"),
        (["--task.response_length", "0"], "--task.response_length must be an integer >= 1"),
        (["--task.query_length", "-4"], "--task.query_length must be an integer >= 1"),
        (["--task.temperature", "0"], "--task.temperature must be a finite number > 0"),
        (["--task.temperature", "-0.7"], "--task.temperature must be a finite number > 0"),
        (["--task.temperature", "1e-9"], "--task.temperature 1e-09 makes the softmax one-hot"),
        (["--divergence_updates", "-1"], "--divergence_updates must be an integer >= 0"),
        (["--divergence_kl", "0"], "--divergence_kl must be a finite number > 0"),
    ],
)
def test_policy_flags_that_would_fail_late_or_mean_nothing_stop_first(tmp_path, flags, words):
    args = train_policy.parse([*flags, "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=re.escape(words)):
        train_policy.main(args)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--labels.num_train", "0"], "--labels.num_train must be an integer >= 1"),
        (["--labels.num_train", "20"], "less than one batch (--batch_size 32); lower --batch_size to a divisor of 20"),
        (["--rollout_batch_size", "0"], "--rollout_batch_size must be an integer >= 1"),
        (["--batch_size", "0"], "--batch_size must be an integer >= 1"),
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--task.temperature", "0"], "--task.temperature must be a finite number > 0"),
        (["--task.temperature", "0.005"], "--task.temperature 0.005 makes the softmax one-hot"),
        (["--task.response_length", "-1"], "--task.response_length must be an integer >= 1"),
    ],
)
def test_reward_flags_that_would_fail_late_or_mean_nothing_stop_first(tmp_path, flags, words):
    args = train_reward.parse([*flags, "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=re.escape(words)):
        train_reward.main(args)
    assert not (tmp_path / "out").exists()  # --labels.num_train 0 used to write an untrained model


def test_policy_task_other_than_the_reward_models_is_refused():
    # ppo_plumbing.check_reward_model_task stops the run (end to end: test_train_policy.py)
    task = books_task(query_dataset="q.txt")
    saved = dataclasses.asdict(dataclasses.replace(task, response_length=16))
    with pytest.raises(ValueError, match="response_length: reward model 16, policy 24"):
        ppo_plumbing.check_reward_model_task({"task": saved}, task, train_policy.RewardHParams(trained_model="rm"))


# ---------------------------------------------------------------- outputs never overwrite inputs


def test_policy_output_dir_equal_to_inside_or_containing_an_input_is_refused(tmp_path, tiny_model_dir, query_file):
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(query_file))
    before = tree(rm_dir)
    for output_dir, relation in ((rm_dir, "is"), (f"{rm_dir}/policy", "lies inside"), (tmp_path, "contains")):
        args = tiny_args(output_dir, tiny_model_dir, rm_dir, query_file)
        with pytest.raises(ValueError, match=f"--output_dir .* {relation} the input --rewards.trained_model"):
            train_policy.main(args)
    args = tiny_args(tiny_model_dir, tiny_model_dir, rm_dir, query_file)
    with pytest.raises(ValueError, match="--output_dir .* is the input --base_model"):
        train_policy.main(args)
    assert tree(rm_dir) == before


def test_reward_output_dir_equal_to_the_base_model_is_refused(tiny_model_dir):
    before = tree(tiny_model_dir)
    args = train_reward.parse(["--base_model", tiny_model_dir, "--output_dir", tiny_model_dir])
    with pytest.raises(ValueError, match="--output_dir .* is the input --base_model"):
        train_reward.main(args)
    assert tree(tiny_model_dir) == before


def test_label_generation_output_over_an_input_is_refused(tmp_path, tiny_model_dir):
    queries = write_query_file(tmp_path / "queries.txt", n=20)
    generate = ["generate", "--base_model", tiny_model_dir, "--task.query_dataset", str(queries)]
    with pytest.raises(ValueError, match="--output .* is the input --task.query_dataset"):
        label_generation.main(label_generation.parse([*generate, "--output", str(queries)]))
    with pytest.raises(ValueError, match="--output .* lies inside the input --base_model"):
        label_generation.main(label_generation.parse([*generate, "--output", f"{tiny_model_dir}/labels.json"]))
    labels = tmp_path / "labels.json"
    labels.write_text("[]")
    convert = ["convert", "--input", str(labels), "--base_model", tiny_model_dir, "--output", str(labels)]
    with pytest.raises(ValueError, match="--output .* is the input --input"):
        label_generation.main(label_generation.parse(convert))
    assert labels.read_text() == "[]" and not os.path.exists(f"{tiny_model_dir}/labels.json")


def test_non_writable_output_dir_is_one_line(tmp_path):
    # /proc refuses new files even to root (a chmod'ed directory does not stop root)
    with pytest.raises(validation.OutputError, match="--output_dir '/proc/lhpd-run' is not writable"):
        validation.check_writable_dir("/proc/lhpd-run", "--output_dir")
    (tmp_path / "file").write_text("x")
    with pytest.raises(validation.OutputError, match="is a file, not a directory"):
        validation.check_writable_dir(str(tmp_path / "file" / "run"), "--output_dir")
    validation.check_writable_dir(str(tmp_path / "new" / "run"), "--output_dir")
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the check leaves nothing behind
    with pytest.raises(validation.OutputError, match="--output_dir '/proc/lhpd-eval' is not writable"):
        evaluate.main(evaluate.parse(["--policy", str(tmp_path / "new"), "--output_dir", "/proc/lhpd-eval"]))


def test_generate_overwrite_keeps_the_old_labels_when_another_input_is_bad(tmp_path, tiny_model_dir, tokenizer):
    output = tmp_path / "labels.json"
    rows = [{"query": [1, 2], "sample0": [3], "sample1": [4], "best": 0}]
    save_labels(str(output), rows)
    meta = labels_meta_path(str(output))
    with open(meta, "w", encoding="utf-8") as f:
        json.dump({"label_type": "best_of_2"}, f)
    before = tree(tmp_path)
    argv = ["generate", "--base_model", tiny_model_dir, "--output", str(output), "--overwrite", "--num_labels", "2"]
    argv += ["--task.query_dataset", str(tmp_path / "typo.txt"), "--task.query_length", "8"]
    argv += ["--task.response_length", "4", "--task.truncate_after", "1", "--num_queries", "2", "--device", "cpu"]
    with pytest.raises(FileNotFoundError, match="typo.txt"):
        label_generation.main(label_generation.parse(argv))
    assert tree(tmp_path) == before  # used to delete the file and its metadata before reading the queries


# ---------------------------------------------------------------- label files against the base model's tokenizer


def write_labels(tmp_path, n: int = 32, **overrides) -> str:
    """n best-of-4 rows of 16-token queries and 8-token samples (plain GPT-2 ids) and a query corpus beside them."""
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "query": torch.randint(1, 50000, (QUERY_LENGTH,), generator=generator).tolist(),
            **{
                f"sample{k}": torch.randint(1, 50000, (RESPONSE_LENGTH,), generator=generator).tolist()
                for k in range(4)
            },
            "best": i % 4,
        }
        for i in range(n)
    ]
    for (row, field, position), token in overrides.get("tokens", {}).items():
        rows[row][field][position] = token
    path = tmp_path / "labels.json"
    path.write_text(json.dumps(rows))
    write_query_file(tmp_path / "queries.txt", n=40)
    return str(path)


def reward_args(tmp_path, model_dir: str, label_file: str) -> train_reward.Args:
    """A tiny in-process reward run over 32 labels."""
    task = books_task(query_dataset=str(tmp_path / "queries.txt"), query_length=QUERY_LENGTH)
    task.response_length = RESPONSE_LENGTH
    args = train_reward.Args(
        base_model=model_dir,
        label_dataset=label_file,
        task=task,
        labels=train_reward.LabelHParams(num_train=32),
        batch_size=16,
        rollout_batch_size=16,
        normalize_samples=16,
    )
    return with_run(args, output_dir=str(tmp_path / "rm"))


def test_label_token_ids_beyond_the_vocabulary_stop_before_training(tmp_path, tiny_model_dir):
    labels = write_labels(tmp_path, tokens={(5, "sample2", 3): 60000})
    with pytest.raises(ValueError, match="row 5 field 'sample2' has token 60000, outside the 50257-token vocabulary"):
        train_reward.main(reward_args(tmp_path, tiny_model_dir, labels))
    assert not (tmp_path / "rm").exists()  # used to fail with an IndexError at a late step


def test_labels_of_another_tokenizer_stop_reward_training(tmp_path, tiny_model_dir):
    labels = write_labels(tmp_path)
    with open(labels_meta_path(labels), "w", encoding="utf-8") as f:
        json.dump({"base_model": "EleutherAI/pythia-160m", "tokenizer_fingerprint": "0123abcd", "pad_id": 50259}, f)
    with pytest.raises(ValueError, match="tokenized for 'EleutherAI/pythia-160m' .* label_generation.py convert"):
        train_reward.main(reward_args(tmp_path, tiny_model_dir, labels))
    assert not (tmp_path / "rm").exists()


def test_query_dataset_empty_or_without_a_query_is_refused(tmp_path, tokenizer):
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no texts"):
        load_texts(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="start_text"):
        QueryStream(["no period here", "nor here"], tokenizer, books_task(), 0, 1).next_batch(1)


# ---------------------------------------------------------------- base model paths that are not a (finite) model


@pytest.mark.parametrize("problem", ["empty", "text_file", "truncated", "no_tokenizer"])
def test_base_model_path_that_is_not_a_model_is_one_clear_error(tmp_path, tiny_model_dir, problem):
    path = tmp_path / "model"
    if problem == "empty":
        path.mkdir()
        words = "has no config.json, so it is not a model"
    elif problem == "text_file":
        path.write_text("gpt2\n")
        words = "is a file, not a model directory"
    else:
        shutil.copytree(tiny_model_dir, path)
        if problem == "truncated":
            weights = path / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:-1000])
            words = "model.safetensors' is truncated"
        else:
            for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
                (path / name).unlink(missing_ok=True)
            words = "has no tokenizer files"
    args = train_reward.parse(["--base_model", str(path), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=words):
        train_reward.main(args)
    with pytest.raises(ValueError, match=words):
        check_model_dir(str(path), "--base_model", tokenizer=True)


def test_base_model_with_nan_weights_is_refused_at_load(tmp_path, tokenizer):
    model = tiny_gpt2()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[3, 4] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    with pytest.raises(ValueError, match=r"non-finite \(NaN or infinite\) weights in \['transformer.h.1.mlp.c_fc"):
        load_causal_lm(str(tmp_path / "nan"))


@pytest.mark.slow
def test_one_line_error_for_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("train_reward.py", "--base_model", str(tmp_path / "empty"), "--output_dir", str(tmp_path / "rm"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith("error: model directory") and "config.json" in result.stderr


# ---------------------------------------------------------------- non-finite values stop training before a save


def test_reward_model_with_nan_gain_is_refused_before_training(tmp_path, tiny_model_dir, query_file):
    rm_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(query_file))
    model = RewardModel.from_base(tiny_model_dir)
    with torch.no_grad():
        model.gain.fill_(float("nan"))
    metadata = json.loads((tmp_path / "reward" / "reward_model.json").read_text())
    shutil.rmtree(rm_dir)
    model.save(rm_dir, metadata)  # a NaN gain cannot fold into a classifier: saved as trunk + head, gain, bias
    load_tokenizer(tiny_model_dir).save_pretrained(rm_dir)
    with pytest.raises(ValueError, match=r"reward model .* non-finite \(NaN or infinite\) weights in \['gain'\]"):
        train_policy.main(tiny_args(tmp_path / "policy", tiny_model_dir, rm_dir, query_file))
    assert not (tmp_path / "policy").exists()


def test_policy_diverging_to_nan_weights_stops_before_it_is_saved(
    tmp_path, tiny_model_dir, reward_model_dir, query_file
):
    args = tiny_args(tmp_path / "policy", tiny_model_dir, reward_model_dir, query_file, lr=1e38)
    args.run.save_interval = 1
    with pytest.raises(ValueError, match=r"non-finite .*weights \(\d+ tensors\) at update 0") as error:
        train_policy.main(args)
    assert "gradients" in str(error.value) or "loss" in str(error.value)
    assert not os.path.exists(tmp_path / "policy" / "model.safetensors")  # used to be saved, then crash


def test_reward_training_divergence_names_the_step_and_saves_nothing(tmp_path, tiny_model_dir):
    args = reward_args(tmp_path, tiny_model_dir, write_labels(tmp_path))
    args.lr, args.normalize_samples = 1e38, 0
    with pytest.raises(ValueError, match=r"non-finite .* at reward training step [01]; stopped before saving"):
        train_reward.main(args)
    assert not os.path.exists(tmp_path / "rm" / "reward_model.json")


# ---------------------------------------------------------------- disk full while saving


def test_disk_full_while_saving_leaves_the_previous_save_and_nothing_partial(tmp_path, tiny_model_dir, monkeypatch):
    import lm_human_preference_details.modeling as modeling

    policy, tokenizer = PolicyWithValueHead(tiny_gpt2()), load_tokenizer(tiny_model_dir)
    args = with_run(train_policy.Args(), output_dir=str(tmp_path))
    ppo_plumbing.save_policy(policy, tokenizer, args, str(tmp_path))
    before = tree(tmp_path)

    def full_disk(tensors, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(modeling, "save_file", full_disk)
    with torch.no_grad():
        policy.value_head.bias.fill_(1.0)
    with pytest.raises(validation.OutputError, match="disk full; the previous files there are unchanged"):
        ppo_plumbing.save_policy(policy, tokenizer, args, str(tmp_path))
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- docs/reliability.md


def test_docs_bad_input_table_names_existing_tests():
    from tests.test_readme import defined_tests

    text = (REPO / "docs" / "reliability.md").read_text(encoding="utf-8")
    section = text.split("\n## Bad input and numerical faults\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    rows = [row for row in rows if not set(row) <= set("|- ")]
    assert len(rows) >= 25
    tests = defined_tests()
    for row in rows:
        names = re.findall(r"`(test_\w+)`", row.split("|")[-2])
        assert names and all(name in tests for name in names), row
