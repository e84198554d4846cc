"""The opt-in speed flags (--fused_adam, --fused_checks): each script takes them and runs its update through the fused
kernels with them, and through the unfused ones without them (OAI's float32 path, the default). What they cost in
rounding is tested in test_optim.py and test_validation.py; what they save on a GPU is not measurable on CPU."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

import train_policy
import train_reward
import train_sft
from lm_human_preference_details import distributed, validation
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.settings import RunSettings, with_run
from tests.conftest import SeveralProcesses, tiny_gpt2, write_queries
from tests.planted import books_task, write_query_file
from tests.test_fsdp_shards import backward
from tests.test_train_policy import save_reward_model, tiny_args, tiny_task
from tests.test_train_sft import make_args as sft_args
from tests.test_train_sft import write_pairs

SPEED_FLAGS = {"fused_adam": True, "fused_checks": True}

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def kernels(monkeypatch) -> dict:
    """Counts the fused Adam kernels a run calls, and records the `foreach` of each non-finite check."""
    seen = {"fused_adam": 0, "checks": []}

    def counted(kernel):
        def counting(*args, **kwargs):
            seen["fused_adam"] += 1
            return kernel(*args, **kwargs)

        return counting

    for name in ("_fused_adam_", "_fused_adamw_"):
        monkeypatch.setattr(torch, name, counted(getattr(torch, name)))
    nonfinite_tensors = validation.nonfinite_tensors

    def recording(tensors, foreach=False):
        seen["checks"].append(foreach)
        return nonfinite_tensors(tensors, foreach)

    monkeypatch.setattr(validation, "nonfinite_tensors", recording)
    return seen


def assert_kernels(seen: dict, flags: dict) -> None:
    assert seen["checks"] and set(seen["checks"]) == {bool(flags)}
    assert (seen["fused_adam"] > 0) == bool(flags)


def test_the_speed_flags_are_off_by_default_in_every_script():
    assert not RunSettings().fused_adam and not RunSettings().fused_checks
    for module, argv in ((train_policy, []), (train_reward, []), (train_sft, ["--base_model", "m", "--dataset", "d"])):
        args = module.parse(argv)
        assert (args.run.fused_adam, args.run.fused_checks) == (False, False), module.__name__
        args = module.parse([*argv, "--fused_adam", "--fused_checks"])
        assert (args.run.fused_adam, args.run.fused_checks) == (True, True), module.__name__


@pytest.mark.parametrize("use_tensorflow_adam", [True, False])
@pytest.mark.parametrize("flags", [{}, SPEED_FLAGS], ids=["default", "fused"])
def test_policy_update_runs_through_the_fused_kernels_only_with_the_flags(
    tmp_path, tiny_model_dir, kernels, flags, use_tensorflow_adam
):
    query_file = tmp_path / "queries.txt"
    write_queries(query_file)
    reward_model_dir = save_reward_model(tmp_path / "reward", tiny_model_dir, tiny_task(str(query_file)))
    args = tiny_args(tmp_path / "policy", tiny_model_dir, reward_model_dir, str(query_file), total_episodes=16)
    args = dataclasses.replace(with_run(args, **flags), use_tensorflow_adam=use_tensorflow_adam)
    stats = train_policy.main(args)
    assert len(stats) == 2 and all(np.isfinite(s["ppo/loss/policy"]) for s in stats)
    assert_kernels(kernels, flags)


@pytest.mark.parametrize("flags", [{}, SPEED_FLAGS], ids=["default", "fused"])
def test_reward_step_runs_through_the_fused_kernels_only_with_the_flags(tmp_path, tiny_model_dir, kernels, flags):
    rng = np.random.default_rng(0)
    rows = [
        {"query": rng.integers(0, 50000, 16).tolist(), "best": int(rng.integers(4))}
        | {f"sample{i}": rng.integers(0, 50000, 8).tolist() for i in range(4)}
        for _ in range(24)
    ]
    (tmp_path / "labels.json").write_text(json.dumps(rows))
    task = books_task(query_dataset=str(write_query_file(tmp_path / "q.txt", n=50)), query_length=16, response_length=8)
    args = train_reward.Args(
        base_model=tiny_model_dir,
        label_dataset=str(tmp_path / "labels.json"),
        task=task,
        labels=train_reward.LabelHParams(num_train=16),
        batch_size=8,
        rollout_batch_size=8,
        normalize_samples=8,
        normalize_before=False,
        normalize_after=False,
    )
    result = train_reward.main(with_run(args, output_dir=str(tmp_path / "rm"), **flags))
    assert np.isfinite(result["eval_after"]["loss"])
    assert_kernels(kernels, flags)


@pytest.mark.parametrize("flags", [[], ["--fused_adam", "--fused_checks"]], ids=["default", "fused"])
def test_sft_step_runs_through_the_fused_kernels_only_with_the_flags(tmp_path, tiny_model_dir, kernels, flags):
    pairs = write_pairs(tmp_path / "pairs.jsonl", n=16)
    result = train_sft.main(sft_args(tiny_model_dir, pairs, tmp_path / "sft", "--save_interval", "0", *flags))
    assert np.isfinite(result["train_last"])
    assert_kernels(kernels, {"fused": True} if flags else {})


@pytest.mark.parametrize("use_tensorflow_adam", [True, False])
def test_fused_adam_on_fsdp_shards_is_the_unsharded_fused_step(gloo_process_group, use_tensorflow_adam):
    # --fsdp --fused_adam: the fused kernel updates each process's shards as it updates whole tensors
    policy = PolicyWithValueHead(tiny_gpt2()).eval()
    whole = PolicyWithValueHead(tiny_gpt2()).eval()
    whole.load_state_dict(policy.state_dict())
    trained = distributed.data_parallel(policy, SeveralProcesses(), fsdp=True)
    optimizers = [make_optimizer(list(m.parameters()), 1e-2, use_tensorflow_adam, fused=True) for m in (policy, whole)]
    for step in range(3):
        backward(trained, step)
        backward(whole, step)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(policy.named_parameters(), whole.parameters()):
        assert isinstance(p, DTensor)
        torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=1e-6, msg=name)
