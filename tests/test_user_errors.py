"""A new user's mistakes, typed as real command lines: each ends in one `error:` line that names the flag and a fix
that works (the fix is then run where that is cheap), and --dry_run checks the inputs and prints the settings."""

import dataclasses
import json
import shlex

import pytest

import evaluate
import train_policy
import train_reward
from lm_human_preference_details import cli
from lm_human_preference_details.labels import labels_meta_path, load_labels
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import write_queries
from tests.test_train_policy import save_reward_model, tiny_task

pytestmark = pytest.mark.usefixtures("single_thread")


def run_cli(script, argv: list[str], capsys) -> tuple[int, str, str]:
    """`script`'s command line through cli.run as `python script.py ARGV` runs it; -> exit code, stdout, stderr."""
    capsys.readouterr()  # what the test printed before
    try:
        cli.run(script.main, script.parse, argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    """The `error:` line of a run that stopped on bad input (exit code 2, no traceback)."""
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[1] == "(run with --debug for the traceback)", err
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A query file, a reward model for the tiny task, and one with 12-token responses."""
    root = tmp_path_factory.mktemp("user-errors")
    queries = root / "queries.txt"
    write_queries(queries)
    task = tiny_task(str(queries))
    other = dataclasses.replace(task, response_length=12, query_suffix="\n\nTL;DR:")
    return {
        "queries": str(queries),
        "task": task,
        "reward": save_reward_model(root / "reward", tiny_model_dir, task),
        "other_reward": save_reward_model(root / "other_reward", tiny_model_dir, other),
    }


def policy_argv(tiny_model_dir: str, world: dict, output_dir, *extra: str) -> list[str]:
    """train_policy.py flags of the tiny task (16-token queries, 8-token responses)."""
    return [
        *("--base_model", tiny_model_dir, "--rewards.trained_model", world["reward"]),
        *("--task.query_dataset", world["queries"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "13"),
        *("--task.truncate_after", "2", *extra, "--output_dir", str(output_dir)),
    ]


def write_label_rows(path, n: int, query_length: int, response_length: int, meta: bool) -> str:
    """n best-of-4 rows of the given lengths, with a label_generation-style .meta.json recording them."""
    rows = [
        {"query": [100 + i] * query_length, **{f"sample{k}": [200 + k] * response_length for k in range(4)}, "best": 0}
        for i in range(n)
    ]
    path.write_text(json.dumps(rows))
    if meta:
        task = {"query_length": query_length, "response_length": response_length}
        open(labels_meta_path(str(path)), "w").write(json.dumps({"pad_id": 50259, "task": task}))
    return str(path)


def reward_argv(tiny_model_dir: str, world: dict, labels: str, output_dir, *extra: str) -> list[str]:
    """train_reward.py flags of a tiny run over 32 labels."""
    return [
        *("--base_model", tiny_model_dir, "--label_dataset", labels, "--task.query_dataset", world["queries"]),
        *("--labels.num_train", "32", "--batch_size", "16", "--rollout_batch_size", "16", *extra),
        *("--output_dir", str(output_dir)),
    ]


def test_evaluate_policy_that_is_a_reward_model_names_both_flags(world, capsys):
    line = one_error_line(*run_cli(evaluate, ["--policy", world["reward"]], capsys)[::2])
    assert f"--policy '{world['reward']}' holds a reward model" in line and "as --reward_model" in line


def test_policy_directory_as_reward_model_is_named(tmp_path, tiny_model_dir, world, capsys):
    policy_dir = tmp_path / "policy"
    PolicyWithValueHead(load_causal_lm(tiny_model_dir)).save(str(policy_dir), load_tokenizer(tiny_model_dir))
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--rewards.trained_model", str(policy_dir), "--dry_run")
    line = one_error_line(*run_cli(train_policy, argv, capsys)[::2])
    assert "holds a policy written by train_policy.py, not a reward model" in line
    assert "--output_dir of train_reward.py as --rewards.trained_model" in line


def test_nminibatches_that_does_not_divide_names_the_flag_and_the_values_that_do(
    tmp_path, tiny_model_dir, world, capsys
):
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--ppo.nminibatches", "3")
    line = one_error_line(*run_cli(train_policy, argv, capsys)[::2])
    assert "--ppo.nminibatches 3 does not divide the 512 episodes per process" in line
    assert "pass one of 1, 2, 4, 8, 16" in line
    code, out, _ = run_cli(train_policy, [*argv, "--ppo.nminibatches", "4", "--dry_run"], capsys)
    assert code == 0 and "128 x 4 per epoch" in out


def test_reward_model_of_other_task_settings_prints_flags_to_paste_or_takes_them(
    tmp_path, tiny_model_dir, world, capsys
):
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--rewards.trained_model", world["other_reward"])
    line = one_error_line(*run_cli(train_policy, [*argv, "--dry_run"], capsys)[::2])
    flags = line.split("Add its settings to the command: ")[1].split(" (or pass")[0]
    assert flags == "--task.query_suffix $'\\n\\nTL;DR:' --task.response_length 12"
    # the flags as bash passes them ($'\n' is a newline), then --rewards.task_from_reward_model: both run
    pasted = ["--task.query_suffix", "\n\nTL;DR:", "--task.response_length", "12"]
    assert shlex.split(flags.replace("$'\\n\\nTL;DR:'", "'x'"))[::2] == pasted[::2]
    code, out, err = run_cli(train_policy, [*argv, *pasted, "--dry_run"], capsys)
    assert code == 0, err
    code, out, err = run_cli(train_policy, [*argv, "--rewards.task_from_reward_model", "--dry_run"], capsys)
    assert code == 0 and "task from the reward model" in out and "response_length: 8 -> 12" in out, err


def test_dry_run_checks_inputs_prints_the_settings_and_sizes_for_8_processes(tmp_path, tiny_model_dir, world, capsys):
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--dry_run", "--dry_run_processes", "8")
    code, out, err = run_cli(train_policy, argv, capsys)
    assert code == 0, err
    for row in ("processes", "8"), ("episodes per update", "512 (64 per process)"), ("lr", "1e-05"):
        assert any(row[0] in line and row[1] in line for line in out.splitlines()), (row, out)
    for words in ("query 16, response 8 tokens", "adaptive to KL target 6", "seed 1", "data_seed 0", "inputs checked"):
        assert words in out
    assert not (tmp_path / "out").exists()
    line = one_error_line(*run_cli(train_policy, [*argv[:-2], "--task.query_dataset", "nope.txt"], capsys)[::2])
    assert "nope.txt" in line and "--task.query_dataset" in line
    line = one_error_line(*run_cli(train_policy, [*argv, "--dry_run_processes", "3"], capsys)[::2])
    assert "--ppo.batch_size 512 does not split over 3 processes" in line


def test_reward_dry_run_checks_the_label_file(tmp_path, tiny_model_dir, world, capsys):
    labels = write_label_rows(tmp_path / "labels.json", 24, 64, 24, meta=False)
    argv = reward_argv(tiny_model_dir, world, labels, tmp_path / "rm", "--dry_run", "--dry_run_processes", "8")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert "24 rows but num_train is 32; lower --labels.num_train" in line
    code, out, err = run_cli(train_reward, [*argv, "--labels.num_train", "16"], capsys)
    assert code == 0 and "16 (2 per process)" in out and "best_of_4" in out and "24 label rows" in out, err
    assert not (tmp_path / "rm").exists()
    # the truncation text must be one token of the base model's tokenizer, as the real run checks
    line = one_error_line(
        *run_cli(train_reward, [*argv, "--labels.num_train", "16", "--task.truncate_text", "TL;DR:"], capsys)[::2]
    )
    assert "--task.truncate_text 'TL;DR:' must be exactly one token" in line


def test_label_file_of_other_lengths_names_the_lengths_its_meta_records(tmp_path, tiny_model_dir, world, capsys):
    labels = write_label_rows(tmp_path / "labels.json", 32, 16, 12, meta=True)
    argv = reward_argv(tiny_model_dir, world, labels, tmp_path / "rm", "--dry_run")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert "queries of 16 tokens and responses of 12 (as its labels.json.meta.json records)" in line
    assert "pass --task.query_length 16 --task.response_length 12" in line
    code, _, err = run_cli(train_reward, [*argv, "--task.query_length", "16", "--task.response_length", "12"], capsys)
    assert code == 0, err


def test_mistyped_relative_label_path_is_a_missing_file_not_a_download(tmp_path, tiny_model_dir, world, capsys):
    argv = reward_argv(tiny_model_dir, world, "labls/labels.json", tmp_path / "rm", "--dry_run")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert "label file 'labls/labels.json' does not exist in" in line and "fix the path of --label_dataset" in line


def test_json_lines_preference_pairs_name_the_expected_schema(tmp_path):
    pairs = [{"prompt": "Hi", "chosen": " there", "rejected": " go"}, {"prompt": "A", "chosen": "b", "rejected": "c"}]
    (tmp_path / "pairs.jsonl").write_text("\n".join(map(json.dumps, pairs)) + "\n")
    with pytest.raises(ValueError) as error:
        load_labels(str(tmp_path / "pairs.jsonl"), 16, 8, pad_id=50257, num_train=1)
    message = str(error.value)
    assert "JSON Lines of text preference pairs (prompt, chosen, rejected" in message and "Extra data" not in message
    assert '"sample0": [ids]' in message and "--labels.type best_of_2" in message
    # the fix: one best_of_2 row per pair, tokens padded to the lengths, loads
    row = {"query": [1] * 16, "sample0": [2] * 8, "sample1": [3] * 8, "best": 0}
    (tmp_path / "pairs.json").write_text(json.dumps([row]))
    assert len(load_labels(str(tmp_path / "pairs.json"), 16, 8, 50257, 1, "best_of_2")) == 1
