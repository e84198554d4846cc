"""lm_human_preference_details/distributed.py: one process runs the module itself; with 2 gloo processes, rank 0's
weights everywhere and DDP's mean of the processes' gradients (spec O4, D6), with gradient accumulation; a CPU
accelerator after one built on a GPU.

Elsewhere: the all-reduce overlapped with the backward, in each script's steps, in tests/test_allreduce.py."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState

from lm_human_preference_details import distributed
from lm_human_preference_details.distributed import broadcast_parameters
from tests.conftest import cpu_accelerator, forget_accelerate_state_unless_on
from tests.fidelity import FakeWorld
from tests.planted import free_port, without_gpus

REPO_ROOT = Path(__file__).resolve().parents[1]


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
