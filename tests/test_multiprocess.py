"""Several processes and nodes: a failing rank ends the whole run within a bounded time, 2 nodes x 1 process give the
same run as 1 node x 2 processes, accelerate's one-process CPU launch is refused, the accelerate configs parse."""

import contextlib
import glob
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from lm_human_preference_details import distributed
from lm_human_preference_details.instruments.compare import read_tensorboard
from tests.planted import REPO, books_task, free_port, without_gpus, write_policy_planted_labels, write_query_file
from tests.test_train_policy import save_reward_model

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
TASK_FLAGS = ["--task.query_length", "16", "--task.response_length", "8", "--task.truncate_after", "4"]
EXIT_BOUND = 30.0
"""seconds within which every process must have exited after one rank failed (torchrun's SIGTERM grace period)"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer, tiny_model_dir):
    """A query corpus and 64 planted labels on the tiny model's samples; the flags of tiny runs of both scripts."""
    root = tmp_path_factory.mktemp("multiprocess")
    corpus = write_query_file(root / "queries.txt")
    labels = write_policy_planted_labels(
        root / "labels.json", tiny_model_dir, tokenizer, corpus, 64, 16, 8, tokenizer.encode(" happy")[0]
    )
    common = ["--base_model", tiny_model_dir, "--task.query_dataset", str(corpus), *TASK_FLAGS]
    reward = [*common, "--label_dataset", str(labels), "--labels.num_train", "32", "--batch_size", "16"]
    reward += ["--lr", "1e-3", "--rollout_batch_size", "16", "--normalize_samples", "16"]
    policy = [*common, "--ppo.batch_size", "16", "--ppo.total_episodes", "32", "--ppo.lr", "1e-3"]
    policy += ["--log_interval", "1", "--print_samples", "1"]
    task = books_task(query_dataset=str(corpus), query_length=16, response_length=8, truncate_after=4)
    random_reward_model = save_reward_model(root / "rm", tiny_model_dir, task)
    return {"root": root, "reward": reward, "policy": policy, "random_reward_model": random_reward_model}


def torchrun(nodes: int, port: int, launcher: Path, *args: str) -> list[list[str]]:
    """The torchrun command of each node: 1 node x 2 processes, or 2 nodes x 1 process over loopback."""
    base = [sys.executable, "-m", "torch.distributed.run", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    if nodes == 1:
        return [[*base, "--nproc_per_node", "2", str(launcher), *args]]
    node = [*base, "--nnodes", "2", "--nproc_per_node", "1"]
    return [[*node, "--node_rank", str(rank), str(launcher), *args] for rank in (0, 1)]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (torchrun starts its workers in sessions of their own)."""
    try:
        parent = psutil.Process(pid)
        family = [*parent.children(recursive=True), parent]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def run_all(commands: list[list[str]], timeout: float, log_dir: Path) -> tuple[list[int], list[str], float]:
    """Run the commands at once, output to files in `log_dir`; -> exit codes, outputs, time when the last one ended.

    Past `timeout` every process and its workers are killed and the test fails: a hang never outlives the test.
    """
    logs = [log_dir / f"node{i}.log" for i in range(len(commands))]
    procs = []
    for command, log in zip(commands, logs):
        with open(log, "w") as out:
            env = without_gpus({**os.environ, **ENV})
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline = time.time() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc.pid)
        pytest.fail(f"the processes were still running after {timeout} s: a hang")
    return [proc.returncode for proc in procs], [log.read_text() for log in logs], time.time()


# ---------------------------------------------------------------- a failing rank ends the run

FAILING_LAUNCHER = """
import contextlib, os, signal, sys, time
import torch
sys.path.insert(0, {repo!r})
from lm_human_preference_details import cli, distributed
import {script} as script

mode, marker = sys.argv[1], sys.argv[2]
calls = 0
averaging_gradients = distributed.averaging_gradients


@contextlib.contextmanager
def failing_averaging(trained, average):
    global calls
    calls += average
    if average and calls == 2 and torch.distributed.get_rank() == 1:  # rank 0 goes on into the all-reduces
        with open(marker, "w") as f:
            f.write(str(time.time()))
        if mode == "raise":
            raise RuntimeError("injected failure of rank 1")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # stall: alive, but never joins the all-reduce
    with averaging_gradients(trained, average):
        yield


distributed.averaging_gradients = failing_averaging
cli.run(script.main, script.parse, sys.argv[3:])
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, mode, nodes",
    [("train_policy", "raise", 1), ("train_reward", "sigkill", 1), ("train_policy", "sigkill", 2),
     ("train_reward", "stall", 1)],
)  # fmt: skip
def test_a_failing_rank_stops_every_process_in_bounded_time(tmp_path, world, script, mode, nodes):
    launcher = tmp_path / "launch.py"
    launcher.write_text(FAILING_LAUNCHER.format(repo=str(REPO), script=script))
    marker = tmp_path / "failed_at"
    flags = [*world[script.split("_")[1]], "--output_dir", str(tmp_path / "out")]
    if script == "train_policy":
        flags += ["--rewards.trained_model", world["random_reward_model"]]
    if mode == "stall":
        flags += ["--dist_timeout", "8"]  # the survivor's all-reduce gives up after 8 s instead of 30 minutes
    codes, outputs, ended = run_all(torchrun(nodes, free_port(), launcher, mode, str(marker), *flags), 240, tmp_path)
    text = "\n".join(outputs)
    assert marker.exists(), text[-5000:]  # rank 1 did fail, at its second all-reduce
    assert all(code != 0 for code in codes), text[-5000:]
    delay = ended - float(marker.read_text())
    bound = EXIT_BOUND + (8 if mode == "stall" else 0)
    assert delay < bound, f"{delay:.1f} s after the failure"
    print(f"{script} {mode} {nodes} node(s): every process exited {delay:.1f} s after rank 1 failed")
    if mode == "stall":
        assert "Timed out waiting 8000ms" in text  # rank 0 gave up after --dist_timeout, not gloo's 30 minutes


# ---------------------------------------------------------------- 2 nodes x 1 process == 1 node x 2 processes

PIPELINE_LAUNCHER = """
import json, sys
sys.path.insert(0, {repo!r})
import train_policy, train_reward
from lm_human_preference_details import cli

out = sys.argv[1]
cli.run(train_reward.main, train_reward.parse, [*{reward!r}, "--output_dir", out + "/reward"])
cli.run(train_policy.main, train_policy.parse,
        [*{policy!r}, "--rewards.trained_model", out + "/reward", "--output_dir", out + "/policy"])
"""


def run_outputs(run_dir: Path) -> dict[str, np.ndarray]:
    """Every logged scalar (but wall-clock times) and every saved weight of a run directory, by name."""
    values = {}
    for tag, column in read_tensorboard(str(run_dir)).items():
        if not any(word in tag for word in ("time", "elapsed/fps", "per_second")):
            values[f"tb:{tag}"] = column
    for file in sorted(glob.glob(str(run_dir / "*.safetensors"))):
        for name, tensor in load_file(file).items():
            values[f"{Path(file).name}:{name}"] = tensor.double().numpy()
    return values


@pytest.mark.slow
def test_two_nodes_give_the_run_of_one_node_for_both_scripts(tmp_path, world):
    launcher = tmp_path / "launch.py"
    launcher.write_text(PIPELINE_LAUNCHER.format(repo=str(REPO), reward=world["reward"], policy=world["policy"]))
    runs = {}
    for nodes in (1, 2):
        out = tmp_path / f"nodes{nodes}"
        codes, outputs, _ = run_all(torchrun(nodes, free_port(), launcher, str(out)), 300, tmp_path)
        assert codes == [0] * nodes, "\n".join(outputs)[-5000:]
        assert re.search(r"processes\s+│ 2 ", outputs[0]), outputs[0][-3000:]  # both scripts ran 2 processes
        runs[nodes] = {script: run_outputs(out / script) for script in ("reward", "policy")}
    for script in ("reward", "policy"):
        one, two = runs[1][script], runs[2][script]
        assert one.keys() == two.keys() and any(k.startswith("tb:") for k in one) and len(one) > 20
        diff = max(float(np.nanmax(np.abs(one[k] - two[k]))) if one[k].size else 0.0 for k in one)
        print(f"{script}: max abs difference, 2 nodes vs 1 node, over {len(one)} metrics and weights: {diff:.3g}")
        assert diff <= 1e-6
        for key in one:
            np.testing.assert_array_equal(np.isnan(one[key]), np.isnan(two[key]), err_msg=key)


# ---------------------------------------------------------------- accelerate's one-process CPU launch


def test_check_launch_refuses_accelerates_one_process_launch():
    accelerate_cpu = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=r"started 1 process.*torchrun --nproc_per_node N train_policy.py"):
        distributed.check_launch(accelerate_cpu, "train_policy.py")
    with pytest.raises(ValueError, match="started 1 process"):  # without --cpu on a machine with fewer GPUs
        distributed.check_launch({**accelerate_cpu, "ACCELERATE_USE_CPU": "False"}, "train_reward.py")
    distributed.check_launch(
        {**accelerate_cpu, "WORLD_SIZE": "2", "RANK": "0"}, "x.py"
    )  # torchrun, accelerate --multi_gpu
    distributed.check_launch({**accelerate_cpu, "PMI_SIZE": "4"}, "x.py")  # accelerate launch --mpirun_hostfile
    distributed.check_launch({"ACCELERATE_USE_CPU": "True"}, "x.py")  # accelerate launch --cpu with one process
    distributed.check_launch({"MASTER_PORT": "29500"}, "x.py")  # a plain python run
    with pytest.raises(ValueError, match="--dist_timeout must be a positive"):
        distributed.make_accelerator(0.0)


def test_more_processes_per_machine_than_gpus_stop_at_the_start_in_one_line(monkeypatch):
    # a machine with 1 GPU, faked: torchrun --nproc_per_node 2 (or accelerate launch --multi_gpu --num_processes 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"}
    for environ in (two, {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}):
        with pytest.raises(ValueError) as error:
            distributed.check_gpus_per_process(environ)
        message = str(error.value)
        assert "\n" not in message and "2 processes on this machine" in message and "1 GPU(s) visible" in message
        assert "--nproc_per_node 1" in message and "CUDA_VISIBLE_DEVICES=" in message
    distributed.check_gpus_per_process({**two, "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"})  # 4 machines x 1 process
    distributed.check_gpus_per_process({**two, "ACCELERATE_USE_CPU": "True"})  # accelerate launch --cpu: gloo on CPU
    distributed.check_gpus_per_process({})  # one process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    distributed.check_gpus_per_process(two)  # one GPU each
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    distributed.check_gpus_per_process({**two, "LOCAL_WORLD_SIZE": "8"})  # no GPU: every process on CPU (gloo)
    # the training scripts' accelerator checks it before it starts a process group
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, value in two.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="2 processes on this machine"):
        distributed.make_accelerator()


def test_every_multi_process_launch_of_the_tests_hides_the_gpus():
    """The multi-process tests compare CPU (gloo) runs; on a GPU machine they would otherwise share its GPUs."""
    assert without_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "A": "1"}) == {"CUDA_VISIBLE_DEVICES": "", "A": "1"}
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"]
    seen = subprocess.run(probe, env=without_gpus(os.environ), capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == "0", seen.stderr[-2000:]
    launchers = ("torch.distributed.run", "accelerate_cli")
    sources = {path.name: path.read_text(encoding="utf-8") for path in (REPO / "tests").glob("*.py")}
    launching = sorted(name for name, text in sources.items() if any(launcher in text for launcher in launchers))
    assert len(launching) >= 9, launching
    assert "without_gpus(" in inspect.getsource(run_all)  # a launch through run_all hides them too
    hidden = ("without_gpus(", "run_all(")
    assert not [name for name in launching if not any(way in sources[name] for way in hidden)], launching


@pytest.mark.slow
def test_accelerate_launch_cpu_with_two_processes_stops_with_one_line(tmp_path):
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu", "--num_processes", "2"]
    command += ["--main_process_port", str(free_port()), str(REPO / "train_policy.py"), "--dry_run"]
    env = without_gpus({**os.environ, **ENV})
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "torchrun --nproc_per_node N train_policy.py" in errors[0], result.stderr[-3000:]
    assert 'train_policy.py", line' not in result.stderr  # no traceback of the script (accelerate prints its own)
    assert "processes" not in result.stdout  # stopped before the size table


# ---------------------------------------------------------------- accelerate configs


def test_accelerate_configs_parse_with_accelerates_loader():
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    expected = {  # file: (distributed type, processes in all, machines)
        "1gpu.yaml": (DistributedType.NO, 1, 1),
        "8gpu.yaml": (DistributedType.MULTI_GPU, 8, 1),
        "2nodes_8gpu.yaml": (DistributedType.MULTI_GPU, 16, 2),
    }
    files = sorted(os.path.basename(f) for f in glob.glob(str(REPO / "configs" / "accelerate" / "*.yaml")))
    assert files == sorted(expected)
    page = (REPO / "docs" / "multiprocess.md").read_text(encoding="utf-8")
    for name, (kind, processes, machines) in expected.items():
        config = load_config_from_file(str(REPO / "configs" / "accelerate" / name))
        assert isinstance(config, ClusterConfig) and config.distributed_type == kind, name
        assert (config.num_processes, config.num_machines) == (processes, machines), name
        assert config.mixed_precision == "no" and not config.use_cpu, name  # fp32 as OAI
        assert f"--config_file configs/accelerate/{name}" in page, name
    assert "torchrun --nproc_per_node" in page
