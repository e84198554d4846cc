"""benchmark/memory_estimate.py: --fsdp's shards, DDP's buckets, the Pythia shapes, the tables of README.md and
docs/multiprocess.md (its output, so they cannot go stale), and its figures against memory measured on CPU."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import tyro
from transformers import AutoModelForCausalLM, GPT2LMHeadModel

import train_policy
from benchmark import memory_estimate
from benchmark.lora_memory import count
from benchmark.shapes import SHAPES, model_config
from lm_human_preference_details.kernels import logprobs_and_entropy_from_logits, use_fused_gelu
from lm_human_preference_details.modeling import PolicyWithValueHead, reduce_training_memory
from lm_human_preference_details.sizes import derive_sizes
from lm_human_preference_details.tasks import TASKS
from tests.memory import PeakAllocation
from tests.planted import REPO, free_port, without_gpus

GIB = 2**30
PER_PROCESS = ("policy", "critic", "Adam moments", "gradients", "reference", "reward model")
"""the parts --fsdp shards over the processes"""
WHOLE = ("KV cache", "activations", "logits")
"""the parts every process holds whole with or without --fsdp"""


def planner(**flags) -> memory_estimate.Args:
    return memory_estimate.Args(**flags)


# ---------------------------------------------------------------- --fsdp


@pytest.mark.parametrize("processes", [2, 8])
def test_fsdp_divides_the_models_gradients_and_adam_by_the_processes_and_keeps_activations_whole(processes):
    plain = memory_estimate.estimate(planner(processes=processes, value_model="reward"), "gpt2-124m", None)
    sharded = memory_estimate.estimate(planner(processes=processes, value_model="reward", fsdp=True), "gpt2-124m", None)
    for part in PER_PROCESS:
        assert sharded[part] == pytest.approx(plain[part] / processes), part
    for part in WHOLE:
        assert sharded[part] == plain[part] > 0, part
    # the rollout gathers the whole policy once, on top of its shard
    assert sharded["gathered policy"] == plain["policy"] and plain["gathered policy"] == 0
    # PPO gathers two blocks and the root (embeddings, heads of policy and critic), weights and gradients
    with torch.device("meta"):
        lm = GPT2LMHeadModel(model_config("gpt2-124m"))
    block = count(lm.transformer.h[0].parameters())
    root = count(lm.parameters()) - 12 * block + 769 + (count(lm.transformer.parameters()) - 12 * block + 769)
    assert sharded["gathered blocks"] == 2 * (2 * block + root) * 4 and plain["gathered blocks"] == 0
    assert sharded["rollout"] > sharded["gathered policy"] + sharded["reference"] + sharded["reward model"]


def test_fsdp_with_gradient_accumulation_holds_only_the_gradient_shards():
    # every micro-batch's gradients are reduce-scattered into the shards (distributed.averaging_gradients): no whole
    # copy accumulates; the smaller micro-batch stores fewer activations
    once = memory_estimate.estimate(planner(fsdp=True), "gpt2-355m", None)
    accumulated = memory_estimate.estimate(planner(fsdp=True, gradient_accumulation_steps=4), "gpt2-355m", None)
    assert accumulated["gradients"] == once["gradients"] and accumulated["PPO"] < once["PPO"]


def test_fsdp_with_lora_is_refused_in_one_line_naming_both_flags():
    with pytest.raises(ValueError, match="--fsdp with --lora_rank"):
        memory_estimate.main(planner(fsdp=True, lora_rank=8, shapes=("tiny",)))


# ---------------------------------------------------------------- DDP (gradient_as_bucket_view)


def test_ddp_gradients_are_its_buckets_held_between_updates_and_no_second_copy_is_added():
    # torch's DDP with gradient_as_bucket_view: every gradient is a view of a bucket that DDP allocated; setting the
    # gradients to None (optimizer.zero_grad) does not free the buckets (a 1-process gloo group)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, init_sync=False)
        for _ in range(2):  # the second backward runs in the buckets rebuilt after the first
            ddp(torch.randn(3, 64)).sum().backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
            refs = [p.grad.untyped_storage()._weak_ref() for p in model.parameters()]
            model.zero_grad(set_to_none=True)
        assert len(storages) < len(list(model.parameters()))  # views of shared buckets, not one copy each
        assert not any(torch.UntypedStorage._expired(ref) for ref in refs)  # still allocated: DDP holds them
    finally:
        dist.destroy_process_group()
    # the planner: on several processes the gradients are held through the rollout, with no all-reduce buffer
    one, eight = (memory_estimate.estimate(planner(processes=p, batch_size=64 * p), "gpt2-124m", None) for p in (1, 8))
    assert eight["step temporaries"] == one["step temporaries"]
    assert eight["rollout"] - one["rollout"] == pytest.approx(eight["gradients"])
    assert eight["PPO"] == one["PPO"] and eight["step"] == one["step"]


# ---------------------------------------------------------------- shapes and tasks


def test_pythia_shapes_count_the_published_parameters_on_the_meta_device():
    published = {"pythia-1b": 1_011_781_632, "pythia-2.8b": 2_775_208_960, "pythia-6.9b": 6_857_302_016}
    for shape, params in published.items():
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(model_config(shape))
        assert count(lm.parameters()) == params, shape
        result = memory_estimate.estimate(planner(), shape, None)
        assert result["policy"] == 4 * (params + model_config(shape).hidden_size + 1)  # and the value head
    # the logits over each model's own vocabulary
    gpt2, pythia = (memory_estimate.estimate(planner(), s, None)["logits"] for s in ("gpt2-124m", "pythia-6.9b"))
    assert pythia / gpt2 == 50432 / 50257
    with pytest.raises(ValueError, match=r"unknown shape 'pythia-12b' \(--shapes\); the shapes are .*pythia-6.9b"):
        memory_estimate.main(planner(shapes=("pythia-12b",)))


def test_nplus_tldr_task_takes_the_presets_lengths_batch_critic_and_torch_adamw():
    args = planner(task="nplus_tldr", gradient_accumulation_steps=4)
    result = memory_estimate.estimate(args, "pythia-1b", None)
    preset = train_policy.task_presets()["nplus_tldr"]
    assert result["batch"] == preset.ppo.batch_size // 8 and result["critic"] > 0
    books = planner(gradient_accumulation_steps=4, value_model="reward")
    sentiment = memory_estimate.estimate(books, "pythia-1b", None)
    tokens = preset.task.query_length + preset.task.response_length - 1
    assert result["activations"] / sentiment["activations"] == pytest.approx(tokens / (64 + 24 - 1))
    assert result["step temporaries"] == result["gradients"]  # torch AdamW's foreach sqrt(v) + eps of every weight
    with pytest.raises(ValueError, match="--value_model with --lora_rank"):
        memory_estimate.main(planner(task="nplus_tldr", lora_rank=8, shapes=("tiny",)))


def test_planner_takes_train_policys_sizes_and_refuses_the_sizes_it_refuses():
    # micro-batch = 64 / 2 processes / 2 minibatches / 4 accumulation steps = 4 episodes, whose activations it counts
    args = planner(processes=2, batch_size=64, nminibatches=2, gradient_accumulation_steps=4)
    result = memory_estimate.estimate(args, "gpt2-124m", None)
    whole = memory_estimate.estimate(planner(processes=1, batch_size=64), "gpt2-124m", None)  # a micro-batch of 64
    assert result["batch"] == 32 and whole["activations"] / result["activations"] == 64 / 4
    # 8 episodes of a process over 2 minibatches: whitening groups of 4, which train_policy.py refuses
    with pytest.raises(ValueError, match="ppo.whiten_rewards needs at least 8 episodes per whitening group, got 4"):
        memory_estimate.estimate(planner(processes=8, batch_size=64, nminibatches=2), "gpt2-124m", None)


# ---------------------------------------------------------------- the tables in README.md and docs/multiprocess.md

_TABLE_RE = re.compile(r"`(python benchmark/memory_estimate\.py --summary[^`]*)`[^|]*?\n\n((?:\|.*\|\n)+)")


def planner_tables(path) -> list[tuple[str, str]]:
    """(command, table) of each `python benchmark/memory_estimate.py --summary ...` followed by a table in `path`."""
    return _TABLE_RE.findall(path.read_text(encoding="utf-8"))


def test_readme_and_multiprocess_memory_tables_are_the_planners_output():
    for page, minimum in ((REPO / "README.md", 1), (REPO / "docs" / "multiprocess.md", 3)):
        tables = planner_tables(page)
        assert len(tables) >= minimum, f"{page.name}: {len(tables)} planner tables"
        for command, table in tables:
            args = tyro.cli(memory_estimate.Args, args=shlex.split(command)[2:])
            printed = memory_estimate.summary_table(args)
            assert table.strip() == printed, f"{page.name}: `{command}` prints another table"


# ---------------------------------------------------------------- measured on CPU

MEASURED_SHAPE = dict(n_layer=2, n_head=12, n_embd=768)
"""GPT-2 124M's width and heads, 2 of its 12 blocks: a real PPO update on CPU in seconds"""


def measured_ppo_update(shape: str, micro: int, bf16: bool = False, checkpointing: bool = False) -> dict[str, float]:
    """A real train_policy.ppo_update (one process, float32 unless bf16) of a random policy of `shape` on
    `micro`-episode micro-batches at the sentiment task's lengths (2 minibatches, so the second's backward runs with
    Adam's moments allocated), measured on CPU: the peak bytes held (PeakAllocation, the policy's weights counted from
    the start), the bytes of weights and Adam state after it, then one more PPO forward and backward: its peak (weights
    and Adam state counted) and the bytes its forward saves for the backward beyond the weights (torch's saved-tensor
    hooks); the planner's figures for the same parts beside them."""
    task = TASKS["sentiment"]
    context, length = task.query_length, task.response_length
    config = model_config(shape)
    use_fused_gelu(config)  # as loading a model does (modeling.py)
    policy = PolicyWithValueHead(AutoModelForCausalLM.from_config(config)).eval()
    reduce_training_memory(policy, checkpointing, bf16)
    args = train_policy.Args()
    args.ppo = dataclasses.replace(args.ppo, batch_size=2 * micro, nminibatches=2, noptepochs=1)
    sizes = derive_sizes(args, 1)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50257, (2 * micro, context + length), generator=gen)
    rollout = train_policy.Rollout(
        tokens, context, -3 * torch.rand(2 * micro, length, generator=gen), *torch.randn(2, 2 * micro, length)
    )
    rngs = train_policy.virtual_rank_rngs(args.seed, 0, 1, sizes.virtual_ranks)
    indices = torch.from_numpy(train_policy.minibatch_indices(rngs, sizes.group, 2, 1))
    params = list(policy.parameters())
    optimizer = train_policy.optim.make_optimizer(params, 1e-5, True)
    with PeakAllocation(held=params) as memory:
        train_policy.ppo_update(policy, optimizer, rollout, indices, sizes, args.ppo, 0.7, 50257)
    state = [t for s in optimizer.state.values() for k, t in s.items() if k != "step"]  # the moments
    weights = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with PeakAllocation(held=params + state) as forward_backward:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits, values = policy(tokens[:micro], context, 50257, 0.7)
            logprobs, _ = logprobs_and_entropy_from_logits(logits, tokens[:micro, context:])
        (logprobs.sum() + values.sum()).backward()
        del logits, values, logprobs
    optimizer.zero_grad(set_to_none=True)
    flags = dict(processes=1, batch_size=2 * micro, nminibatches=2, bf16=bf16, gradient_checkpointing=checkpointing)
    estimate = memory_estimate.estimate(planner(**flags), shape, None)
    frozen = estimate["reference"] + estimate["reward model"]  # not built here
    return {
        "measured peak": memory.peak,
        "estimated peak": max(estimate["PPO"], estimate["step"]) - frozen,
        "measured PPO forward and backward": forward_backward.peak,
        "estimated PPO forward and backward": estimate["PPO"] - frozen,
        "measured weights and Adam": sum(p.nbytes for p in params) + sum(t.nbytes for t in state),
        "estimated weights and Adam": estimate["policy"] + estimate["Adam moments"],
        "measured saved": sum(saved.values()),
        # the forward keeps the (b, L, V) logits, a third of the planner's "logits" (with the backward's softmax and
        # logit gradient)
        "estimated saved": estimate["activations"] + estimate["bf16 weight copies"] + estimate["logits"] / 3,
    }


def test_planner_is_within_a_quarter_of_a_measured_ppo_update(monkeypatch):
    monkeypatch.setitem(SHAPES, "gpt2-2x768", MEASURED_SHAPE)
    figures = measured_ppo_update("gpt2-2x768", micro=8)
    assert figures["measured weights and Adam"] == figures["estimated weights and Adam"]  # the real modules' counts
    for part in ("peak", "PPO forward and backward", "saved"):
        ratio = figures[f"estimated {part}"] / figures[f"measured {part}"]
        assert 0.75 < ratio < 1.25, (part, figures)


FSDP_LAUNCHER = """
import json, sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from benchmark.shapes import model_config
from lm_human_preference_details import distributed
from lm_human_preference_details.modeling import PolicyWithValueHead

accelerator = distributed.make_accelerator()
policy = PolicyWithValueHead(AutoModelForCausalLM.from_config(model_config(sys.argv[1]))).eval()
trained = distributed.data_parallel(policy, accelerator, fsdp=True)  # as train_policy.py --fsdp shards it
shard = sum(p.to_local().untyped_storage().nbytes() for p in policy.parameters())
with distributed.gathered(trained):  # what the rollout gathers
    gathered = sum(p.nbytes for p in policy.parameters())
with open(f"{{sys.argv[2]}}/rank{{dist.get_rank()}}.json", "w") as f:
    json.dump(dict(shard=shard, gathered=gathered), f)
dist.destroy_process_group()
"""


def test_fsdp2_shards_of_two_processes_hold_the_planners_share_of_the_policy(tmp_path):
    # a real FSDP2 fully_shard of the tiny GPT-2 policy over 2 gloo processes: each process's shard is the planner's
    # --fsdp policy (half, up to FSDP2's padding to a multiple of the processes), unshard() the gathered policy
    launcher = tmp_path / "shards.py"
    launcher.write_text(FSDP_LAUNCHER.format(repo=str(REPO)))
    env = without_gpus({**os.environ, "OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port()), str(launcher), "tiny", str(tmp_path)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    estimate = memory_estimate.estimate(planner(processes=2, fsdp=True, batch_size=64), "tiny", None)
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["gathered"] == estimate["gathered policy"]
        assert estimate["policy"] <= measured["shard"] <= estimate["policy"] * 1.001, (measured, estimate["policy"])
