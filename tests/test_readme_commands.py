"""Every shell command in README.md's code blocks is run by a test or by CI, and its flags are the scripts' own."""

import importlib.util
import re
import shlex

import pytest
import tyro

import evaluate
import train_policy
import train_reward
from tests.planted import REPO
from tests.test_readme import defined_tests

README = REPO / "README.md"

# README command (its words, quotes and comments dropped) -> the test that runs it: the same script and flags, on tiny
# models, with --dry_run or DRY_RUN=1, or the same code path (commands that CI runs need no entry)
RUN_BY_TESTS = {
    "make demo": "test_run_demo_quick_raises_gold_score",
    "accelerate launch --num_processes 8 train_reward.py --task sentiment --output_dir models/sentiment_reward": (
        "test_dry_run_prints_the_sizes_and_touches_nothing"
    ),
    "accelerate launch --num_processes 8 train_policy.py --task sentiment --rewards.trained_model "
    "models/sentiment_reward --output_dir models/sentiment_policy --track": (
        "test_sentiment_policy_command_passes_the_scripts_dry_run"
    ),
    "python train_policy.py --task sentiment --rewards.trained_model models/sentiment_reward "
    "--ppo.gradient_accumulation_steps 8": "test_one_two_and_four_processes_log_oai_eight_rank_whitening",
    "python train_policy.py --task sentiment --rewards.trained_model models/sentiment_reward --dry_run "
    "--dry_run_processes 8": "test_dry_run_checks_inputs_prints_the_settings_and_sizes_for_8_processes",
    "python train_both.py --task sentiment --output_dir runs/sentiment": (
        "test_pipeline_runs_on_the_demo_world_and_resumes_after_a_kill"
    ),
    "accelerate launch --num_processes 8 train_policy.py --task sentiment --rewards.trained_model "
    "models/sentiment_reward --tf32 --compile_sampler": (
        "test_compiled_decoding_samples_exactly_what_eager_decoding_samples"
    ),
    "python benchmark/policy_throughput.py --model gpt2-124m --updates 3": (
        "test_ppo_update_stays_within_the_host_sync_budget"
    ),
    "python benchmark/gpu_check.py": (
        "test_quick_check_on_cpu_reports_every_row_and_a_failing_step_without_stopping_the_others"
    ),
    "python demo/run_demo.py --quick --reward vader": "test_run_demo_reward_flag_trains_straight_against_that_reward",
    "python train_policy.py --task sentiment --base_model EleutherAI/pythia-410m --rewards.trained_model vader "
    "--lora.rank 8": "test_lora_on_each_family_against_vader_trains_only_adapters_and_saves_a_merged_model",
    "python label_generation.py sample --task sentiment --num_queries 500 --output labels/candidates.json": (
        "test_sample_writes_the_rows_generate_labels"
    ),
    "python label_generation.py serve --candidates labels/candidates.json --output labels/human.json": (
        "test_sigkill_in_the_middle_of_labeling_loses_no_confirmed_judgement"
    ),
    "python label_generation.py agreement --judgements labels/human.json.judgements.jsonl": (
        "test_agreement_command_prints_the_figures"
    ),
    "bash benchmark/oai_sentiment.sh": "test_shell_file_flags_are_accepted_by_the_scripts",
    "bash benchmark/oai_descriptiveness.sh": "test_shell_file_flags_are_accepted_by_the_scripts",
    "bash benchmark/oai_tldr.sh": "test_shell_file_flags_are_accepted_by_the_scripts",
    "bash benchmark/oai_cnndm.sh": "test_shell_file_flags_are_accepted_by_the_scripts",
    "python evaluate.py --policy models/sentiment_policy --gold vader": (
        "test_evaluate_command_writes_results_and_the_gold_vs_kl_plot"
    ),
    "python benchmark/compare.py --runs ours=models/oai_sentiment/seed*/train_policy --output_dir compare/sentiment": (
        "test_cli_offline_on_tensorboard_and_csv_runs"
    ),
}
CPU_TORCH = "python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
"""README's CPU-only torch install: PyTorch's index is out of CI's reach, so CI installs the same CPU build of the same
version from its own registry (`.ci/run`), and a test checks that the versions agree"""
SHELL_FENCES = ("bash", "sh", "shell", "console")


def shell_commands(markdown: str) -> list[str]:
    """The commands of the shell code blocks of `markdown`: continuation lines joined, comments and quotes dropped."""
    commands = []
    for language, body in re.findall(r"^```(\w*)\n(.*?)^```", markdown, re.MULTILINE | re.DOTALL):
        if language not in SHELL_FENCES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(" ".join(words))
    return commands


def makefile_recipes() -> dict[str, list[str]]:
    """Makefile target -> its prerequisites' recipe lines, then its own, with $(PYTHON) as python3."""
    targets, current = {}, None
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([\w-]+):(.*)$", line)
        if rule and not line.startswith("\t"):
            current = rule[1]
            targets[current] = {"needs": rule[2].split(), "lines": []}
        elif line.startswith("\t") and current:
            targets[current]["lines"].append(line.strip().replace("$(PYTHON)", "python3"))

    def expand(target: str) -> list[str]:
        return [line for need in targets[target]["needs"] for line in expand(need)] + targets[target]["lines"]

    return {target: expand(target) for target in targets}


def ci_commands() -> set[str]:
    """Every command CI runs: the lines of .ci/run, and the recipes of the make targets it calls."""
    recipes, commands = makefile_recipes(), set()
    for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        commands.add(" ".join(words))
        if words[0] == "make":
            commands.update(" ".join(shlex.split(recipe)) for recipe in recipes[words[1]])
    return commands


def test_shell_commands_are_read_as_a_user_types_them():
    text = '```bash\nmake demo   # a comment\n# only a comment\npython x.py --a "b c" \\\n    --d e\n```\n'
    text += "```python\nprint('not a shell command')\n```\n"
    assert shell_commands(text) == ["make demo", "python x.py --a b c --d e"]
    recipes = makefile_recipes()
    install = 'python3 -m pip install -e ".[test]"'
    assert recipes["test"] == [install, 'python3 -m pytest -n 2 --dist loadfile -m "not slow and not e2e_slow"']
    assert recipes["test-e2e-slow"] == [install, 'python3 -m pytest -n 2 --dist loadfile -m "slow or e2e_slow"']
    assert {"make test", "python3 -m pytest -n 2 --dist loadfile -m not slow and not e2e_slow"} <= ci_commands()
    assert {"make test-e2e-slow", "python3 -m pytest -n 2 --dist loadfile -m slow or e2e_slow"} <= ci_commands()


def test_every_readme_command_is_run_by_a_test_or_by_ci():
    commands, ci, tests = shell_commands(README.read_text(encoding="utf-8")), ci_commands(), defined_tests()
    assert len(commands) >= 10, commands
    uncovered = [command for command in commands if command not in ci | {CPU_TORCH} and command not in RUN_BY_TESTS]
    assert not uncovered, (
        "README.md commands that no test and no CI step runs (add each to RUN_BY_TESTS in "
        "tests/test_readme_commands.py with the test that runs it):\n" + "\n".join(uncovered)
    )
    missing = {command: test for command, test in RUN_BY_TESTS.items() if test not in tests}
    assert not missing, f"RUN_BY_TESTS names tests that do not exist: {missing}"
    stale = sorted(set(RUN_BY_TESTS) - set(commands))
    assert not stale, f"RUN_BY_TESTS lists commands that README.md no longer has: {stale}"


def compare_args(flags: list[str]):
    """benchmark/compare.py's flags through its own parser."""
    spec = importlib.util.spec_from_file_location("compare_cli", REPO / "benchmark" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tyro.cli(module.Args, args=flags, use_underscores=True)


PARSERS = {
    "train_reward.py": train_reward.parse,
    "train_policy.py": train_policy.parse,
    "evaluate.py": evaluate.parse,
    "benchmark/compare.py": compare_args,
}


def test_readme_script_commands_parse_with_the_scripts_own_parsers():
    parsed = 0
    for command in shell_commands(README.read_text(encoding="utf-8")):
        words = command.split(" ")
        script = next((word for word in words if word in PARSERS), None)
        flags = words[words.index(script) + 1 :] if script else []
        if script is None or "--help" in flags:
            continue
        try:
            PARSERS[script](flags)
        except SystemExit as exit:  # tyro exits on an unknown flag or value
            pytest.fail(f"README.md: `{command}` does not parse: exit {exit.code}")
        parsed += 1
    assert parsed >= 6


def test_readme_cpu_torch_is_the_version_ci_installs():
    assert CPU_TORCH in shell_commands(README.read_text(encoding="utf-8"))
    torch = next(word for word in CPU_TORCH.split() if word.startswith("torch=="))
    assert f"python3 -m pip install --quiet {torch}" in ci_commands()
