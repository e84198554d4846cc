"""What a run asks of its devices: TF32 or full float32 matmuls, deterministic kernels, seeded random
generators, and host-to-device copies that do not wait for the device."""

import os
import random

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


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (in host memory) on `device`, without a host sync: on CUDA it is pinned first and copied
    asynchronously (a copy from pageable memory waits for every kernel queued before it)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
