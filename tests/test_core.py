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

from lm_human_preference_details import tracking
from lm_human_preference_details.devices import set_seed
from lm_human_preference_details.distributed import GradientAverager, broadcast_parameters
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


def test_allreduce_and_broadcast_single_process_are_noops():
    accelerator = cpu_accelerator()
    assert accelerator.num_processes == 1
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.arange(6.0).view(2, 3)
    before_params = [p.detach().clone() for p in model.parameters()]
    gradients = GradientAverager(list(model.parameters()), accelerator)
    assert gradients.hooks == []  # one process: no hook runs in the backward
    gradients.launch_in_next_backward()
    gradients.average()
    broadcast_parameters(model, accelerator)
    assert torch.equal(model.weight.grad, torch.arange(6.0).view(2, 3))
    assert model.bias.grad is None
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
    import sys

    import torch
    from accelerate import Accelerator

    from lm_human_preference_details.distributed import GradientAverager, broadcast_parameters

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.full((2, 3), 10.0 * (rank + 1)))
    model.b = torch.nn.Parameter(torch.full((4,), -1.0 * (rank + 1), dtype=torch.float64))
    model.c = torch.nn.Parameter(torch.full((5,), 3.0 * (rank + 1)))
    model.a.grad = torch.arange(6.0).view(3, 2).t() * (rank + 1)  # non-contiguous gradient
    model.b.grad = torch.arange(4.0, dtype=torch.float64) * (rank + 1) ** 2
    GradientAverager(list(model.parameters()), accelerator).average()  # gradients set by hand: no backward
    broadcast_parameters(model, accelerator)
    result = {
        "num_processes": accelerator.num_processes,
        "grad_a": model.a.grad,
        "grad_b": model.b.grad,
        "grad_c_is_none": model.c.grad is None,
        "params": {name: p.detach() for name, p in model.named_parameters()},
    }
    torch.save(result, f"{sys.argv[1]}/rank{rank}.pt")
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    """
)


def test_allreduce_and_broadcast_two_processes(tmp_path):
    script = tmp_path / "sync_check.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    # the repository in front of the machine's own PYTHONPATH (which may hold the installed libraries)
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = without_gpus(dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    expected_grad_a = torch.arange(6.0).view(3, 2).t() * 1.5  # mean of x1 and x2
    expected_grad_b = torch.arange(4.0, dtype=torch.float64) * 2.5  # mean of x1 and x4
    for result in results:
        assert result["num_processes"] == 2
        assert torch.equal(result["grad_a"], expected_grad_a)
        assert result["grad_b"].dtype == torch.float64 and torch.equal(result["grad_b"], expected_grad_b)
        assert result["grad_c_is_none"]
        assert torch.equal(result["params"]["a"], torch.full((2, 3), 10.0))
        assert torch.equal(result["params"]["b"], torch.full((4,), -1.0, dtype=torch.float64))
        assert torch.equal(result["params"]["c"], torch.full((5,), 3.0))
