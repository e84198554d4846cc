"""train_policy.py --fsdp (FSDP2) on 2 and 4 gloo processes: every logged statistic and the final weights equal those of
the unsharded (DDP) run with as many processes, for GPT-2 and the Llama-like stand-in, with gradient accumulation, a
separate critic and the captured decoding step; the saved policy is one directory that plain transformers loads; a
killed run resumes to the uninterrupted one; a checkpoint of 4 processes resumes on 2 with the same weights and Adam
state."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

import train_policy
from lm_human_preference_details import checkpoint, decoding_graph, sharded
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.resume_check import max_metric_difference, scalars, start_and_kill
from lm_human_preference_details.tokenizer import load_tokenizer
from tests import archs
from tests.conftest import write_queries
from tests.planted import REPO, free_port, script_env, without_gpus
from tests.test_multiprocess import run_all

UPDATES = 3
FLAGS = [
    *("--task.query_length", "16", "--task.response_length", "8", "--task.start_text", "None"),
    *("--task.end_text", "None", "--task.truncate_token", "None", "--task.truncate_after", "0"),
    *("--ppo.total_episodes", str(8 * UPDATES), "--ppo.batch_size", "8", "--ppo.no_whiten_rewards"),
    *("--ppo.lr", "1e-3", "--ppo.noptepochs", "2", "--log_interval", "100", "--print_samples", "1"),
    *("--save_interval", "2", "--keep_checkpoints", "0"),
]
"""3 updates of 8 episodes (2 per process on 4), 2 PPO epochs, a checkpoint after updates 2 and 3"""
REWARD = "def score(queries, responses):\n    return [len(r) / 10 - r.count('e') for r in responses]\n"
"""a programmatic reward that any tokenizer's responses get"""
RUNS = {
    # name: (base model, flags); each --fsdp run is compared with the DDP run named before its first '-fsdp'
    "gpt2": ("gpt2", []),
    "gpt2-fsdp": ("gpt2", ["--fsdp"]),
    "gpt2-accum": ("gpt2", ["--ppo.gradient_accumulation_steps", "2"]),
    "gpt2-accum-fsdp": ("gpt2", ["--ppo.gradient_accumulation_steps", "2", "--fsdp"]),
    "llama-accum": ("llama", ["--ppo.gradient_accumulation_steps", "2"]),
    "llama-accum-fsdp": ("llama", ["--ppo.gradient_accumulation_steps", "2", "--fsdp", "--compile_sampler"]),
    "critic": ("gpt2", ["--ppo.value_model", "policy"]),
    "critic-fsdp": ("gpt2", ["--ppo.value_model", "policy", "--fsdp"]),
}
"""the runs of 2 processes, in one launch"""
LAUNCHER = """
import json, sys
sys.path.insert(0, {repo!r})
import torch
import train_policy
from lm_human_preference_details import cli

torch.set_num_threads(1)
for output_dir, flags in json.loads(sys.argv[1]):
    cli.run(train_policy.main, train_policy.parse, [*flags, "--output_dir", output_dir])
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """Queries, a programmatic reward, the tiny GPT-2 and Llama-like base models, a launcher of several runs."""
    root = tmp_path_factory.mktemp("fsdp")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    launcher = root / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    models = {"gpt2": tiny_model_dir, "llama": archs.save_family("llama", str(root / "llama"))}
    common = ["--task.query_dataset", write_queries(root / "queries.txt"), *FLAGS]
    common += ["--rewards.trained_model", f"python:{reward}:score"]
    return {"root": root, "launcher": launcher, "models": models, "common": common}


def run_flags(world: dict, model: str, extra: list[str]) -> list[str]:
    """A tiny run's flags (less --output_dir)."""
    return ["--base_model", world["models"][model], *world["common"], *extra]


def torchrun(processes: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *args]  # fmt: skip


def launch(world: dict, processes: int, runs: dict[str, tuple[str, list[str]]], out: Path) -> str:
    """The `runs` one after another in one torchrun of `processes` processes, each in out/NAME; -> the output."""
    listed = [(str(out / name), run_flags(world, model, extra)) for name, (model, extra) in runs.items()]
    command = torchrun(processes, str(world["launcher"]), json.dumps(listed))
    codes, outputs, _ = run_all([command], 600, out.parent)
    assert codes == [0], outputs[0][-6000:]
    return outputs[0]


def assert_same_run(fsdp: Path, ddp: Path) -> tuple[float, float]:
    """Every logged statistic (rtol 1e-5) and every saved weight (atol 1e-5), read by plain transformers, equal;
    -> the largest relative statistic difference and the largest weight difference."""
    logged, expected = scalars(fsdp), scalars(ddp)
    assert logged.keys() == expected.keys() and len(expected) >= 25
    worst_stat = 0.0
    for tag, series in expected.items():
        got, want = np.array([v for _, v in logged[tag]]), np.array([v for _, v in series])
        assert len(want) == UPDATES and [s for s, _ in logged[tag]] == [s for s, _ in series], tag
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=tag)
        worst_stat = max(worst_stat, float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-6))))
    weights = [AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (fsdp, ddp)]
    heads = [load_file(path / "value_head.safetensors") for path in (fsdp, ddp)]
    if (ddp / "critic").is_dir():
        weights += [load_file(path / "critic" / "model.safetensors") for path in (fsdp, ddp)]
    worst_weight = 0.0
    for got, want in zip(weights[::2] + heads[::2], weights[1::2] + heads[1::2]):
        assert got.keys() == want.keys()
        worst_weight = max(worst_weight, *((got[k] - want[k]).abs().max().item() for k in want))
    assert worst_weight <= 1e-5
    return worst_stat, worst_weight


def dcp_state(step_dir: Path, into: Path) -> dict[str, torch.Tensor]:
    """The weights and Adam moments (and steps) of a sharded checkpoint, whole, by name."""
    dcp_to_torch_save(str(step_dir / sharded.SHARDED_DIR), str(into))
    state = torch.load(into, weights_only=False)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for name, moments in state["optimizer"]["state"].items():
        flat.update({f"adam.{name}.{k}": torch.as_tensor(v) for k, v in moments.items()})
    return flat


@pytest.fixture(scope="module")
def two_processes(world):
    """The RUNS on 2 processes; -> their directory and output."""
    out = world["root"] / "two"
    return out, launch(world, 2, RUNS, out)


@pytest.mark.slow
def test_fsdp_runs_on_two_processes_equal_the_unsharded_runs(two_processes):
    out, output = two_processes
    assert "sharded over 2 processes" in output
    for name in RUNS:
        if "-fsdp" in name:
            stat, weight = assert_same_run(out / name, out / name.split("-fsdp")[0])
            print(f"{name} vs DDP, 2 processes: statistics within {stat:.2g} (relative), weights within {weight:.2g}")
            step = out / name / checkpoint.STATE_DIR / f"step{UPDATES}"
            assert (step / sharded.SHARDED_DIR / ".metadata").is_file()
            shared = torch.load(step / checkpoint.SHARED_FILE, weights_only=True)
            assert "policy" not in shared and "optimizer" not in shared  # the weights are in the shards only
            files = json.loads((step / checkpoint.META_FILE).read_text())["files"]
            assert len([f for f in files if f.startswith(sharded.SHARDED_DIR + "/")]) == 3  # 2 shards + metadata


@pytest.mark.slow
def test_fsdp_on_four_processes_equals_unsharded_and_resumes_on_two(world, two_processes, tmp_path):
    out = world["root"] / "four"
    output = launch(world, 4, {name: RUNS[name] for name in ("gpt2", "gpt2-fsdp")}, out)
    assert "sharded over 4 processes" in output
    stat, weight = assert_same_run(out / "gpt2-fsdp", out / "gpt2")
    print(f"gpt2 --fsdp vs DDP, 4 processes: statistics within {stat:.2g} (relative), weights within {weight:.2g}")
    # the 4-process run, killed after its last checkpoint (before its summary.json), resumed on 2 processes: its last
    # checkpoint is loaded and written again, by 2
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "gpt2-fsdp", resumed)
    (resumed / "summary.json").unlink()
    four = dcp_state(resumed / checkpoint.STATE_DIR / f"step{UPDATES}", tmp_path / "four.pt")
    flags = [*run_flags(world, "gpt2", ["--fsdp"]), "--output_dir", str(resumed), "--resume", "auto"]
    command = torchrun(2, str(REPO / "train_policy.py"), *flags)
    codes, outputs, _ = run_all([command], 300, tmp_path)
    assert codes == [0], outputs[0][-5000:]
    assert "written by 4 processes, this run has 2" in outputs[0] and "reseeded" in outputs[0]
    step = resumed / checkpoint.STATE_DIR / f"step{UPDATES}"
    assert json.loads((step / checkpoint.META_FILE).read_text())["world_size"] == 2
    two = dcp_state(step, tmp_path / "two.pt")
    assert four.keys() == two.keys() and any(k.endswith("exp_avg_sq") for k in two)
    assert all(torch.equal(four[k], two[k]) for k in four)  # weights and Adam moments as the 4 processes left them
    # each process continues the query stream where a 2-process run is after the same updates
    native = two_processes[0] / "gpt2-fsdp" / checkpoint.STATE_DIR / f"step{UPDATES}"
    args = train_policy.parse(run_flags(world, "gpt2", []))
    texts, tokenizer = load_texts(args.task.query_dataset), load_tokenizer(args.base_model)
    for rank in range(2):
        batches = []
        for directory in (step, native):
            stream = QueryStream(texts, tokenizer, args.task, rank, 2, args.data_seed)
            stream.load_state_dict(torch.load(directory / f"rng_rank{rank}.pt", weights_only=True)["query_stream"])
            batches.append(stream.next_batch(4, 4))
        assert torch.equal(*batches)
    assert not (step / "rng_rank2.pt").exists()


@pytest.mark.slow
def test_fsdp_run_killed_and_resumed_equals_uninterrupted(world, two_processes, tmp_path):
    whole = two_processes[0] / "gpt2-fsdp"
    killed = tmp_path / "killed"
    command = torchrun(2, str(REPO / "train_policy.py"), *run_flags(world, "gpt2", ["--fsdp"]))
    env = {**without_gpus(script_env()), "WANDB_SILENT": "true"}
    resumed_from = start_and_kill([*command, "--output_dir", str(killed)], killed, 2, 0.05, env, REPO)
    assert resumed_from == 2
    codes, outputs, _ = run_all([[*command, "--output_dir", str(killed), "--resume", "auto"]], 300, tmp_path)
    assert codes == [0], outputs[0][-5000:]
    assert max_metric_difference(scalars(killed), scalars(whole), resumed_from) <= 1e-6
    saved = [AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (killed, whole)]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[1])
    states = [dcp_state(d / checkpoint.STATE_DIR / f"step{UPDATES}", tmp_path / f"{i}.pt") for i, d in
              enumerate((killed, whole))]  # fmt: skip
    assert states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[1])


def test_fsdp_with_lora_stops_in_one_line(world, tmp_path):
    flags = [*run_flags(world, "gpt2", ["--fsdp", "--lora.rank", "4"]), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match=r"^--fsdp with --lora.rank 4: .*drop one of the two flags\.$"):
        train_policy.main(train_policy.parse(flags))
    assert not (tmp_path / "out").exists()


GATHER_LAUNCHER = """
import copy, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from lm_human_preference_details import distributed
from lm_human_preference_details.modeling import PolicyWithValueHead, sample
from tests.conftest import tiny_gpt2

torch.set_num_threads(1)
accelerator = distributed.make_accelerator()
policy = PolicyWithValueHead(tiny_gpt2())
whole = copy.deepcopy(policy)
trained = distributed.data_parallel(policy, accelerator, fsdp=True)
gathers = [0]
all_gather_single = dist.all_gather_single


def counted(*args, **kwargs):
    gathers[0] += 1
    return all_gather_single(*args, **kwargs)


dist.all_gather_single = counted
contexts = torch.randint(0, 50000, (3, 5), generator=torch.Generator().manual_seed(0))


def rollout(module):
    return sample(module, contexts, 6, 0.7, 50257, torch.Generator().manual_seed(1), compile=True)


with distributed.gathered(trained):
    entry = gathers[0]
    inside = [type(p) for p in policy.parameters()]
    sharded_rollout = rollout(policy)
    during = gathers[0] - entry
after = [type(p) for p in policy.parameters()]
record = dict(units=sum(isinstance(m, FSDPModule) for m in policy.modules()), entry=entry, during=during,
              inside_whole=all(t is not DTensor for t in inside), after_sharded=all(t is DTensor for t in after),
              same=all(torch.equal(a, b) for a, b in zip(sharded_rollout, rollout(whole))))
torch.save(record, sys.argv[1] + f"/rank{{accelerator.process_index}}.pt")
"""


@pytest.mark.slow
def test_gathered_unshards_every_unit_once_for_a_whole_rollout_and_shards_them_again(tmp_path):
    launcher = tmp_path / "gather.py"
    launcher.write_text(GATHER_LAUNCHER.format(repo=str(REPO)))
    codes, outputs, _ = run_all([torchrun(2, str(launcher), str(tmp_path))], 300, tmp_path)
    assert codes == [0], outputs[0][-5000:]
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        assert record["units"] == 3  # the 2 blocks and the policy
        assert record["entry"] == record["units"] and record["during"] == 0  # one all-gather per unit, at entry
        assert record["inside_whole"] and record["after_sharded"]
        assert record["same"]  # the captured decoding step samples as the unsharded policy does


@pytest.mark.slow
def test_one_process_fsdp_run_writes_sharded_checkpoints_and_resumes_from_them(world, tmp_path, capsys):
    flags = run_flags(world, "gpt2", ["--fsdp", "--save_interval", "1"])
    whole = tmp_path / "whole"
    train_policy.main(train_policy.parse([*flags, "--output_dir", str(whole)]))
    assert "one process: nothing to shard" in capsys.readouterr().out
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for step in range(2, UPDATES + 1):
        shutil.rmtree(checkpoint.step_dir(str(resumed), step))
    (resumed / "summary.json").unlink()  # written at the end: a kill after the first update leaves none
    train_policy.main(train_policy.parse([*flags, "--output_dir", str(resumed), "--resume", "auto"]))
    assert "resuming from" in capsys.readouterr().out
    assert max_metric_difference(scalars(resumed), scalars(whole), 1) == 0.0
    states = [
        dcp_state(d / checkpoint.STATE_DIR / f"step{UPDATES}", tmp_path / f"{d.name}.pt") for d in (resumed, whole)
    ]
    assert states[0].keys() == states[1].keys() and any(k.endswith("exp_avg") for k in states[1])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[1])
    # a run without --fsdp cannot read those checkpoints: one line naming the flag (of a run cut before its end: a
    # finished run refuses any other setting first)
    shutil.rmtree(checkpoint.step_dir(str(resumed), UPDATES))
    (resumed / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"written with --fsdp .*resume with the checkpoint's --fsdp"):
        train_policy.main(train_policy.parse([*flags[:-3], "--output_dir", str(resumed), "--resume", "auto",
                                              "--allow_resume_changes"]))  # fmt: skip


def test_fsdp_shards_the_reference_and_a_reward_model_and_they_score_as_before(tiny_model_dir):
    # one gloo process stands in for several: FSDP2 shards into one shard, the parameters become DTensors
    from torch.distributed.tensor import DTensor

    from lm_human_preference_details import lora, ppo_plumbing
    from lm_human_preference_details.modeling import PolicyWithValueHead, RewardModel, load_causal_lm
    from lm_human_preference_details.rewards import RewardModelReward

    class Several:
        num_processes = 2

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        reference = lora.ReferencePolicy(PolicyWithValueHead(load_causal_lm(tiny_model_dir)).eval())
        reward = RewardModelReward(RewardModel.from_base(tiny_model_dir).eval(), 50257)
        tokens = torch.randint(0, 50000, (3, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            before = reference.copy(tokens, 8, 50257, 0.7)[0], reward(tokens[:, :8], tokens[:, 8:])
            ppo_plumbing.shard_frozen_models(Several(), reference, reward)
            after = reference.copy(tokens, 8, 50257, 0.7)[0], reward(tokens[:, :8], tokens[:, 8:])
        for model in (reference.copy, reward.model):
            # every weight sharded but a reward model's 0-dim gain and bias, which FSDP2 leaves whole
            assert sharded.is_sharded(model) and all(
                isinstance(p, DTensor) != (p.dim() == 0) for p in model.parameters()
            )
        for was, now in zip(before, after):
            torch.testing.assert_close(now, was, rtol=1e-6, atol=1e-6)
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp_reduce_scatters_every_micro_batch_so_no_whole_gradient_accumulates(tiny_model_dir):
    # FSDP2 without gradient sync would keep a micro-batch's gradients whole (unsharded) until the last one; with it,
    # each backward leaves only the shards (DTensors) in .grad, and the sum equals the accumulated average
    from torch.distributed.tensor import DTensor

    from lm_human_preference_details import distributed
    from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm

    class Several:
        num_processes = 2

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        policy = PolicyWithValueHead(load_causal_lm(tiny_model_dir)).eval()
        whole = PolicyWithValueHead(load_causal_lm(tiny_model_dir)).eval()
        trained = distributed.data_parallel(policy, Several(), fsdp=True)
        tokens = torch.randint(0, 50000, (4, 12), generator=torch.Generator().manual_seed(0))
        for micro, rows in enumerate(tokens.split(2)):
            with distributed.averaging_gradients(trained, average=micro == 1):
                logits, values = trained(rows, 8, 50257, 0.7)
                ((logits.logsumexp(-1).mean() + values.mean()) / 2).backward()
            assert all(isinstance(p.grad, DTensor) for p in policy.parameters() if p.requires_grad), micro
            logits, values = whole(rows, 8, 50257, 0.7)
            ((logits.logsumexp(-1).mean() + values.mean()) / 2).backward()
        gradients = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.grad is not None}
        assert gradients
        for name, p in whole.named_parameters():
            if name in gradients:
                torch.testing.assert_close(gradients[name], p.grad, rtol=1e-5, atol=1e-7)
    finally:
        torch.distributed.destroy_process_group()


COUNTING_LAUNCHER = """
import sys
sys.path.insert(0, {repo!r})
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
import train_policy
from lm_human_preference_details import cli, decoding_graph

torch.set_num_threads(1)
counts = dict(captures=0, bodies=0, hooks_inside=0)
inside = [False]
for name in ("_pre_forward", "_post_forward"):
    original = getattr(FSDPState, name)

    def counted(state, *args, _original=original, **kwargs):
        counts["hooks_inside"] += inside[0]
        return _original(state, *args, **kwargs)

    setattr(FSDPState, name, counted)


class BodyGraph(decoding_graph.EagerStepGraph):
    def capture(self, step):
        counts["captures"] += 1

        def body():
            inside[0] = True
            counts["bodies"] += 1
            try:
                step()
            finally:
                inside[0] = False

        super().capture(body)


decoding_graph.new_step_graph = BodyGraph
cli.run(train_policy.main, train_policy.parse, sys.argv[2:])
torch.save(counts, sys.argv[1] + f"/counts{{dist.get_rank() if dist.is_initialized() else 0}}.pt")
"""


@pytest.mark.slow
def test_fsdp_compile_sampler_captures_once_over_the_run_and_runs_no_fsdp_hook_inside(world, tmp_path):
    launcher = tmp_path / "counting.py"
    launcher.write_text(COUNTING_LAUNCHER.format(repo=str(REPO)))
    flags = [*run_flags(world, "gpt2", ["--fsdp", "--compile_sampler"]), "--output_dir", str(tmp_path / "out")]
    codes, outputs, _ = run_all([torchrun(2, str(launcher), str(tmp_path), *flags)], 600, tmp_path)
    assert codes == [0], outputs[0][-5000:]
    assert "gathered weights held for the run" in outputs[0]
    for rank in range(2):
        counts = torch.load(tmp_path / f"counts{rank}.pt")
        # one capture for the UPDATES rollouts of 8 tokens (7 decoding steps after the prefill's token): the first
        # rollout's 3 warm-up steps run eagerly, each later step replays the captured body (the eager stand-in runs it)
        assert counts["captures"] == 1, counts
        assert counts["bodies"] == UPDATES * 7 - decoding_graph.WARM_UP_STEPS, counts
        assert counts["hooks_inside"] == 0, counts
