"""lm_human_preference_details/devices.py: seeds (spec TV13: OAI's label order of seed 1), and the RNG states a
checkpoint holds (each process saves and restores only its own GPU's)."""

import numpy as np
import torch

from lm_human_preference_details import devices


def test_set_seed_numpy_legacy_rng_reproduces_tv13():
    devices.set_seed(1)
    order = np.random.permutation(4992)
    assert order[:12].tolist() == [4486, 2985, 3023, 1328, 1687, 4855, 2721, 2442, 687, 1321, 2188, 1272]
    assert order[-4:].tolist() == [2763, 905, 3980, 235]


def test_set_seed_makes_torch_and_python_reproducible():
    import random

    devices.set_seed(7)
    first = (torch.rand(3), random.random())
    devices.set_seed(7)
    second = (torch.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and first[1] == second[1]


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
    torch.save(devices.rng_states(generator), tmp_path / "rng.pt")
    # resumed under a scheduler that shows the process one GPU, cuda:0
    resuming = FakeCuda(visible=1, current=0)
    resuming.install(monkeypatch)
    states = torch.load(tmp_path / "rng.pt", weights_only=True)
    devices.restore_rng_states(states, generator)
    assert torch.equal(resuming.states[0], saving.states[3])  # its own GPU's stream continues


def test_cuda_rng_state_is_none_without_cuda_and_restores_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    generator = torch.Generator().manual_seed(5)
    states = devices.rng_states(generator, [np.random.RandomState(1)])
    assert states["cuda"] is None
    expected = torch.rand(3, generator=generator)
    devices.restore_rng_states(states, generator, [np.random.RandomState(2)])
    assert torch.equal(torch.rand(3, generator=generator), expected)


def test_a_checkpoint_of_a_cpu_run_resumes_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    states = devices.rng_states(torch.Generator())
    gpu = FakeCuda(visible=1, current=0)
    gpu.install(monkeypatch)
    before = gpu.states[0].clone()
    devices.restore_rng_states(states, torch.Generator())
    assert torch.equal(gpu.states[0], before)  # nothing saved for it: left as seeded
