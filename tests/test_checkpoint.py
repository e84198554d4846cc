"""checkpoint.py: tidying what an interrupted save left, and the checkpoints written in the background off the GPU.

Elsewhere, end to end through the scripts: a killed and resumed run equals an uninterrupted one, a failed checkpoint
write keeps the previous one in tests/test_resume.py; damaged checkpoints in tests/test_damaged_checkpoints.py; a
process that cannot see process 0's checkpoint stops every process in tests/test_gpu_resilience.py. The RNG states a
checkpoint holds are tested in tests/test_devices.py, the atomic writes in tests/test_files.py, the output directory's
lock in tests/test_output_claim.py, the resume decision in tests/test_resumable.py.
"""

import copy
import io
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from lm_human_preference_details import checkpoint
from lm_human_preference_details.modeling import PolicyWithValueHead
from tests.conftest import tiny_gpt2

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


# ---------------------------------------------------------------- saves that do not block training


class OneProcessAccelerator:
    """The part of an Accelerator that save_training_state uses, for a one-process run."""

    num_processes, process_index, is_main_process = 1, 0, True

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
