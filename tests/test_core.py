"""Tests for sizes (sizes.py), seeding (devices.py, TV13), sync (distributed.py) and tracking (tracking.py); whitening
is tested beside the PPO math in test_train_policy.py, log-probs in test_kernels.py."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm_human_preference_details import distributed, tracking
from lm_human_preference_details.devices import set_seed
from lm_human_preference_details.distributed import broadcast_parameters
from lm_human_preference_details.sizes import ceil_div, exact_div
from lm_human_preference_details.tracking import Tracker
from tests.conftest import cpu_accelerator, forget_accelerate_state_unless_on
from tests.fidelity import FakeWorld
from tests.planted import free_port, without_gpus

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_exact_div_returns_quotient():
    assert exact_div(512, 8, "ppo.batch_size / world_size") == 64


def test_exact_div_error_names_both_numbers_and_what():
    with pytest.raises(ValueError) as excinfo:
        exact_div(510, 8, "ppo.batch_size / world_size")
    message = str(excinfo.value)
    assert "510" in message and "8" in message and "ppo.batch_size / world_size" in message


def test_exact_div_zero_divisor_raises_value_error():
    with pytest.raises(ValueError, match="labels.num_train"):
        exact_div(4, 0, "labels.num_train")


def test_ceil_div_rounds_up():
    assert [ceil_div(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_set_seed_numpy_legacy_rng_reproduces_tv13():
    set_seed(1)
    order = np.random.permutation(4992)
    assert order[:12].tolist() == [4486, 2985, 3023, 1328, 1687, 4855, 2721, 2442, 687, 1321, 2188, 1272]
    assert order[-4:].tolist() == [2763, 905, 3980, 235]


def test_set_seed_makes_torch_and_python_reproducible():
    import random

    set_seed(7)
    first = (torch.rand(3), random.random())
    set_seed(7)
    second = (torch.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and first[1] == second[1]


def read_tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series in the TensorBoard event files under tb_dir."""
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tracker_writes_tensorboard_scalars(tmp_path):
    tracker = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True)
    tracker.log({"objective/score": 0.25, "ppo/loss/total": torch.tensor(1.5)}, step=3)
    tracker.log({"objective/score": 0.5}, step=4)
    tracker.log_table("samples", ["query", "response"], [["a", "b"]], step=4)
    tracker.close()
    scalars = read_tb_scalars(tmp_path / "tb")
    assert scalars["objective/score"] == [(3, 0.25), (4, 0.5)]
    assert scalars["ppo/loss/total"] == [(3, 1.5)]
    assert not (tmp_path / "wandb").exists()


def test_resumed_tracker_points_replace_the_killed_runs_even_within_the_same_second(tmp_path):
    killed = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True)
    for step in (0, 1):
        killed.log({"objective/score": float(step)}, step=step)
    killed.close()
    # the killed run's file as another host would have named it in this very second: it sorts after this host's
    (old,) = os.listdir(tmp_path / "tb")
    now = int(time.time())
    os.rename(tmp_path / "tb" / old, tmp_path / "tb" / f"events.out.tfevents.{now:010d}.zzzz.1.0")
    resumed = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True, purge_step=1)
    for step in (1, 2):
        resumed.log({"objective/score": 10.0 + step}, step=step)
    resumed.close()
    assert sorted(os.listdir(tmp_path / "tb"))[0].startswith(f"events.out.tfevents.{now:010d}.zzzz")
    assert read_tb_scalars(tmp_path / "tb")["objective/score"] == [(0, 0.0), (1, 11.0), (2, 12.0)]


def test_tracker_wandb_offline_creates_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    out = tmp_path / "out"
    tracker = Tracker(str(out), True, "project", None, "my-run", {"seed": 1, "lr": 1e-5}, is_main=True)
    assert tracker.run.offline
    assert tracker.run.name == "my-run"
    assert tracker.run.config["lr"] == 1e-5
    tracker.log({"objective/score": 0.25}, step=1)
    tracker.log_table("samples", ["query", "response"], [["a", "b"]], step=1)
    tracker.close()
    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("run-*.wandb"))
    assert list(run_dirs[0].glob("files/media/table/samples_*.table.json"))
    assert read_tb_scalars(out / "tb")["objective/score"] == [(1, 0.25)]


def test_tracker_non_main_process_writes_nothing(tmp_path, monkeypatch):
    def fail_init(*args, **kwargs):
        raise AssertionError("wandb.init must not run on a non-main process")

    monkeypatch.setattr(tracking.wandb, "init", fail_init)
    out = tmp_path / "out"
    tracker = Tracker(str(out), True, "project", None, "run", {"seed": 1}, is_main=False)
    tracker.log({"objective/score": 0.25}, step=1)
    tracker.log_table("samples", ["query"], [["a"]], step=1)
    tracker.close()
    assert not out.exists()


def test_data_parallel_and_broadcast_single_process_are_noops():
    accelerator = cpu_accelerator()
    assert accelerator.num_processes == 1
    model = torch.nn.Linear(3, 2)
    before_params = [p.detach().clone() for p in model.parameters()]
    trained = distributed.data_parallel(model, accelerator)
    assert trained is model  # one process: the module itself, no DDP and no hook in the backward
    with distributed.averaging_gradients(trained, average=True):
        trained(torch.ones(1, 3)).sum().backward()
    assert torch.equal(model.weight.grad, torch.ones(2, 3)) and torch.equal(model.bias.grad, torch.ones(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    distributed.clear_gradients(optimizer, trained)
    assert model.weight.grad is None and model.bias.grad is None  # freed, as zero_grad(set_to_none=True)
    broadcast_parameters(model, accelerator)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before_params))


def test_a_cpu_accelerator_follows_one_built_on_a_gpu_in_the_same_process():
    """accelerate keeps one state per process; on a GPU machine a test that ran a script in-process leaves it on
    CUDA (faked here: the state's device), and the fidelity tests' `Accelerator(cpu=True)` raised at setup."""
    cpu_accelerator()  # a state on the CPU, whatever the tests before this one left
    PartialState._shared_state["device"] = AcceleratorState._shared_state["device"] = torch.device("cuda")
    with pytest.raises(ValueError, match="AcceleratorState has already been initialized"):
        Accelerator(cpu=True)
    assert FakeWorld(0).device == torch.device("cpu")
    forget_accelerate_state_unless_on("cuda")  # after a test on a GPU machine: the next `Accelerator()` gets CUDA
    assert not PartialState._shared_state and not AcceleratorState._shared_state
    assert cpu_accelerator().device == torch.device("cpu")


TWO_PROCESS_SCRIPT = textwrap.dedent(
    """
    import copy
    import sys

    import torch
    from accelerate import Accelerator

    from lm_human_preference_details import distributed
    from tests.conftest import tiny_gpt2

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    result = {"num_processes": accelerator.num_processes}

    # float32 and float64 weights (DDP buckets each dtype apart), rank-dependent: the broadcast makes them rank 0's
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.full((2, 3), 10.0 * (rank + 1)))
    model.b = torch.nn.Parameter(torch.full((4,), -1.0 * (rank + 1), dtype=torch.float64))
    distributed.broadcast_parameters(model, accelerator)
    result["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}


    class Weighted(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return (self.inner.a * x).sum() + (self.inner.b * y).sum()


    trained = distributed.data_parallel(Weighted(model), accelerator)
    result["is_ddp"] = isinstance(trained, torch.nn.parallel.DistributedDataParallel)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = torch.arange(6.0).view(2, 3) * (rank + 1), torch.arange(4.0, dtype=torch.float64) * (rank + 1) ** 2
    # one step of one micro-batch; then a step of 2 micro-batches, the first without communication (no_sync)
    with distributed.averaging_gradients(trained, average=True):
        trained(x, y).backward()
    result["one"] = [model.a.grad.clone(), model.b.grad.clone()]
    distributed.clear_gradients(optimizer, trained)
    with distributed.averaging_gradients(trained, average=False):
        trained(x, y).backward()
    result["local"] = [model.a.grad.clone(), model.b.grad.clone()]
    with distributed.averaging_gradients(trained, average=True):
        trained(3 * x, 3 * y).backward()
    result["accumulated"] = [model.a.grad.clone(), model.b.grad.clone()]

    # a tiny GPT-2's LM loss over 8 sequences: each process its 4, 2 micro-batches of 2 (the loss of each a mean
    # over its rows, divided by 2), through DDP; and the whole batch in one forward without DDP
    lm = tiny_gpt2(seed=0)
    alone = copy.deepcopy(lm)
    tokens = torch.randint(0, 50257, (8, 6), generator=torch.Generator().manual_seed(0))
    trained = distributed.data_parallel(lm, accelerator)
    for micro, rows in enumerate(tokens[4 * rank : 4 * rank + 4].split(2)):
        with distributed.averaging_gradients(trained, average=micro == 1):
            (trained(rows, labels=rows).loss / 2).backward()
    alone(tokens, labels=tokens).loss.backward()
    result["lm"] = {name: p.grad for name, p in lm.named_parameters()}
    result["lm_alone"] = {name: p.grad for name, p in alone.named_parameters()}
    torch.save(result, f"{sys.argv[1]}/rank{rank}.pt")
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory) -> list[dict]:
    """What TWO_PROCESS_SCRIPT saved on each of its 2 gloo processes."""
    out = tmp_path_factory.mktemp("two_processes")
    script = out / "sync_check.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    # the repository in front of the machine's own PYTHONPATH (which may hold the installed libraries)
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = without_gpus(dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


def test_allreduce_and_broadcast_two_processes(two_process_results):
    # spec O4, D6: DDP gives every process the mean of the processes' gradients (float32 and float64 alike); a
    # micro-batch under no_sync keeps its gradients local, the next one's backward averages the accumulated sums
    grad_a, grad_b = torch.arange(6.0).view(2, 3), torch.arange(4.0, dtype=torch.float64)
    for rank, result in enumerate(two_process_results):
        assert result["num_processes"] == 2 and result["is_ddp"]
        assert torch.equal(result["params"]["a"], torch.full((2, 3), 10.0))
        assert torch.equal(result["params"]["b"], torch.full((4,), -1.0, dtype=torch.float64))
        assert torch.equal(result["one"][0], grad_a * 1.5)  # mean of x1 and x2
        assert result["one"][1].dtype == torch.float64 and torch.equal(result["one"][1], grad_b * 2.5)  # x1, x4
        assert torch.equal(result["local"][0], grad_a * (rank + 1))  # this process's own
        assert torch.equal(result["local"][1], grad_b * (rank + 1) ** 2)
        assert torch.equal(result["accumulated"][0], grad_a * 1.5 * 4)  # (g + 3 g) of each, averaged
        assert torch.equal(result["accumulated"][1], grad_b * 2.5 * 4)


def test_ddp_accumulated_gradients_equal_the_whole_batch_gradients_in_one_process(two_process_results):
    # 2 processes x 2 accumulated micro-batches of a tiny GPT-2 through DDP give the gradients of the whole batch's
    # mean loss in one process, up to float rounding (the sums run in another order), identical on both processes
    first, second = (result["lm"] for result in two_process_results)
    alone = two_process_results[0]["lm_alone"]
    assert first.keys() == alone.keys()
    for name, grad in first.items():
        assert torch.equal(grad, second[name]), name
        torch.testing.assert_close(grad, alone[name], rtol=1e-5, atol=1e-7, msg=name)
