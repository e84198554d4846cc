"""What a run asks of its devices: TF32 or full float32 matmuls, deterministic kernels, seeded random
generators, and host-to-device copies that do not wait for the device."""

import os
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def tf32_matmuls() -> bool:
    """Whether torch runs float32 matmuls (cuBLAS) in TF32: the per-backend precision that the kernels read. Every way
    of setting TF32 updates it (the legacy `allow_tf32` flag, `set_float32_matmul_precision`, the per-backend API)
    and reading it never raises; the legacy getters raise once both APIs have been used (torch >= 2.9)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def use_tf32(enabled: bool) -> str:
    """--tf32: float32 matmuls (cuBLAS) and convolutions (cuDNN) in TF32 when `enabled`; off: torch's settings are
    left as they are, and ValueError when torch's matmuls are in TF32 all the same (accelerate turns TF32 on for a
    config with a dynamo backend and no mixed precision). -> the start-up table's entry: what torch will do."""
    if enabled:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    elif tf32_matmuls():
        # refused rather than warned: the run would record tf32=false in args.json and its checkpoints, and say
        # "full float32" in its table, while computing in TF32
        raise ValueError(
            "float32 matmuls run in TF32 (torch.backends.cuda.matmul.fp32_precision is 'tf32') although --tf32 is "
            "not given: something set it before the run, such as accelerate for a config with a dynamo_backend and "
            "no mixed precision. Pass --tf32 to train in TF32, or set dynamo_backend: 'NO' in the accelerate config "
            "(ACCELERATE_DYNAMO_BACKEND=NO) to train in full float32 as OAI did."
        )
    return "on (matmuls in TF32: relative errors up to ~1e-3)" if tf32_matmuls() else "off (full float32, as OAI)"


CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")
"""CUBLAS_WORKSPACE_CONFIG values under which cuBLAS is deterministic (its workspace is not shared between streams)"""


def use_deterministic(enabled: bool) -> None:
    """--deterministic: torch's deterministic algorithms (an operator without one raises), a deterministic cuBLAS
    workspace (set before the first cuBLAS call, i.e. before the models run) and no cuDNN benchmarking; off: torch's
    settings are left as they are."""
    if enabled:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def describe_deterministic() -> str:
    """The start-up table's entry for --deterministic: whether torch will use deterministic algorithms."""
    if torch.are_deterministic_algorithms_enabled():
        return "on (deterministic GPU kernels: a resumed run equals the uninterrupted one on the same GPU model)"
    return "off (GPU kernels may sum in another order from run to run: close, not bit for bit)"


def set_seed(seed: int) -> None:
    """Seed Python's `random`, NumPy's legacy global RNG and torch (CPU and all GPUs)."""
    # OAI seeds NumPy's global RNG with seed + rank * 100003 (the caller adds the rank offset)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _numpy_state(state: tuple) -> tuple:
    """A NumPy legacy RNG state with its key array as a tensor (loadable with torch.load(weights_only=True))."""
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _numpy_state_back(state: Sequence) -> tuple:
    """Inverse of `_numpy_state`."""
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


def rng_states(generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()) -> dict[str, Any]:
    """This process's RNG states: Python, NumPy global, torch CPU, its own GPU's (the current device; None without
    CUDA), the sampling generator, `numpy_rngs`."""
    # only this process's GPU: a run saved with 8 GPUs visible to each process resumes where each sees 1 (a scheduler)
    return {
        "python": random.getstate(),
        "numpy": _numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "generator": generator.get_state(),
        "numpy_rngs": [_numpy_state(rng.get_state()) for rng in numpy_rngs],
    }


def restore_rng_states(
    states: dict[str, Any], generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()
) -> None:
    """Set every RNG back to `states` (from `rng_states`); the number of `numpy_rngs` must match."""
    if len(states["numpy_rngs"]) != len(numpy_rngs):
        raise ValueError(
            f"the checkpoint holds {len(states['numpy_rngs'])} NumPy RNG streams, this run has {len(numpy_rngs)}; "
            "resume with the checkpoint's batch sizes and number of processes."
        )
    random.setstate(states["python"])
    np.random.set_state(_numpy_state_back(states["numpy"]))
    torch.set_rng_state(states["torch"])
    if isinstance(states["cuda"], torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])  # onto the current device, whichever index it has now
    generator.set_state(states["generator"])
    for rng, state in zip(numpy_rngs, states["numpy_rngs"]):
        rng.set_state(_numpy_state_back(state))


def reseed_rngs(
    seed: int, rank: int, step: int, generator: torch.Generator, numpy_rngs: Sequence[np.random.RandomState] = ()
) -> None:
    """Seed Python's, NumPy's and torch's global RNGs, `generator` and `numpy_rngs` from (seed, rank, step): for a
    process that continues a checkpoint of another number of processes, whose RNG states cannot be divided among it."""
    seeds = np.random.SeedSequence([seed, rank, step]).generate_state(3 + len(numpy_rngs))
    set_seed(int(seeds[0]))
    generator.manual_seed(int(seeds[1]) << 32 | int(seeds[2]))
    for rng, rng_seed in zip(numpy_rngs, seeds[3:]):
        rng.seed(int(rng_seed))


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (in host memory) on `device`, without a host sync: on CUDA it is pinned first and copied
    asynchronously (a copy from pageable memory waits for every kernel queued before it)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
