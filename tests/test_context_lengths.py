"""Every model's context holds the tokens it reads, checked at the start of every script, in the real run and the dry
run alike: one `error:` line naming the flags (it used to be an IndexError deep in sampling, after `--dry_run` had
said "inputs checked"). The policy reads prefix ⊕ query ⊕ suffix ⊕ response but its last token, a reward model the
raw query ⊕ response with its own BOS, a critic the policy's tokens with its own BOS."""

import json
import os

import pytest

from lm_human_preference_details import validation
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm
from lm_human_preference_details.nplus.critic import Critic
from lm_human_preference_details.tasks import TASKS
from lm_human_preference_details.tokenizer import tokenizer_fingerprint
from tests import archs
from tests.conftest import tiny_gpt2, write_queries
from tests.planted import books_task, run_script
from tests.test_train_policy import save_reward_model
from tests.test_user_errors import write_label_rows

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXT = 16
"""n_positions of the small models"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """Tiny GPT-2s with a 16-token and a 256-token context, reward models on each, a critic and a policy on the small
    one, a query file, and label files of 8 rows of 8-token queries and 8- or 9-token samples."""
    root = tmp_path_factory.mktemp("context")
    paths = {"queries": write_queries(root / "queries.txt")}
    for name, positions in (("small", CONTEXT), ("big", 256)):
        paths[name] = str(root / name)
        tiny_gpt2(n_positions=positions).save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
        paths[f"reward_{name}"] = save_reward_model(root / f"reward_{name}", paths[name], books_task())
    critic = Critic(load_causal_lm(paths["small"]).base_model)
    critic.metadata = {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    critic.save(str(root / "critic"))
    paths["critic"] = str(root / "critic")
    paths["policy"] = str(root / "policy")
    PolicyWithValueHead(load_causal_lm(paths["small"])).save(paths["policy"], tokenizer)
    for response_length in (8, 9):
        labels = root / f"labels_{response_length}.json"
        paths[f"labels_{response_length}"] = write_label_rows(labels, 8, 8, response_length, meta=True)
    return paths


def task_flags(world: dict, query_length: int, response_length: int) -> list[str]:
    """The tiny task's flags: the test queries, no trimming, truncation at '.' (13) after 2 tokens."""
    return [
        *("--task.query_dataset", world["queries"], "--task.start_text", "None", "--task.end_text", "None"),
        *("--task.truncate_token", "13", "--task.truncate_after", "2"),
        *("--task.query_length", str(query_length), "--task.response_length", str(response_length)),
    ]


def policy_flags(world: dict, base: str, reward: str, output_dir, *extra: str) -> list[str]:
    """train_policy.py: one update of 8 episodes; the reward models were trained for another task (allowed)."""
    return [
        *("--base_model", world[base], "--rewards.trained_model", world[reward], "--rewards.allow_task_mismatch"),
        *("--ppo.total_episodes", "8", "--ppo.batch_size", "8", "--output_dir", str(output_dir), *extra),
    ]


def script_flags(script: str, world: dict, tmp_path, response_length: int) -> list[str]:
    """Each script's flags on the small model (the lengths are added by the caller)."""
    if script == "train_policy.py":
        return policy_flags(world, "small", "reward_big", tmp_path / "out")
    if script == "train_reward.py":
        labels = world[f"labels_{response_length}"]  # rows of the run's lengths
        return [
            *("--base_model", world["small"], "--label_dataset", labels, "--labels.num_train", "8"),
            *("--batch_size", "8", "--rollout_batch_size", "8", "--normalize_samples", "8"),
            *("--output_dir", str(tmp_path / "out")),
        ]
    if script == "label_generation.py":
        return [
            *("generate", "--base_model", world["small"], "--labeler", f"reward_model:{world['reward_big']}"),
            *("--num_queries", "2", "--output", str(tmp_path / "out" / "labels.json")),
        ]
    return [
        *("--policy", world["policy"], "--base_model", world["small"], "--reward_model", world["reward_big"]),
        *("--num_queries", "2", "--output_dir", str(tmp_path / "out")),
    ]


def the_error_line(result) -> str:
    """The one `error:` line of a run that stopped on bad input: exit code 2, no traceback."""
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


# ---------------------------------------------------------------- every script, the real run and the dry run


# the longest lengths that fit the 16-token context, one token more, and what the message says: the policy and
# the base models read query + response - 1 tokens; train_reward.py's reward model reads query + response
AT_THE_LIMIT = {
    "train_policy.py": ((8, 9), (8, 10), "17 tokens exceed the context of the policy (--base_model"),
    "train_reward.py": ((8, 8), (8, 9), "17 tokens exceed the context of the reward model (--base_model"),
    "label_generation.py": ((8, 9), (8, 10), "17 tokens exceed the context of the base model (--base_model"),
    "evaluate.py": ((8, 9), (8, 10), "17 tokens exceed the context of the base model (--base_model"),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(AT_THE_LIMIT))
def test_each_script_checks_the_task_against_the_models_context_at_start(script, world, tmp_path):
    fits, beyond, words = AT_THE_LIMIT[script]
    # exactly at the limit: no false alarm (train_policy.py trains at it: the sampler really reads that many)
    at_limit = [*script_flags(script, world, tmp_path, fits[1]), *task_flags(world, *fits)]
    run_script(script, *at_limit, *([] if script == "train_policy.py" else ["--dry_run"]))
    # one token more: one line naming the flags, in the dry run and the real run alike, before anything is written
    flags = [*script_flags(script, world, tmp_path, beyond[1]), *task_flags(world, *beyond)]
    for dry_run in (["--dry_run"], []):
        line = the_error_line(run_script(script, *flags, *dry_run, check=False))
        assert words in line and f"n_positions {CONTEXT}); lower --task.query_length or" in line, line
        assert line.endswith("by 1 token in all, or pass --base_model a model with a longer context."), line
    if script != "train_policy.py":
        assert not os.path.exists(tmp_path / "out")


def test_the_message_gives_the_sum_each_term_and_the_fix(world, tokenizer):
    task = books_task(query_length=64, response_length=24)
    with pytest.raises(ValueError) as error:
        validation.check_sampling_context(task, tokenizer, world["small"])
    assert str(error.value) == (
        "--task.query_length 64 + --task.response_length 24 - 1 (the last response token, which no forward reads) = "
        f"87 tokens exceed the context of the base model (--base_model '{world['small']}': n_positions 16); lower "
        "--task.query_length or --task.response_length by 71 tokens in all, or pass --base_model a model with a longer "
        "context."
    )


# ---------------------------------------------------------------- the policy run's other models


SCORERS = {
    # a reward model, a critic directory and a gold judge with a 16-token context beside a policy with 256
    "reward": (["--rewards.trained_model", "reward_small"], "the reward model (--rewards.trained_model '"),
    "critic": (["--ppo.value_model", "critic"], "the critic (--ppo.value_model '"),
    "gold": (["--rewards.gold_model", "reward_small"], "the gold judge (--rewards.gold_model 'reward_model:"),
}


@pytest.mark.slow
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "run"])
@pytest.mark.parametrize("scorer", list(SCORERS))
def test_a_reward_model_critic_or_gold_judge_with_a_shorter_context_than_the_policy_names_its_flag(
    scorer, dry_run, world, tmp_path
):
    (flag, name), words = SCORERS[scorer]
    value = f"reward_model:{world[name]}" if scorer == "gold" else world[name]
    reward = name if scorer == "reward" else "reward_big"
    # the policy (256) reads 8 + 9 - 1 = 16 tokens, the reward model and gold judge 8 + 9 = 17, the critic 8 + 10 - 1
    lengths = (8, 10) if scorer == "critic" else (8, 9)
    flags = [*policy_flags(world, "big", reward, tmp_path / "out", *([flag, value] if scorer != "reward" else []))]
    flags += task_flags(world, *lengths) + (["--dry_run"] if dry_run else [])
    line = the_error_line(run_script("train_policy.py", *flags, check=False))
    assert f"= 17 tokens exceed the context of {words}" in line and f"n_positions {CONTEXT})" in line, line
    assert line.endswith(f"by 1 token in all, or pass {flag} a model with a longer context."), line


def test_label_generation_and_evaluate_check_a_reward_model_labeler_or_judge(world, tokenizer):
    task = books_task(query_length=8, response_length=9)  # a reward model reads 17 tokens, the policies 16
    small = f"reward_model:{world['reward_small']}"
    with pytest.raises(ValueError, match=r"= 17 tokens exceed the context of the labeler \(--labeler 'reward_model:"):
        validation.check_sampling_context(task, tokenizer, world["big"], small)
    with pytest.raises(ValueError, match=r"= 17 tokens exceed the context of the gold judge \(--gold 'reward_model:"):
        validation.check_evaluate_context(task, tokenizer, world["big"], [], world["reward_big"], small)
    with pytest.raises(ValueError, match=r"= 17 tokens exceed the context of the reward model \(--reward_model '"):
        validation.check_evaluate_context(task, tokenizer, world["big"], [], world["reward_small"], None)
    with pytest.raises(ValueError, match=r"= 17 tokens exceed the context of the policy \(--checkpoints '"):
        task = books_task(query_length=8, response_length=10)
        checkpoints = [("--policy", world["big"]), ("--checkpoints", world["policy"])]
        validation.check_evaluate_context(task, tokenizer, world["big"], checkpoints, world["reward_big"], None)
    # scorers that encode the text again (and cut it) are not checked here
    for other in ("vader", f"classifier:{world['small']}", f"sequence_classifier:{world['small']}"):
        validation.check_sampling_context(books_task(query_length=8, response_length=9), tokenizer, world["big"], other)


# ---------------------------------------------------------------- the arithmetic: BOS, prefix, suffix


def config_dir(path, positions: int, field: str = "n_positions") -> str:
    """A directory holding only a config.json with the given context (all the check reads)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"model_type": "gpt2" if field == "n_positions" else "llama", field: positions}, f)
    return str(path)


# (tokenizer family, what the model reads, its own BOS, tokens it reads): 10-token queries, 5-token responses; GPT-2's
# '\n\nTL;DR:' is 6 tokens and 'Article:\n\n' 3; the Llama-like tokenizer puts a BOS in front of every context
ARITHMETIC = [
    ("gpt2", "context", False, 10 + 5 - 1),
    ("gpt2", "episode", False, 10 + 5),
    ("gpt2", "context+affixes", False, 3 + 10 + 6 + 5 - 1),
    ("gpt2", "critic+affixes", True, 3 + 10 + 6 + 5 - 1 + 1),
    ("gpt2", "episode+affixes", True, 10 + 5 + 1),
    ("llama", "context", False, 1 + 10 + 5 - 1),
    ("llama", "critic", True, 1 + 10 + 5 - 1 + 1),
    ("llama", "episode", True, 10 + 5 + 1),
]


@pytest.mark.parametrize("family, reads, bos, length", ARITHMETIC)
def test_the_check_counts_bos_prefix_suffix_and_the_unread_last_token(family, reads, bos, length, tmp_path, tokenizer):
    tok = tokenizer if family == "gpt2" else archs.family_tokenizer(family)
    affixes = {"query_prefix": "Article:\n\n", "query_suffix": "\n\nTL;DR:"} if reads.endswith("+affixes") else {}
    task = books_task(query_length=10, response_length=5, **affixes)
    field = "n_positions" if family == "gpt2" else "max_position_embeddings"
    kind = reads.removesuffix("+affixes")

    def check(positions: int) -> None:
        directory = config_dir(tmp_path / str(positions), positions, field)
        reader = validation.ContextReader("the model", "--flag", "--flag 'm'", directory, kind, bos)
        validation.check_context_lengths([reader], task, tok)

    check(length)  # exactly at the limit
    with pytest.raises(ValueError, match=rf"= {length} tokens exceed the context of the model \(--flag 'm': {field}"):
        check(length - 1)


def test_the_presets_fit_gpt2_and_tldr_needs_its_suffix_counted(tmp_path, tokenizer):
    gpt2 = config_dir(tmp_path / "gpt2", 1024)
    for task in TASKS.values():  # OAI's tasks on GPT-2's 1024 positions: 64 + 24 and 500 + 75 (+ affixes)
        validation.check_sampling_context(task, tokenizer, gpt2)
    # tldr reads 500 + 6 ('\n\nTL;DR:') + 75 - 1 = 580 tokens
    validation.check_sampling_context(TASKS["tldr"], tokenizer, config_dir(tmp_path / "580", 580))
    with pytest.raises(ValueError, match=r"\+ 6 tokens of --task.query_suffix .* = 580 tokens .* \(or shorten"):
        validation.check_sampling_context(TASKS["tldr"], tokenizer, config_dir(tmp_path / "579", 579))
