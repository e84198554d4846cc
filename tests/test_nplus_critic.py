"""A separate critic (--ppo.value_model, nplus N16): its values at the response positions, the rollout's values, one
optimizer over policy and critic, its save, reload and resume, and the errors that name the flag."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train_policy
from lm_human_preference_details import checkpoint
from lm_human_preference_details.modeling import PolicyWithValueHead, RewardModel
from lm_human_preference_details.nplus import critic as nplus_critic
from lm_human_preference_details.nplus.critic import Critic, PolicyWithCritic
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.resume_check import final_training_state, max_weight_difference
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests.conftest import tiny_gpt2, write_queries
from tests.planted import REPO, run_script, script_env

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """A query file and a reward model with a gain and bias (the normalization) for a tiny policy task."""
    root = tmp_path_factory.mktemp("critic-world")
    queries = write_queries(root / "queries.txt")
    task = dataclasses.replace(
        train_policy.task_presets()["sentiment"].task,
        query_dataset=queries,
        query_length=16,
        response_length=8,
        start_text=None,
        end_text=None,
        truncate_token=None,
        truncate_text=None,
        truncate_after=0,
    )
    return {"queries": queries, "reward": save_normalized_reward_model(root / "reward", tiny_model_dir, task)}


def save_normalized_reward_model(path, model_dir: str, task, **metadata) -> str:
    """A random reward model on the tiny trunk with gain 1.7 and bias -0.3, saved as train_reward.py saves one."""
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(1)
    model = RewardModel.from_base(model_dir)
    with torch.no_grad():
        model.gain.fill_(1.7)
        model.bias.fill_(-0.3)
    info = {
        "base_model": model_dir,
        "tokenizer": model_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "task": dataclasses.asdict(task),
        "task_name": "sentiment",
        **metadata,
    }
    model.save(str(path), info)
    tokenizer.save_pretrained(str(path))
    return str(path)


def run_flags(model_dir: str, world: dict, output_dir, *extra: str) -> list[str]:
    """A tiny run with a critic from the reward model: 2 updates of 8 episodes, a checkpoint after each."""
    return [
        *("--base_model", model_dir, "--rewards.trained_model", world["reward"], "--ppo.value_model", "reward"),
        *("--task.query_dataset", world["queries"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "None"),
        *("--task.truncate_after", "0", "--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--ppo.lr", "1e-3"),
        *("--ppo.noptepochs", "2", "--save_interval", "1", "--log_interval", "100", "--print_samples", "1"),
        *extra,
        *("--output_dir", str(output_dir)),
    ]


def episodes(pad_id: int, context_length: int = 6, response_length: int = 5) -> torch.Tensor:
    """(3, C + L) contexts right-padded to different lengths (pads inside them, as QueryStream's) and responses."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50000, (3, context_length + response_length), generator=generator)
    tokens[1, 4:context_length] = pad_id
    tokens[2, 2:context_length] = pad_id
    return tokens


# ---------------------------------------------------------------- the critic's values


@pytest.mark.parametrize("bos", [None, 50256])
def test_critic_value_t_is_the_reward_score_of_the_prefix_before_token_t(tokenizer, bos):
    pad_id, context_length = tokenizer.pad_token_id, 6
    reward_model = RewardModel(tiny_gpt2(seed=3).transformer, bos_token_id=bos)
    with torch.no_grad():
        reward_model.gain.fill_(1.7)
        reward_model.bias.fill_(-0.3)
    critic = Critic.of_reward_model(reward_model)
    query_responses = episodes(pad_id, context_length)
    with torch.no_grad():
        values = critic(query_responses, context_length, pad_id)  # (3, L)
        # value t is read at the last token before response token t: the reward model's score of that prefix
        expected = torch.stack(
            [reward_model(query_responses[:, : context_length + t], pad_id) for t in range(values.shape[1])], 1
        )
    assert values.shape == (3, query_responses.shape[1] - context_length)
    torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-5)
    assert expected.std() > 1e-3  # the prefixes score differently: a position off would show


def test_critic_on_the_policy_trunk_gives_the_policy_value_heads_values(tokenizer):
    pad_id, context_length = tokenizer.pad_token_id, 6
    policy = PolicyWithValueHead(tiny_gpt2(seed=4))
    with torch.no_grad():
        policy.value_head.weight.normal_()
        policy.value_head.bias.fill_(0.2)
    critic = Critic(policy.lm.base_model)
    critic.head.load_state_dict(policy.value_head.state_dict())
    query_responses = episodes(pad_id, context_length)
    with torch.no_grad():
        torch.testing.assert_close(
            critic(query_responses, context_length, pad_id), policy(query_responses, context_length, pad_id, 0.7)[1]
        )


def test_critic_from_the_policy_starts_at_zero_on_a_copy_of_the_base_trunk(tokenizer, tiny_model_dir):
    policy = PolicyWithValueHead(tiny_gpt2())
    critic = nplus_critic.load_critic("policy", "vader", tiny_model_dir, load_tokenizer(tiny_model_dir), policy)
    assert not critic.head.weight.any() and not critic.head.bias.any()  # OAI's value head init (spec G8)
    trunk_weights = dict(critic.trunk.named_parameters())
    reference = dict(tiny_gpt2().transformer.named_parameters())
    assert trunk_weights.keys() == reference.keys()
    assert all(torch.equal(trunk_weights[name], reference[name]) for name in reference)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(critic.parameters(), policy.parameters()))  # its own
    assert critic.bos_token_id is None and critic.metadata["value_model"] == "policy"


def test_one_optimizer_trains_the_critic_and_never_the_policys_value_head(tokenizer):
    pad_id, context_length = tokenizer.pad_token_id, 6
    policy = PolicyWithValueHead(tiny_gpt2(seed=5))
    critic = Critic.of_reward_model(RewardModel(tiny_gpt2(seed=6).transformer))
    learner = PolicyWithCritic(policy, critic)
    optimizer = make_optimizer(list(learner.parameters()), 1e-3, use_tensorflow_adam=True)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in critic.parameters()} <= optimized
    assert not {id(p) for p in policy.value_head.parameters()} & optimized
    logits, values = learner(episodes(pad_id, context_length), context_length, pad_id, 0.7)
    (logits.logsumexp(-1).mean() + values.square().mean()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.parameters())
    assert all(p.grad is None for p in policy.value_head.parameters())
    assert policy.lm.get_input_embeddings().weight.grad is not None


# ---------------------------------------------------------------- training runs


@pytest.fixture(scope="module")
def critic_run(tmp_path_factory, tiny_model_dir, world):
    """The script run as a user would, with --ppo.value_model reward: 2 updates, a checkpoint after each."""
    output_dir = tmp_path_factory.mktemp("critic-run") / "run"
    result = run_script("train_policy.py", *run_flags(tiny_model_dir, world, output_dir))
    return output_dir, result


def critic_state(directory) -> dict[str, torch.Tensor]:
    """The weights of a saved critic (OUTPUT_DIR/critic) by state-dict name."""
    trunk = load_file(os.path.join(directory, "trunk", "model.safetensors"))
    head = load_file(os.path.join(directory, nplus_critic.CRITIC_HEAD_FILE))
    return {**{f"trunk.{k}": v for k, v in trunk.items()}, **head}


def test_run_with_a_critic_from_the_reward_model_trains_it_and_saves_it(critic_run, world):
    output_dir, result = critic_run
    assert "critic (--ppo.value_model)" in result.stdout
    saved = critic_state(output_dir / "critic")
    initial = Critic.from_reward_model(world["reward"]).state_dict()
    assert max((saved[k] - v).abs().max().item() for k, v in initial.items()) > 1e-4  # the critic was trained
    state = torch.load(checkpoint.latest_checkpoint(str(output_dir)) + "/state.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in state["critic"].items())  # the saved critic is the trained one
    value_head = load_file(output_dir / "value_head.safetensors")
    assert not any(v.any() for v in value_head.values())  # the policy's own head never trained: still zero
    with open(output_dir / "critic" / nplus_critic.CRITIC_CONFIG_FILE) as f:
        assert json.load(f)["value_model"] == "reward"


@pytest.mark.parametrize("bf16", [False, True])
def test_rollout_values_come_from_the_critic_not_the_sampler(tmp_path, tiny_model_dir, world, monkeypatch, bf16):
    recorded = []
    original = train_policy.ppo_update

    def recording_update(policy, optimizer, rollout, *args, **kwargs):
        recorded.append((rollout.query_responses.clone(), rollout.context_length, rollout.values.clone()))
        return original(policy, optimizer, rollout, *args, **kwargs)

    monkeypatch.setattr(train_policy, "ppo_update", recording_update)
    flags = run_flags(tiny_model_dir, world, tmp_path / "run", "--ppo.total_episodes", "8", "--save_interval", "0")
    train_policy.main(train_policy.parse(flags + (["--bf16"] if bf16 else [])))
    query_responses, context_length, values = recorded[0]
    pad_id = load_tokenizer(tiny_model_dir).pad_token_id
    with torch.no_grad():  # the first update's critic is the reward model's
        critic = Critic.from_reward_model(world["reward"]).to(query_responses.device)  # the run's device (a GPU)
        expected = critic(query_responses, context_length, pad_id)
    # under --bf16, PPO gets the values of the training forward's arithmetic (bfloat16 trunk), of the critic too
    tolerance = 3e-2 if bf16 else 1e-5
    torch.testing.assert_close(values, expected, rtol=tolerance, atol=tolerance)
    if bf16:
        assert not torch.equal(values, expected)  # the bfloat16 forward's values, not the float32 rollout's
    assert values.abs().min() > 0  # not the policy's zero-initialized value head


def test_saved_critic_loads_again_with_the_flag(critic_run, tiny_model_dir):
    output_dir, _ = critic_run
    tokenizer = load_tokenizer(tiny_model_dir)
    policy = PolicyWithValueHead(tiny_gpt2())
    critic_dir = str(output_dir / "critic")
    loaded = nplus_critic.load_critic(critic_dir, "vader", tiny_model_dir, tokenizer, policy)
    saved = critic_state(critic_dir)
    assert loaded.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())


def test_critic_run_killed_after_a_checkpoint_resumes_exactly(critic_run, tmp_path, tiny_model_dir, world):
    output_dir, _ = critic_run
    resumed = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed)
    shutil.rmtree(checkpoint.step_dir(str(resumed), 2))  # as if killed after the first update's checkpoint
    (resumed / "summary.json").unlink()  # written at the end: a kill before it leaves none
    shutil.rmtree(resumed / "critic")  # the resumed run writes its own
    flags = run_flags(tiny_model_dir, world, resumed, "--resume", "auto")
    train_policy.main(train_policy.parse(flags))
    whole_state = torch.load(checkpoint.latest_checkpoint(str(output_dir)) + "/state.pt", weights_only=True)
    resumed_state = torch.load(checkpoint.latest_checkpoint(str(resumed)) + "/state.pt", weights_only=True)
    assert max_weight_difference(whole_state["critic"], resumed_state["critic"]) <= 1e-6
    assert max_weight_difference(final_training_state(output_dir), final_training_state(resumed)) <= 1e-6
    assert max_weight_difference(critic_state(output_dir / "critic"), critic_state(resumed / "critic")) <= 1e-6


def test_run_without_a_critic_overwriting_a_critic_run_leaves_no_stale_critic(
    critic_run, tmp_path, tiny_model_dir, world
):
    output_dir, _ = critic_run
    overwritten = tmp_path / "overwritten"
    shutil.copytree(output_dir, overwritten)
    flags = run_flags(tiny_model_dir, world, overwritten, "--overwrite_output_dir", "--ppo.total_episodes", "8")
    flags = [f for i, f in enumerate(flags) if "--ppo.value_model" not in flags[max(i - 1, 0) : i + 1]]
    train_policy.main(train_policy.parse(flags))
    assert (overwritten / "value_head.safetensors").exists() and not (overwritten / "critic").exists()


# ---------------------------------------------------------------- bad input


def _small_vocab_critic(path, tiny_model_dir) -> str:
    """A saved critic with the policy's tokenizer fingerprint but a 1000-token trunk."""
    critic = Critic(tiny_gpt2(vocab_size=1000).transformer)
    tokenizer = load_tokenizer(tiny_model_dir)
    fingerprint = tokenizer_fingerprint(tokenizer)
    critic.metadata = {"tokenizer_fingerprint": fingerprint, "pad_token_id": tokenizer.pad_token_id}
    critic.save(str(path))
    return str(path)


@pytest.mark.parametrize(
    "case", ["missing", "programmatic", "lora", "other tokenizer", "small vocabulary", "not a model of either kind"]
)
def test_bad_value_model_stops_in_one_line_naming_the_flag(case, tmp_path, tiny_model_dir, world):
    extra, flags = [], run_flags(tiny_model_dir, world, tmp_path / "run")
    value_model = flags.index("--ppo.value_model") + 1
    if case == "missing":
        flags[value_model] = str(tmp_path / "nowhere")
    elif case == "programmatic":
        flags[flags.index("--rewards.trained_model") + 1] = "vader"
    elif case == "lora":
        extra = ["--lora.rank", "2"]
    elif case == "other tokenizer":
        task = train_policy.parse(flags).task
        flags[value_model] = save_normalized_reward_model(
            tmp_path / "rm", tiny_model_dir, task, tokenizer_fingerprint="0123"
        )
    elif case == "small vocabulary":
        flags[value_model] = _small_vocab_critic(tmp_path / "critic", tiny_model_dir)
    else:
        flags[value_model] = tiny_model_dir
    with pytest.raises((ValueError, FileNotFoundError), match="--ppo.value_model") as error:
        train_policy.main(train_policy.parse(flags + extra))
    assert "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "run" / "critic")


def test_resuming_a_critic_run_without_its_critic_stops_naming_the_flag(critic_run, tmp_path, tiny_model_dir, world):
    output_dir, _ = critic_run
    resumed = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed)
    shutil.rmtree(checkpoint.step_dir(str(resumed), 2))  # as if killed after the first update's checkpoint
    (resumed / "summary.json").unlink()
    flags = run_flags(tiny_model_dir, world, resumed, "--resume", "auto", "--allow_resume_changes")
    flags = [f for i, f in enumerate(flags) if "--ppo.value_model" not in flags[max(i - 1, 0) : i + 1]]
    with pytest.raises(ValueError, match="--ppo.value_model") as error:
        train_policy.main(train_policy.parse(flags))
    assert "--ppo.value_model cannot change on --resume, --allow_resume_changes or not" in str(error.value)


def test_missing_value_model_dir_is_one_error_line_from_the_script(tmp_path, tiny_model_dir, world):
    flags = run_flags(tiny_model_dir, world, tmp_path / "run")
    flags[flags.index("--ppo.value_model") + 1] = str(tmp_path / "nowhere")
    result = subprocess.run(
        [sys.executable, str(REPO / "train_policy.py"), *flags],
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: --ppo.value_model") and "not a directory" in result.stderr


# ---------------------------------------------------------------- memory


def test_memory_estimate_adds_the_critic_that_train_policy_builds():
    from transformers import GPT2LMHeadModel, GPT2Model

    from benchmark import memory_estimate
    from benchmark.lora_memory import count
    from benchmark.shapes import gpt2_config

    shared = memory_estimate.estimate(memory_estimate.Args(), "gpt2-124m", None)
    separate = memory_estimate.estimate(memory_estimate.Args(value_model="reward"), "gpt2-124m", None)
    with torch.device("meta"):  # built as train_policy.py builds them
        policy = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config("gpt2-124m")))
        critic = Critic(GPT2Model(gpt2_config("gpt2-124m")))
        alone = count(
            p for g in make_optimizer(list(policy.parameters()), 1e-5, True).param_groups for p in g["params"]
        )
        PolicyWithCritic(policy, critic)
        params = list(policy.parameters()) + list(critic.parameters())
        both = count(p for g in make_optimizer(params, 1e-5, True).param_groups for p in g["params"])
    assert separate["critic"] == 4 * count(critic.parameters()) and shared["critic"] == 0
    assert separate["gradients"] - shared["gradients"] == 4 * (both - alone)
    assert separate["Adam moments"] - shared["Adam moments"] == 8 * (both - alone)
    assert separate["activations"] == 2 * shared["activations"]
    assert separate["peak"] - shared["peak"] > 4 * 2**30  # GPT-2 124M, OAI's sentiment run: 6.7 -> 11.6 GiB
