"""A new user's mistakes, typed as real command lines: each ends in one `error:` line that names the flag and a fix
that works (the fix is then run where that is cheap), and --dry_run checks the inputs and prints the settings."""

import dataclasses
import json
import shlex
import shutil

import pytest

import evaluate
import label_generation
import train_policy
import train_reward
import train_sft
from lm_human_preference_details import cli, ppo_plumbing
from lm_human_preference_details.labels import labels_meta_path
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm
from lm_human_preference_details.tokenizer import load_tokenizer
from tests.conftest import write_queries
from tests.planted import run_script
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


# ---------------------------------------------------------------- mistakes that would give numbers nobody should trust


def test_labels_of_the_other_books_task_stop_reward_training_and_name_the_task(tmp_path, tiny_model_dir, world, capsys):
    # descriptiveness labels (their .meta.json says so) would train a reward model recorded as sentiment's, which then
    # passes train_policy.py --task sentiment's task check: sentiment and descriptiveness share every task setting
    labels = write_label_rows(tmp_path / "labels.json", 32, 64, 24, meta=True)
    meta_path = labels_meta_path(labels)
    meta = json.loads(open(meta_path).read())
    open(meta_path, "w").write(json.dumps({**meta, "task_id": "descriptiveness"}))
    argv = reward_argv(tiny_model_dir, world, labels, tmp_path / "rm", "--dry_run")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert f"--label_dataset '{labels}' holds labels for --task descriptiveness" in line
    assert "labels.json.meta.json records task_id 'descriptiveness'" in line and "this run is --task sentiment" in line
    assert "pass --task descriptiveness" in line and "--labels.allow_task_mismatch" in line
    code, out, err = run_cli(train_reward, ["--task", "descriptiveness", *argv], capsys)
    assert code == 0 and "warning" not in out, err
    code, out, err = run_cli(train_reward, [*argv, "--labels.allow_task_mismatch"], capsys)
    assert code == 0 and "warning: --labels.allow_task_mismatch" in out and "records --task sentiment" in out, err
    # OAI's label files name their task by their folder
    argv = reward_argv(tiny_model_dir, world, "descriptiveness/offline_5k.json", tmp_path / "rm", "--dry_run")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert "holds labels for --task descriptiveness (one of OAI's descriptiveness label files)" in line


def test_temperature_that_makes_the_softmax_one_hot_is_refused_with_the_reason(tmp_path, tiny_model_dir, world, capsys):
    # at 1e-9 every best-of-4 row held four identical samples and the policy's KL reached 1.3e7 nats
    generate = ["generate", "--base_model", tiny_model_dir, "--task.query_dataset", world["queries"]]
    argv = [*generate, "--task.temperature", "1e-9", "--output", str(tmp_path / "labels.json")]
    line = one_error_line(*run_cli(label_generation, argv, capsys)[::2])
    assert "--task.temperature 1e-09 makes the softmax one-hot" in line and "becomes 1e+09 nats" in line
    assert "exp() underflows float32" in line and "Pass --task.temperature 0.0115 or more" in line
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--task.temperature", "0.01", "--dry_run")
    assert "--task.temperature 0.01 makes the softmax one-hot" in one_error_line(
        *run_cli(train_policy, argv, capsys)[::2]
    )
    code, _, err = run_cli(
        train_policy, [*argv, "--task.temperature", "0.0115", "--rewards.allow_task_mismatch"], capsys
    )
    assert code == 0, err
    assert not (tmp_path / "labels.json").exists() and not (tmp_path / "out").exists()


def test_files_that_are_not_utf8_name_the_file_the_line_and_the_flag(tmp_path, tiny_model_dir, world, capsys):
    queries = tmp_path / "latin1.txt"
    queries.write_bytes("A first line.\nLe café était fermé.\n".encode("latin-1"))
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", "--task.query_dataset", str(queries), "--dry_run")
    line = one_error_line(*run_cli(train_policy, argv, capsys)[::2])
    assert f"query dataset file '{queries}' is not UTF-8 text (byte 0xe9 at line 2, offset 20" in line
    assert "save it as UTF-8" in line and "--task.query_dataset" in line and "codec" not in line
    labels = tmp_path / "labels.json"
    labels.write_bytes(b'[{"query": "\xe9"}]')
    argv = reward_argv(tiny_model_dir, world, str(labels), tmp_path / "rm", "--dry_run")
    line = one_error_line(*run_cli(train_reward, argv, capsys)[::2])
    assert f"label file '{labels}' is not UTF-8 text (byte 0xe9 at line 1" in line and "--label_dataset" in line


LATIN1 = "Le café était fermé.".encode("latin-1")
"""a Latin-1 text: its byte 0xe9 (é) is not UTF-8"""


@pytest.mark.parametrize(
    "script, what, flag, name, content",
    [
        ("policy", "query dataset file", "--task.query_dataset", "texts.jsonl", b'{"text": "' + LATIN1 + b'"}\n'),
        (
            "policy",
            "query dataset file",
            "--task.query_dataset",
            "chats.jsonl",
            b'{"messages": [{"role": "user", "content": "' + LATIN1 + b'"}]}\n',
        ),
        (
            "reward",
            "label file",
            "--label_dataset",
            "pairs.jsonl",
            b'{"prompt": "a", "chosen": "' + LATIN1 + b'", "rejected": "b"}\n',
        ),
        ("sft", "SFT dataset file", "--dataset", "sft.jsonl", b'{"prompt": "a", "completion": "' + LATIN1 + b'"}\n'),
    ],
    ids=["query-texts", "query-chats", "text-pairs", "sft-rows"],
)
def test_every_jsonl_reader_names_a_file_that_is_not_utf8(
    tmp_path, tiny_model_dir, world, capsys, script, what, flag, name, content
):
    # every JSON Lines reader (query texts, prompt rows, text preference pairs, SFT rows): one line naming the file,
    # the bad byte's line and the flag, not a UnicodeDecodeError traceback
    path = tmp_path / name
    path.write_bytes(b'{"text": "A first line."}\n' + content if name == "texts.jsonl" else content)
    module = {"policy": train_policy, "reward": train_reward, "sft": train_sft}[script]
    if script == "policy":
        argv = policy_argv(tiny_model_dir, world, tmp_path / "out", flag, str(path))
    elif script == "reward":
        argv = reward_argv(tiny_model_dir, world, str(path), tmp_path / "rm", "--labels.type", "best_of_2")
    else:
        argv = ["--base_model", tiny_model_dir, flag, str(path), "--output_dir", str(tmp_path / "sft")]
    line = one_error_line(*run_cli(module, [*argv, "--dry_run"], capsys)[::2])
    bad_line = 2 if name == "texts.jsonl" else 1
    assert f"{what} '{path}' is not UTF-8 text (byte 0xe9 at line {bad_line}" in line, line
    assert flag in line and "save it as UTF-8" in line


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory, tiny_model_dir, world):
    """A finished 2-update policy run with a training-state checkpoint after each update; -> its argv and history."""
    output_dir = tmp_path_factory.mktemp("policy-run") / "run"
    sizes = ("--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--save_interval", "1", "--keep_checkpoints", "0")
    argv = policy_argv(tiny_model_dir, world, output_dir, *sizes)
    return argv, train_policy.main(train_policy.parse(argv))


def test_evaluate_policy_that_is_a_training_state_names_the_run_directory(policy_run, capsys):
    run_dir = policy_run[0][-1]
    for state in (f"{run_dir}/training_state/step1", f"{run_dir}/training_state"):
        line = one_error_line(*run_cli(evaluate, ["--policy", state, "--dry_run", "--num_queries", "8"], capsys)[::2])
        assert f"--policy '{state}' is a training-state checkpoint" in line and "reward" not in line
        assert f"pass the run's --output_dir '{run_dir}'" in line and "checkpoints/update{N}" in line
    code, _, err = run_cli(evaluate, ["--policy", run_dir, "--dry_run", "--num_queries", "8"], capsys)
    assert code == 0, err


def test_evaluate_base_model_other_than_the_runs_is_refused_unless_asked(policy_run, tiny_model_dir, world, capsys):
    run_dir = policy_run[0][-1]
    argv = ["--policy", run_dir, "--dry_run", "--num_queries", "8"]  # the run's 12 query texts
    line = one_error_line(*run_cli(evaluate, [*argv, "--base_model", world["reward"]], capsys)[::2])
    assert f"--base_model '{world['reward']}' is a reward model, not the language model a policy starts from" in line
    line = one_error_line(*run_cli(evaluate, [*argv, "--base_model", "gpt2"], capsys)[::2])
    assert f"--base_model 'gpt2' is not the base model of the training run (its args.json): '{run_dir}'" in line
    assert f"started from '{tiny_model_dir}'" in line and "Drop --base_model (the default is the run's)" in line
    code, out, err = run_cli(evaluate, [*argv, "--base_model", "gpt2", "--allow_base_model_mismatch"], capsys)
    assert code == 0 and "warning: --allow_base_model_mismatch: --base_model 'gpt2' is not" in out, err
    code, out, err = run_cli(evaluate, [*argv, "--base_model", f"{tiny_model_dir}/"], capsys)  # the same directory
    assert code == 0 and "warning" not in out, err
    # the help says what the default is: the run's base model
    code, out, _ = run_cli(evaluate, ["--help"], capsys)
    assert code == 0 and "None: the --base_model of the policy's training run (its args.json)" in " ".join(out.split())
    code, out, _ = run_cli(evaluate, ["--policy", run_dir, "--help"], capsys)
    assert f"(default: {tiny_model_dir})" in "".join(out.split()).replace("(default:", "(default: ")


def test_resumed_run_summary_takes_every_start_value_from_the_resume_point(policy_run, tmp_path, capsys):
    argv, history = policy_run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(argv[-1], resumed_dir)
    shutil.rmtree(resumed_dir / "training_state" / "step2")
    (resumed_dir / "summary.json").unlink()  # as a kill after update 0 leaves the run: no summary yet
    code, out, err = run_cli(train_policy, [*argv[:-1], str(resumed_dir), "--resume", "auto"], capsys)
    assert code == 0, err
    # the closing table: every start value is the resume point's, labelled so
    table = " ".join(out.split())
    assert (
        "1 of 2, resumed at update 1" in table
        and f"kl_coef (update 1 -> after 1) │ {history[1]['objective/kl_coef']:.4f}" in table
    )
    summary = json.loads((resumed_dir / "summary.json").read_text())
    assert summary["updates"] == {"first": 1, "last": 1, "of": 2} and summary["resumed"] is True
    # the score, KL and kl_coef at update 1 (the resume point), not the score of update 1 beside the kl_coef of update 0
    assert summary["objective/score"][0] == history[1]["objective/score"]
    assert summary["objective/kl"][0] == history[1]["objective/kl"]
    assert summary["kl_coef"][0] == history[1]["objective/kl_coef"] != 0.15
    assert summary["diverged"] is None


def test_huge_lr_run_is_reported_as_diverged_and_exits_with_status_3(tmp_path, tiny_model_dir, world, capsys):
    # --ppo.lr 0.3 throws the tiny policy 80 nats away from its reference policy at update 1, 67 at update 2
    sizes = ("--ppo.total_episodes", "24", "--ppo.batch_size", "8", "--ppo.lr", "0.3")
    limit = ("--rewards.adaptive_kl.target", "3", "--divergence_updates", "2")  # 30 nats, 2 updates in a row
    argv = policy_argv(tiny_model_dir, world, tmp_path / "out", *sizes, *limit)
    code, out, err = run_cli(train_policy, argv, capsys)
    assert code == cli.DIVERGED_EXIT_CODE == 3, err
    flat = " ".join(out.split())
    assert "diverged at update 2: objective/kl stayed above 30 nats (10 x the KL target 3) for 2 updates" in flat
    assert "Likely flags: --ppo.lr 0.3" in flat and "--rewards.kl_coef 0.15" in flat
    assert err.strip().splitlines()[-1].startswith("the run diverged at update 2")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["diverged"]["update"] == 2 and summary["updates"]["last"] == 2
    assert (tmp_path / "out" / "model.safetensors").exists()  # saved first: detection changes nothing the run does
    code, out, err = run_cli(train_policy, [*argv, "--overwrite_output_dir", "--allow_divergence"], capsys)
    assert code == 0 and "diverged at update 2" in " ".join(out.split()), err


# ---------------------------------------------------------------- --dry_run gives the real run's verdict

OWN_PROMPTS = [
    f"Tell me about {thing} in the {place}." for thing in ("the cat", "a dog") for place in ("garden", "city")
]
SCORE_LENGTH = "def score(queries, responses):\n    return [float(len(r)) for r in responses]\n"


@pytest.fixture(scope="module")
def own_files(tmp_path_factory) -> dict[str, str]:
    """A user's own prompt file (TRL's prompt-only rows: no TL;DR columns), text preference pairs and a reward."""
    root = tmp_path_factory.mktemp("own-files")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in OWN_PROMPTS * 4))
    pairs = [{"prompt": p, "chosen": " It is kind.", "rejected": " It is."} for p in OWN_PROMPTS * 2]
    (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    (root / "reward.py").write_text(SCORE_LENGTH)
    return {name: str(root / name) for name in ("prompts.jsonl", "pairs.jsonl", "reward.py")}


def verdict(script, argv: list[str], capsys) -> tuple[int, str | None]:
    """A run's exit code and its `error:` line (None when it ended well)."""
    code, _, err = run_cli(script, argv, capsys)
    return code, one_error_line(code, err) if code else None


PRESET_RUNS = [("train_reward", name) for name in train_reward.task_presets()]
PRESET_RUNS += [("train_policy", name) for name in train_policy.task_presets()]


@pytest.mark.slow
@pytest.mark.parametrize("script, preset", PRESET_RUNS)
def test_dry_run_gives_the_real_runs_verdict_for_every_preset_with_a_users_prompt_file(
    script, preset, own_files, tmp_path, tiny_model_dir, capsys
):
    # --task nplus_tldr's TL;DR --task.query_template names columns a user's prompt file lacks: the dry run said
    # "inputs checked", then the real run stopped at the query stream
    argv = ["--task", preset, "--base_model", tiny_model_dir, "--task.query_dataset", own_files["prompts.jsonl"]]
    argv += ["--task.query_length", "16", "--task.response_length", "8", "--output_dir", str(tmp_path / "run")]
    if script == "train_reward":
        argv += ["--label_dataset", own_files["pairs.jsonl"], "--labels.type", "best_of_2", "--labels.num_train", "8"]
        argv += ["--batch_size", "8", "--rollout_batch_size", "8", "--normalize_samples", "8"]
    else:
        argv += ["--rewards.trained_model", f"python:{own_files['reward.py']}:score", "--ppo.value_model", "None"]
        argv += ["--task.truncate_after", "2", "--ppo.total_episodes", "8", "--ppo.batch_size", "8"]
    module = {"train_reward": train_reward, "train_policy": train_policy}[script]
    dry = verdict(module, [*argv, "--dry_run"], capsys)
    assert dry == verdict(module, argv, capsys)
    if module.task_presets()[preset].task.query_template is not None:  # the TL;DR presets' template
        assert dry[1].startswith("error: --task.query_template names ['subreddit', 'title', 'post'], which ")
    else:
        assert dry == (0, None)


@pytest.mark.slow
def test_nplus_tldr_dry_run_on_a_users_prompt_file_stops_where_the_run_would(own_files, tmp_path, tiny_model_dir):
    argv = ["--task", "nplus_tldr", "--base_model", tiny_model_dir, "--task.query_dataset", own_files["prompts.jsonl"]]
    argv += ["--rewards.trained_model", f"python:{own_files['reward.py']}:score", "--ppo.value_model", "None"]
    argv += ["--task.query_length", "16", "--task.response_length", "8"]  # within the tiny model's context
    result = run_script("train_policy.py", *argv, "--dry_run", "--output_dir", str(tmp_path / "run"), check=False)
    assert result.returncode == 2 and "dry run: inputs checked" not in result.stdout
    assert result.stderr.splitlines()[0] == (
        f"error: --task.query_template names ['subreddit', 'title', 'post'], which --task.query_dataset "
        f"'{own_files['prompts.jsonl']}' does not have; its columns: ['prompt']."
    )


def test_dry_run_with_push_to_hub_and_no_hub_stops_as_the_run_does(
    own_files, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    # the run stops before its first update when --push_to_hub could not upload at the end; the dry run said nothing
    monkeypatch.setattr(ppo_plumbing, "hub_reachable", lambda: False)
    argv = ["--base_model", tiny_model_dir, "--task.query_dataset", own_files["prompts.jsonl"], "--push_to_hub"]
    argv += ["--rewards.trained_model", f"python:{own_files['reward.py']}:score", "--output_dir", str(tmp_path / "run")]
    argv += ["--task.query_length", "16", "--task.response_length", "8", "--task.truncate_after", "2"]
    argv += ["--ppo.total_episodes", "8", "--ppo.batch_size", "8"]
    dry = verdict(train_policy, [*argv, "--dry_run"], capsys)
    assert dry == verdict(train_policy, argv, capsys)
    assert dry[1] == "error: --push_to_hub needs the Hugging Face hub, which is unreachable; drop the flag"
