"""The GPU path's resilience, checked on CPU: each process saves and restores only its own GPU's RNG state; process 0
decides whether and from where a run resumes, and a process that cannot see that checkpoint stops them all;
--tf32 in every script that trains or samples; checkpoints written in the background."""

import copy
import dataclasses
import io
import json
import os
import re
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import evaluate
import label_generation
import train_policy
import train_reward
from lm_human_preference_details import checkpoint, devices
from lm_human_preference_details.modeling import PolicyWithValueHead
from tests.conftest import tiny_gpt2
from tests.planted import REPO, free_port, write_query_file
from tests.test_multiprocess import run_all, torchrun


class FakeCuda:
    """torch.cuda's RNG functions over `visible` simulated GPUs: a device index beyond them raises IndexError, as
    torch.cuda.set_rng_state does (torch.cuda.default_generators[index])."""

    def __init__(self, visible: int, current: int):
        self.visible, self.current = visible, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(visible)}

    def index(self, device) -> int:
        device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        index = self.current if device.index is None else device.index
        if index >= self.visible:
            raise IndexError("tuple index out of range")
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self.index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self.index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.visible)]

    def set_rng_state_all(self, states) -> None:
        for i, state in enumerate(states):
            self.set_rng_state(state, i)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.visible)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))


def test_cuda_rng_state_saved_with_8_visible_gpus_resumes_with_1(monkeypatch, tmp_path):
    # saved by process 3 of an `accelerate launch --num_processes 8` run: 8 GPUs visible, its own is cuda:3
    saving = FakeCuda(visible=8, current=3)
    saving.install(monkeypatch)
    generator = torch.Generator()
    torch.save(checkpoint.rng_states(generator), tmp_path / "rng.pt")
    # resumed under a scheduler that shows the process one GPU, cuda:0
    resuming = FakeCuda(visible=1, current=0)
    resuming.install(monkeypatch)
    states = torch.load(tmp_path / "rng.pt", weights_only=True)
    checkpoint.restore_rng_states(states, generator)
    assert torch.equal(resuming.states[0], saving.states[3])  # its own GPU's stream continues


def test_cuda_rng_state_is_none_without_cuda_and_restores_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    generator = torch.Generator().manual_seed(5)
    states = checkpoint.rng_states(generator, [np.random.RandomState(1)])
    assert states["cuda"] is None
    expected = torch.rand(3, generator=generator)
    checkpoint.restore_rng_states(states, generator, [np.random.RandomState(2)])
    assert torch.equal(torch.rand(3, generator=generator), expected)


def test_a_checkpoint_of_a_cpu_run_resumes_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    states = checkpoint.rng_states(torch.Generator())
    gpu = FakeCuda(visible=1, current=0)
    gpu.install(monkeypatch)
    before = gpu.states[0].clone()
    checkpoint.restore_rng_states(states, torch.Generator())
    assert torch.equal(gpu.states[0], before)  # nothing saved for it: left as seeded


# ---------------------------------------------------------------- resume: process 0 decides, every process follows


def fake_checkpoint(output_dir, step: int, world_size: int) -> str:
    """A checkpoint directory with the files `load_training_state` reads (no weights: only the decision is tested)."""
    path = checkpoint.step_dir(str(output_dir), step)
    os.makedirs(path)
    with open(os.path.join(path, checkpoint.META_FILE), "w") as f:
        json.dump({"step": step, "world_size": world_size, "settings": {}, "run_name": "r", "wandb_id": None}, f)
    torch.save({}, os.path.join(path, checkpoint.SHARED_FILE))
    for rank in range(world_size):
        torch.save({}, os.path.join(path, checkpoint.RANK_FILE.format(rank=rank)))
    return path


class OneProcess:
    """The part of an Accelerator that start_or_resume uses, for a one-process run; prints into `printed`."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self):
        self.printed: list[str] = []

    def print(self, text: str) -> None:
        self.printed.append(text)


def resume_args(output_dir, resume: str | None) -> SimpleNamespace:
    return SimpleNamespace(
        output_dir=str(output_dir), resume=resume, overwrite_output_dir=False, allow_resume_changes=0
    )


def test_resume_auto_without_a_checkpoint_says_the_run_starts_fresh(tmp_path):
    accelerator = OneProcess()
    assert checkpoint.start_or_resume(resume_args(tmp_path / "mistyped", "auto"), {}, (), accelerator, "4") is None
    assert len(accelerator.printed) == 1
    assert re.search(r"--resume auto found no checkpoint in '.*mistyped/training_state': the run starts fresh \(check "
                     r"--output_dir", accelerator.printed[0])  # fmt: skip
    fake_checkpoint(tmp_path / "run", 2, 1)
    resumed = checkpoint.start_or_resume(resume_args(tmp_path / "run", "auto"), {}, (), accelerator, "4 updates")
    assert resumed.step == 2 and accelerator.printed[-1].startswith("resuming from")
    quiet = OneProcess()
    assert checkpoint.start_or_resume(resume_args(tmp_path / "new", None), {}, (), quiet, "4") is None
    assert quiet.printed == []  # a fresh run that asked for none: nothing to say


SPLIT_OUTPUT_LAUNCHER = """
import os, sys
sys.path.insert(0, {repo!r})
from lm_human_preference_details import cli
import train_policy

# the same --output_dir path names another directory on each process, as on nodes whose --output_dir is a local disk
os.chdir(os.path.join(sys.argv[1], "node" + os.environ["RANK"]))
cli.run(train_policy.main, train_policy.parse, [*sys.argv[2:], "--output_dir", "out"])
"""


@pytest.mark.slow
def test_a_process_that_cannot_see_the_checkpoint_stops_every_process(tmp_path, tiny_model_dir):
    fake_checkpoint(tmp_path / "node0" / "out", 2, 2)  # only process 0 sees a checkpoint
    os.makedirs(tmp_path / "node1")
    launcher = tmp_path / "launch.py"
    launcher.write_text(SPLIT_OUTPUT_LAUNCHER.format(repo=str(REPO)))
    flags = ["--base_model", tiny_model_dir, "--task.query_dataset", str(write_query_file(tmp_path / "q.txt", 20))]
    flags += ["--rewards.trained_model", str(tmp_path / "reward"), "--resume", "auto"]
    start = time.time()
    codes, outputs, ended = run_all(torchrun(1, free_port(), launcher, str(tmp_path), *flags), 120, tmp_path)
    text = outputs[0]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert codes != [0], text[-3000:]
    # every process raises the line at once; torchrun ends the others when the first one exits, maybe before they
    # print theirs: at least one, and no other error
    assert 1 <= len(errors) <= 2, text[-3000:]
    for line in errors:
        assert "process 1 of 2 cannot see checkpoint 'out/training_state/step2'" in line
        assert "--output_dir must be on a filesystem that every node sees" in line
    assert f'File "{REPO}' not in text and "resuming from" not in text  # no traceback of the project (torchrun's own)
    assert ended - start < 90  # no process waited for another until --dist_timeout (30 min)
    print(f"every process exited {ended - start:.1f} s after the start")


# ---------------------------------------------------------------- --tf32


@pytest.fixture
def float32_precision():
    """Restores torch's TF32 settings after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_use_tf32_sets_tf32_and_its_default_leaves_torch_as_it_was(float32_precision):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    assert devices.use_tf32(False).startswith("off")
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    assert devices.use_tf32(True).startswith("on")
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")


def dry_run_flags(script: str, tmp_path, model_dir: str) -> tuple[object, list[str]]:
    """A script module and the flags of a dry run of it that touches nothing."""
    out = ["--output_dir", str(tmp_path / "out")]
    if script == "evaluate":
        return evaluate, ["--policy", model_dir, "--reward_model", model_dir, *out, "--dry_run"]
    if script == "label_generation":
        return label_generation, [
            "generate",
            "--base_model",
            model_dir,
            "--output",
            str(tmp_path / "l.json"),
            "--dry_run",
        ]
    if script == "train_policy":  # a dry run checks its inputs: a reward with none to check
        return train_policy, [*out, "--rewards.trained_model", "vader", "--dry_run"]
    return train_reward, [*out, "--dry_run"]


@pytest.mark.parametrize("script", ["train_policy", "train_reward", "label_generation", "evaluate"])
def test_every_script_that_trains_or_samples_takes_tf32_and_shows_it(
    script, tmp_path, tiny_model_dir, capsys, float32_precision
):
    module, flags = dry_run_flags(script, tmp_path, tiny_model_dir)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    module.main(module.parse(flags))
    assert re.search(r"TF32\s+│ off \(full float32, as OAI\)", capsys.readouterr().out)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # the default leaves torch as it is
    module.main(module.parse([*flags, "--tf32"]))
    assert re.search(r"TF32\s+│ on \(matmuls in TF32", capsys.readouterr().out)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


@pytest.fixture
def legacy_tf32():
    """Restores torch's TF32 settings, the legacy flag included, after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    generic = torch.backends.fp32_precision
    yield
    torch.set_float32_matmul_precision("highest")  # the legacy setting back off, so both APIs agree again
    torch.backends.fp32_precision = generic
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def accelerate_dynamo_tf32() -> None:
    """What accelerate's AcceleratorState does on a GPU for a config with a dynamo_backend and no mixed precision
    (accelerate/state.py; skipped on CPU, so done here)."""
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.parametrize(
    "set_tf32",
    [
        accelerate_dynamo_tf32,
        lambda: torch.set_float32_matmul_precision("high"),
        lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    ],
    ids=["accelerate-dynamo", "matmul-precision-high", "generic-precision"],
)
def test_tf32_turned_on_outside_the_flag_stops_the_run_and_the_flag_shows_what_torch_does(
    set_tf32, tmp_path, tiny_model_dir, capsys, legacy_tf32
):
    module, flags = dry_run_flags("train_reward", tmp_path, tiny_model_dir)
    set_tf32()
    with pytest.raises(ValueError, match=r"run in TF32 .* although --tf32 is not given.*dynamo_backend"):
        module.main(module.parse(flags))
    assert "off (full float32" not in capsys.readouterr().out  # never said
    module.main(module.parse([*flags, "--tf32"]))
    assert re.search(r"TF32\s+│ on \(matmuls in TF32", capsys.readouterr().out)


# ---------------------------------------------------------------- --deterministic


@pytest.mark.parametrize("script", ["train_policy", "train_reward", "label_generation", "evaluate"])
def test_deterministic_turns_on_torchs_deterministic_algorithms_and_shows_it(
    script, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    module, flags = dry_run_flags(script, tmp_path, tiny_model_dir)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # a setting under which cuBLAS is not deterministic
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    module.main(module.parse(flags))
    assert re.search(r"deterministic\s+│ off", capsys.readouterr().out)
    assert not torch.are_deterministic_algorithms_enabled()  # the default leaves torch as it is
    try:
        args = module.parse([*flags, "--deterministic"])
        module.main(args)
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert re.search(r"deterministic\s+│ on \(deterministic GPU kernels", capsys.readouterr().out)
    assert dataclasses.asdict(args)["deterministic"] is True  # in args.json and the training checkpoints' settings


# ---------------------------------------------------------------- saves that do not block training


class OneProcessAccelerator(OneProcess):
    """OneProcess with the barrier that save_training_state calls."""

    def wait_for_everyone(self) -> None:
        pass


def gated_save(monkeypatch, gate: threading.Event, started: threading.Event):
    """torch.save in checkpoint.py, except that state.pt waits for `gate` (after setting `started`)."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if os.path.basename(str(path)) == checkpoint.SHARED_FILE:
            started.set()
            assert gate.wait(30)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)


def test_a_background_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path, monkeypatch):
    model = PolicyWithValueHead(tiny_gpt2())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.value_head.weight.grad = torch.ones_like(model.value_head.weight)
    optimizer.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = optimizer.state[model.value_head.weight]["exp_avg"].clone()
    gate, started = threading.Event(), threading.Event()
    gated_save(monkeypatch, gate, started)
    saves = checkpoint.BackgroundSaves()
    shared = {"model": saves.host_copy(model).state_dict(), "optimizer": checkpoint.to_host(optimizer.state_dict())}
    written = []
    path = checkpoint.save_training_state(
        str(tmp_path), 1, OneProcessAccelerator(), {}, shared, {"r": 0}, 2, saves, then=lambda: written.append(1)
    )
    assert started.wait(30) and not os.path.exists(path) and written == []  # returned while state.pt is written
    with torch.no_grad():  # training goes on: the next update changes weights and Adam moments in place
        for p in model.parameters():
            p.add_(1.0)
        model.value_head.weight.grad = torch.ones_like(model.value_head.weight)
        optimizer.step()
    gate.set()
    saves.wait()
    assert written == [1]  # `then` ran after the checkpoint was published
    state = checkpoint.load_training_state(path, 0)
    assert all(torch.equal(state.shared["model"][k], v) for k, v in expected.items())
    moments = state.shared["optimizer"]["state"]
    assert any(torch.equal(m["exp_avg"], expected_moment) for m in moments.values())
    twin = saves.host_copy(model)  # ties kept, no gradients, refilled at each call
    assert twin.lm.lm_head.weight is twin.lm.transformer.wte.weight and twin.value_head.weight.grad is None
    assert torch.equal(twin.lm.lm_head.weight, model.lm.lm_head.weight)


def reachable_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through containers and object attributes (what a deep copy copies)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, str, bytes, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend([*obj.keys(), *obj.values()])
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not callable(obj) or isinstance(obj, torch.nn.Module):
            stack.extend(vars(obj).values())
    return found


def test_the_host_copy_holds_the_state_dict_only_not_what_the_module_keeps_beside_it():
    model = PolicyWithValueHead(tiny_gpt2())
    expected = io.BytesIO()
    torch.save(copy.deepcopy(model).state_dict(), expected)  # what a checkpoint held before
    # what the compiled sampler keeps in the module's __dict__: a static KV cache on the policy's device (GPU proxy)
    kv_cache = torch.ones(4, 2, 64, 16)
    model.__dict__["_decode_caches"] = {"cache": SimpleNamespace(keys=kv_cache)}
    twin = checkpoint.BackgroundSaves().host_copy(model)
    stored = [t for t in reachable_tensors(twin) if t.device.type != "meta"]
    state = {t.untyped_storage().data_ptr() for t in twin.state_dict().values()}
    assert {t.untyped_storage().data_ptr() for t in stored} <= state | {t.data_ptr() for t in twin.buffers()}
    assert twin.__dict__["_decode_caches"]["cache"].keys.device.type == "meta"  # its shape, no memory
    saved = io.BytesIO()
    torch.save(twin.state_dict(), saved)
    assert saved.getvalue() == expected.getvalue()  # the checkpoint's bytes are those of before


def test_the_next_background_save_waits_for_the_previous_one_and_errors_reach_the_training_thread(tmp_path):
    saves, order = checkpoint.BackgroundSaves(), []

    def write(name: str, seconds: float):
        order.append(f"{name} starts")
        time.sleep(seconds)
        order.append(f"{name} ends")

    saves.start(lambda: write("first", 0.3))
    saves.start(lambda: write("second", 0.0))
    saves.wait()
    assert order == ["first starts", "first ends", "second starts", "second ends"]

    def disk_full():
        raise OSError(28, "No space left on device")

    saves.start(disk_full)
    saves._thread.join()
    with pytest.raises(OSError, match="No space left"):
        saves.raise_error()  # what the training loop calls after every update
    saves.raise_error()  # raised once
    saves.start(disk_full)
    with pytest.raises(OSError, match="No space left"):
        saves.start(lambda: None)  # the next save raises it too
    saves.wait()
