"""LoRA (--lora.rank): the reference is the policy with its adapters disabled, exactly the base model; only the adapters
and the value head train; resume is exact; gradient checkpointing, bf16 and two processes work; the saved policy holds
the adapters (peft's format) and a merged model that plain transformers and the project's scripts load."""

import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen2Config

import train_policy
from lm_human_preference_details import checkpoint, lora
from lm_human_preference_details.kernels import logprobs_from_logits
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm, reduce_training_memory
from lm_human_preference_details.optim import make_optimizer
from tests.conftest import tiny_gpt2, write_queries
from tests.planted import REPO, free_port, run_script, without_gpus
from tests.test_resume import (
    final_training_state,
    max_metric_difference,
    max_weight_difference,
    saved_files,
    scalars,
    script_command,
    start_and_kill,
)
from tests.test_train_policy import save_reward_model, tiny_task

PAD = 50257
CONTEXT = 6

pytestmark = pytest.mark.usefixtures("single_thread")


def lora_policy(rank: int = 4, **flags) -> PolicyWithValueHead:
    """The tiny GPT-2 policy with LoRA adapters as train_policy.py builds it."""
    policy = PolicyWithValueHead(tiny_gpt2(seed=0))
    lora.apply_lora(policy, lora.LoraHParams(rank=rank, **flags), "gpt2")
    return policy


def episodes() -> torch.Tensor:
    """(4, 14) random context + response tokens."""
    return torch.randint(0, PAD, (4, CONTEXT + 8), generator=torch.Generator().manual_seed(0))


def logprobs(policy, tokens: torch.Tensor) -> torch.Tensor:
    """Tempered log-probs (B, L) of the response tokens."""
    return logprobs_from_logits(policy(tokens, CONTEXT, PAD, 0.7)[0], tokens[:, CONTEXT:])


def loss(policy, tokens: torch.Tensor) -> torch.Tensor:
    """A loss that moves both the policy and the value head."""
    logits, values = policy(tokens, CONTEXT, PAD, 0.7)
    return -logprobs_from_logits(logits, tokens[:, CONTEXT:]).mean() + (values - 1).square().mean()


def test_reference_is_exactly_the_base_model_at_init_and_after_an_update():
    policy, base, tokens = lora_policy(), PolicyWithValueHead(tiny_gpt2(seed=0)), episodes()
    reference = lora.ReferencePolicy(policy)
    assert reference.copy is None  # no second copy of the model
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in policy.named_parameters() if "lora_" in n} | {
        "value_head.weight",
        "value_head.bias",
    }
    optimizer = make_optimizer(list(policy.parameters()), 1e-2, True)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in policy.parameters() if p.requires_grad
    }
    with torch.no_grad():
        at_init = logprobs(policy, tokens)
        with reference() as ref_policy:
            assert torch.equal(logprobs(ref_policy, tokens), at_init)  # B = 0: the adapters add exactly nothing
        assert torch.equal(logprobs(base, tokens), at_init)
    loss(policy, tokens).backward()
    optimizer.step()
    with torch.no_grad():
        assert not torch.equal(logprobs(policy, tokens), at_init)
        with reference() as ref_policy:
            assert torch.equal(logprobs(ref_policy, tokens), logprobs(base, tokens))
        assert not torch.equal(logprobs(policy, tokens), at_init)  # the adapters are on again after the block
    assert policy.value_head.weight.abs().sum() > 0  # the value head trains


def test_gradient_checkpointing_and_bf16_train_only_the_adapters_and_the_value_head():
    tokens = episodes()
    gradients = {}
    for name, checkpointing, bf16 in (("plain", False, False), ("checkpointing", True, False), ("bf16", False, True)):
        policy = lora_policy()
        with torch.no_grad():  # B != 0, so that every adapter weight gets a gradient
            for n, p in policy.named_parameters():
                if "lora_B" in n:
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
        reduce_training_memory(policy, checkpointing, bf16)
        loss(policy, tokens).backward()
        gradients[name] = {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}
    expected = {n for n, p in policy.named_parameters() if p.requires_grad}
    for name, grads in gradients.items():
        assert set(grads) == expected, name
        assert all(g.abs().sum() > 0 and torch.isfinite(g).all() for g in grads.values()), name
    for n, g in gradients["plain"].items():
        torch.testing.assert_close(gradients["checkpointing"][n], g, rtol=0, atol=1e-6)
        torch.testing.assert_close(gradients["bf16"][n], g, rtol=0.1, atol=0.05 * g.abs().max().item())


def test_lora_dropout_acts_only_in_forwards_that_record_gradients():
    policy, tokens = lora_policy(dropout=0.5), episodes()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
        first, second = logprobs(policy, tokens), logprobs(policy, tokens)
    assert torch.equal(first, second)  # sampling and scoring: no dropout
    assert not torch.equal(logprobs(policy, tokens), logprobs(policy, tokens))


SIZES = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=16)


@pytest.mark.parametrize(
    "config, default, other",
    [
        (GPT2Config(n_layer=1, n_head=2, n_embd=8), ["c_attn"], "c_fc"),
        (GPTNeoXConfig(**SIZES), ["query_key_value"], "dense_h_to_4h"),
        (LlamaConfig(**SIZES), ["q_proj", "v_proj"], "up_proj"),
        (Qwen2Config(**SIZES), ["q_proj", "v_proj"], "up_proj"),
    ],
)
def test_default_target_modules_are_peft_defaults_of_each_supported_architecture(config, default, other):
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
    assert lora.target_modules(lm, ()) == default
    assert lora.target_modules(lm, (other,)) == [other]


def test_bad_lora_flags_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--lora\.rank must be >= 0.*--lora\.rank 8"):
        lora.check_lora_args(lora.LoraHParams(rank=-1))
    with pytest.raises(ValueError, match=r"--lora\.dropout must be in \[0, 1\)"):
        lora.check_lora_args(lora.LoraHParams(rank=8, dropout=1.0))
    with pytest.raises(ValueError, match=r"--lora\.target_modules nope: no such linear layer.*c_attn"):
        lora_policy(target_modules=("nope",))
    with pytest.raises(ValueError, match=r"--lora\.target_modules ln_f: no such linear layer"):
        lora_policy(target_modules=("ln_f",))
    with pytest.raises(ValueError, match=r"--lora\.target_modules lm_head: that layer shares its weight"):
        lora_policy(target_modules=("c_attn", "lm_head"))  # GPT-2's LM head is tied to the token embeddings
    args = train_policy.parse(["--lora.rank", "-2", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="--lora.rank"):
        train_policy.main(args)


# ---------------------------------------------------------------- runs of train_policy.py


def run_flags(world: dict, output_dir, *extra: str) -> list[str]:
    """A tiny LoRA run: 4 updates of 8 episodes, a checkpoint every 2."""
    return [
        *("--base_model", world["model"], "--rewards.trained_model", world["reward"]),
        *("--task.query_dataset", world["queries"], "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "None"),
        *("--task.truncate_after", "0", "--ppo.total_episodes", "32", "--ppo.batch_size", "8", "--ppo.lr", "1e-2"),
        *("--ppo.noptepochs", "2", "--save_interval", "2", "--keep_checkpoints", "0", "--log_interval", "100"),
        *("--print_samples", "1", "--lora.rank", "4", "--lora.alpha", "8", *extra, "--output_dir", str(output_dir)),
    ]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("lora")
    queries = root / "queries.txt"
    write_queries(queries)
    task = dataclasses.replace(tiny_task(str(queries)), truncate_token=None, truncate_after=0)
    return {
        "model": tiny_model_dir,
        "queries": str(queries),
        "reward": save_reward_model(root / "rm", tiny_model_dir, task),
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, world):
    output_dir = tmp_path_factory.mktemp("lora-run") / "policy"
    history = train_policy.main(train_policy.parse(run_flags(world, output_dir)))
    return output_dir, history


def training_state(output_dir, step: int) -> dict:
    return torch.load(os.path.join(checkpoint.step_dir(str(output_dir), step), "state.pt"), weights_only=True)


def test_lora_run_trains_adapters_and_value_head_only_from_the_exact_reference(lora_run, tiny_model_dir):
    output_dir, history = lora_run
    # B = 0: the first rollout's KL is the sampler's rounding against a full forward (exactly 0 in the test above)
    assert len(history) == 4 and abs(history[0]["objective/kl"]) < 1e-5
    assert abs(history[-1]["objective/kl"]) > 1e-3
    state = training_state(output_dir, 4)
    base = load_causal_lm(tiny_model_dir).state_dict()
    weights = state["policy"]
    for name, value in base.items():  # every base weight is frozen, bit for bit
        key = f"lm.{name}".replace("c_attn.", "c_attn.base_layer.")
        assert torch.equal(weights[key], value), key
    trainable = [n for n in weights if "lora_" in n or n.startswith("value_head.")]
    assert len(state["optimizer"]["state"]) == len(trainable) == 2 * 2 + 2  # 2 layers x (A, B), value head w, b
    assert all(weights[n].abs().sum() > 0 for n in trainable if "lora_B" in n or n.startswith("value_head."))


def test_lora_resume_continues_exactly(lora_run, world, tmp_path):
    output_dir, history = lora_run
    resumed_dir = tmp_path / "resumed"
    flags = run_flags(world, resumed_dir, "--resume", checkpoint.step_dir(str(output_dir), 2))
    resumed = train_policy.main(train_policy.parse(flags))
    assert len(resumed) == 2
    for whole, again in zip(history[2:], resumed):
        for key, value in whole.items():
            if not key.startswith(("elapsed/time", "elapsed/fps", "debug/time/")):
                assert again[key] == value, key
    whole_state, resumed_state = training_state(output_dir, 4), training_state(resumed_dir, 4)
    for key, value in whole_state["policy"].items():
        assert torch.equal(resumed_state["policy"][key], value), key
    for index, moments in whole_state["optimizer"]["state"].items():
        for name, value in moments.items():
            again = resumed_state["optimizer"]["state"][index][name]
            assert torch.equal(again, value) if torch.is_tensor(value) else again == value, (index, name)
    for name in ("model.safetensors", "value_head.safetensors", "adapter/adapter_model.safetensors"):
        saved, again = load_file(output_dir / name), load_file(resumed_dir / name)
        assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved), name


@pytest.mark.slow
def test_lora_run_killed_and_resumed_equals_uninterrupted(lora_run, world, tmp_path):
    whole, _ = lora_run
    killed = tmp_path / "killed"
    flags = run_flags(world, killed)
    # SIGKILLed right after checkpoint 2 is on disk (while the policy and its adapters are written beside it)
    resumed_from = start_and_kill(script_command("train_policy.py", flags), killed, kill_after=2, delay=0.0)
    assert resumed_from == 2
    run_script("train_policy.py", *flags, "--resume", "auto")
    assert max_metric_difference(scalars(killed), scalars(whole), resumed_from) <= 1e-6
    assert max_weight_difference(final_training_state(killed), final_training_state(whole)) <= 1e-6
    names = ("model.safetensors", "value_head.safetensors", "adapter/adapter_model.safetensors")
    assert max_weight_difference(saved_files(killed, names), saved_files(whole, names)) <= 1e-6


def test_lora_policy_saves_adapters_and_a_merged_model_for_plain_transformers(lora_run, tiny_model_dir):
    from peft import PeftModel

    output_dir, _ = lora_run
    adapter_dir = output_dir / lora.ADAPTER_DIR
    assert {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors"} <= set(
        os.listdir(adapter_dir)
    )
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4
    assert not any(".lora_" in k or "base_layer" in k for k in load_file(output_dir / "model.safetensors"))
    tokens = episodes()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(output_dir).eval()
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir).eval()
    with torch.no_grad():
        merged_logits, adapted_logits = merged(tokens).logits, adapted(tokens).logits
        assert (merged_logits - base(tokens).logits).abs().max() > 1e-3  # the adapters are merged in
        torch.testing.assert_close(merged_logits, adapted_logits, rtol=0, atol=1e-4)
    # the project's loaders: the merged directory and the adapter directory give the same policy
    policies = [PolicyWithValueHead.load(str(path)) for path in (output_dir, adapter_dir)]
    with torch.no_grad():
        torch.testing.assert_close(*(p(tokens, CONTEXT, PAD, 0.7)[1] for p in policies), rtol=0, atol=1e-5)
        torch.testing.assert_close(*(logprobs(p, tokens) for p in policies), rtol=0, atol=1e-4)
    # plain transformers batch-generates from the merged directory with its saved tokenizer (left padding)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    batch = tokenizer(["Once upon a time", "Hi"], return_tensors="pt", padding=True)
    generated = merged.generate(**batch, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, batch["input_ids"].shape[1] + 4)


@pytest.mark.slow
def test_evaluate_and_label_generation_accept_the_lora_run(lora_run, world, tmp_path):
    output_dir, _ = lora_run
    adapter_dir = output_dir / lora.ADAPTER_DIR
    flags = ("--num_queries", "8", "--batch_size", "8", "--output_dir", str(tmp_path / "eval"))
    run_script("evaluate.py", "--policy", str(output_dir), "--checkpoints", str(adapter_dir), *flags)
    curve = json.loads((tmp_path / "eval" / "results.json").read_text())["curve"]
    kl = {point["policy"]: point["kl"]["mean"] for point in curve}
    assert abs(kl["final"]) > 1e-3 and kl["adapter"] == pytest.approx(kl["final"], abs=1e-4)  # both forms: one policy
    output = tmp_path / "samples.json"
    run_script(
        "label_generation.py",
        *("sample", "--base_model", str(adapter_dir), "--task.query_dataset", world["queries"]),
        *("--task.query_length", "16", "--task.response_length", "8", "--task.truncate_token", "None"),
        *("--task.truncate_after", "0", "--num_queries", "4", "--batch_size", "4", "--output", str(output)),
    )
    samples = json.loads(output.read_text())
    assert samples["meta"]["counts"]["rows"] == 4 and len(samples["rows"]) == 4


LAUNCHER = """
import sys
import torch
sys.path.insert(0, {repo!r})
import train_policy
from lm_human_preference_details import distributed, lora

torch.set_num_threads(1)
policies = []
apply_lora = lora.apply_lora
lora.apply_lora = lambda policy, *args: (policies.append(policy), apply_lora(policy, *args))
flags = sys.argv[1:]
train_policy.main(train_policy.parse(flags))
rank = distributed.make_accelerator().process_index
out = flags[flags.index("--output_dir") + 1]
torch.save({{n: p.detach() for n, p in policies[0].named_parameters() if p.requires_grad}}, f"{{out}}/rank{{rank}}.pt")
"""


@pytest.mark.slow
def test_two_processes_keep_identical_adapters(world, tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(launcher)]
    flags = run_flags(world, output_dir, "--ppo.batch_size", "16", "--save_interval", "0")
    flags += ["--gradient_checkpointing", "--bf16"]  # the memory savers, with LoRA, on two processes
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
    run = subprocess.run([*command, *flags], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    ranks = [torch.load(output_dir / f"rank{r}.pt") for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 6
    # the processes seed differently: the same adapters mean rank 0's initial A was broadcast and every step
    # applied the gradients averaged over both processes
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in ranks[0])
    assert all(ranks[0][n].abs().sum() > 0 for n in ranks[0] if "lora_B" in n)
    saved = load_file(output_dir / lora.ADAPTER_DIR / "adapter_model.safetensors")
    assert len(saved) == 4


@pytest.mark.parametrize("family", ["gpt_neox", "llama", "qwen2"])
def test_lora_on_each_family_against_vader_trains_only_adapters_and_saves_a_merged_model(family, tmp_path):
    from tests import archs

    base_dir = archs.save_family(family, str(tmp_path / "base"))
    queries = tmp_path / "queries.txt"
    queries.write_text("\n".join(archs.world_text(64)) + "\n", encoding="utf-8")
    output_dir = tmp_path / "policy"
    flags = [
        *("--base_model", base_dir, "--rewards.trained_model", "vader", "--task", "sentiment"),
        *("--task.query_dataset", str(queries), "--task.query_length", "16", "--task.response_length", "8"),
        *("--task.truncate_after", "2", "--ppo.total_episodes", "16", "--ppo.batch_size", "8", "--ppo.lr", "1e-2"),
        *("--ppo.noptepochs", "1", "--ppo.whiten_group_size", "0", "--log_interval", "100", "--lora.rank", "4"),
        *("--output_dir", str(output_dir)),
    ]
    history = train_policy.main(train_policy.parse(flags))
    assert len(history) == 2 and abs(history[0]["objective/kl"]) < 1e-5  # the reference is the base model
    policy = PolicyWithValueHead.load(str(output_dir))
    base = load_causal_lm(base_dir).state_dict()
    merged = policy.lm.state_dict()
    targets = json.loads((output_dir / lora.ADAPTER_DIR / lora.ADAPTER_CONFIG).read_text())["target_modules"]
    changed = {name for name, value in base.items() if not torch.equal(merged[name], value)}
    # the merge changes exactly the target layers' weights (B moved off 0), nothing else of the frozen base
    assert changed and all(any(f".{t}.weight" in name for t in targets) for name in changed), sorted(changed)
    adapter = load_file(output_dir / lora.ADAPTER_DIR / "adapter_model.safetensors")
    assert adapter and all("lora_" in name for name in adapter)
