"""checkpoint.py: atomic writes, tidying what an interrupted save left, the output directory's lock, the RNG states
(each process saves and restores only its own GPU's), process 0's decision whether and from where a run resumes, and
the checkpoints written in the background off the GPU.

Elsewhere, end to end through the scripts: a killed and resumed run equals an uninterrupted one, a failed checkpoint
write keeps the previous one, changed settings and used output directories in tests/test_resume.py; damaged
checkpoints in tests/test_damaged_checkpoints.py; one run per --output_dir in tests/test_output_dir_lock.py; the save
on a stop signal in tests/test_stop_signal.py; a process that cannot see process 0's checkpoint stops every process
in tests/test_gpu_resilience.py; the settings check of a task's truncation id (`setting_differences`) in
tests/test_tasks.py.
"""

import copy
import errno
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

from lm_human_preference_details import checkpoint
from lm_human_preference_details.modeling import PolicyWithValueHead
from lm_human_preference_details.settings import RunSettings
from tests.conftest import tiny_gpt2
from tests.planted import fake_checkpoint, lock_record

# ---------------------------------------------------------------- atomic writes


def test_atomic_files_keep_the_old_files_on_error(tmp_path):
    target = tmp_path / "model"
    with checkpoint.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 1}))
    with pytest.raises(RuntimeError), checkpoint.atomic_files(str(target)) as tmp:
        open(os.path.join(tmp, "a.json"), "w").write(json.dumps({"v": 2}))
        raise RuntimeError("killed mid-write")
    assert json.loads((target / "a.json").read_text()) == {"v": 1}
    assert os.listdir(target) == ["a.json"]  # no partial directory, no marker


# ---------------------------------------------------------------- what an interrupted save left


def test_a_cut_replace_gets_its_checkpoint_back(tmp_path, capsys):
    # killed between the two renames of a replace: step2 is gone, its previous copy is .step2.old
    root = checkpoint.state_dir(str(tmp_path))
    os.makedirs(os.path.join(root, ".step2.old"))
    assert checkpoint.clean_interrupted_saves(str(tmp_path)) == (
        f"{root}: restored step2 from its .old copy, left by a run stopped while it saved a checkpoint"
    )
    assert os.listdir(root) == ["step2"]
    assert checkpoint.clean_interrupted_saves(str(tmp_path)) is None


# ---------------------------------------------------------------- the output directory's lock


def test_a_filesystem_without_file_locks_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(checkpoint.fcntl, "flock", no_locks)
    for _ in range(2):
        assert not checkpoint.lock_output_dir(str(tmp_path / "lustre"))  # not held: interrupted saves stay untouched
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    where = tmp_path / "lustre"
    assert f"--output_dir '{where}' is on a filesystem without file locks (Function not implemented)" in err
    checkpoint.release_output_dir_locks()


def test_a_released_lock_leaves_the_output_dir_as_it_found_it(tmp_path):
    new, used = tmp_path / "new", tmp_path / "used"
    used.mkdir()
    for directory in (new, used):
        checkpoint.lock_output_dir(str(directory))
        assert lock_record(directory)["pid"] == os.getpid()
    checkpoint.lock_output_dir(str(new))  # held already by this process: nothing to do
    checkpoint.release_output_dir_locks()
    assert not new.exists() and os.listdir(used) == []


# ---------------------------------------------------------------- RNG states: each process restores its own GPU's


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


# ---------------------------------------------------------------- resume: process 0 decides


class OneProcess:
    """The part of an Accelerator that start_or_resume uses, for a one-process run; prints into `printed`."""

    num_processes, process_index, is_main_process = 1, 0, True

    def __init__(self):
        self.printed: list[str] = []

    def print(self, text: str) -> None:
        self.printed.append(text)


def resume_args(output_dir, resume: str | None) -> RunSettings:
    return RunSettings(output_dir=str(output_dir), resume=resume)


def test_resume_auto_without_a_checkpoint_says_the_run_starts_fresh(tmp_path):
    accelerator = OneProcess()
    assert checkpoint.start_or_resume(resume_args(tmp_path / "mistyped", "auto"), {}, {}, (), accelerator, "4") is None
    assert len(accelerator.printed) == 1
    assert re.search(r"--resume auto found no checkpoint in '.*mistyped/training_state': the run starts fresh \(check "
                     r"--output_dir", accelerator.printed[0])  # fmt: skip
    fake_checkpoint(tmp_path / "run", 2, 1)
    resumed = checkpoint.start_or_resume(resume_args(tmp_path / "run", "auto"), {}, {}, (), accelerator, "4 updates")
    assert resumed.step == 2 and accelerator.printed[-1].startswith("resuming from")
    quiet = OneProcess()
    assert checkpoint.start_or_resume(resume_args(tmp_path / "new", None), {}, {}, (), quiet, "4") is None
    assert quiet.printed == []  # a fresh run that asked for none: nothing to say


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
