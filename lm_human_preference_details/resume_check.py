"""Does a run killed and resumed log and save what the uninterrupted run does? Kill a script as a preempted machine
would, read back what two runs logged and saved, and measure how far apart they are.

Used by the resume tests and by `benchmark/gpu_check.py`.
"""

import contextlib
import os
import signal
import subprocess
import time

import psutil
import torch
from safetensors.torch import load_file

from lm_human_preference_details import checkpoint

TIMING_METRICS = ("elapsed/time", "elapsed/fps", "debug/time/")
"""wall-clock metrics, which no two runs share"""


def scalars(output_dir) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar series of a run as TensorBoard shows it (points purged by a resume left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # only readers need it

    events = EventAccumulator(os.path.join(output_dir, "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
        if not tag.startswith(TIMING_METRICS)
    }


def max_metric_difference(resumed: dict, uninterrupted: dict, from_step: int) -> float:
    """Largest |difference| of the points logged at or after `from_step`; the series must have the same steps."""
    if resumed.keys() != uninterrupted.keys():
        raise ValueError(f"the runs logged other metrics: {sorted(set(resumed) ^ set(uninterrupted))}")
    worst = 0.0
    for tag, series in uninterrupted.items():
        if [s for s, _ in resumed[tag]] != [s for s, _ in series]:  # a point lost, duplicated or mixed up
            raise ValueError(f"{tag}: logged at steps {[s for s, _ in resumed[tag]]}, not {[s for s, _ in series]}")
        worst = max([worst, *(abs(a - b) for (step, a), (_, b) in zip(resumed[tag], series) if step >= from_step)])
    return worst


def max_weight_difference(resumed: dict[str, torch.Tensor], uninterrupted: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over all tensors of two state dicts with the same keys."""
    if resumed.keys() != uninterrupted.keys():
        raise ValueError(f"the state dicts hold other tensors: {sorted(set(resumed) ^ set(uninterrupted))[:5]}")
    return max((resumed[k].double() - uninterrupted[k].double()).abs().max().item() for k in uninterrupted)


def saved_files(output_dir, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of the final model files `names` at the top of a run directory."""
    return {f"{name}:{k}": v for name in names for k, v in load_file(os.path.join(output_dir, name)).items()}


def final_training_state(output_dir) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of a run's newest checkpoint."""
    state = torch.load(os.path.join(checkpoint.latest_checkpoint(str(output_dir)), "state.pt"), weights_only=True)
    tensors = {f"model.{k}": v for k, v in state.get("policy", state.get("model")).items()}
    for index, moments in state["optimizer"]["state"].items():
        tensors.update({f"adam.{index}.{k}": v for k, v in moments.items() if isinstance(v, torch.Tensor)})
    return tensors


def _kill_tree(pid: int) -> None:
    """SIGKILL process `pid`, its process group and every descendant: torchrun starts its workers in sessions of
    their own, which a signal to its group misses."""
    family = []
    with contextlib.suppress(psutil.NoSuchProcess):
        family = psutil.Process(pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def start_and_kill(
    command: list[str], output_dir, kill_after: int, delay: float, env: dict[str, str], cwd, timeout: float = 300
) -> int:
    """Start `command` (a script, or torchrun and its processes) in a process group of its own and SIGKILL the whole
    group `delay` s after checkpoint `kill_after` appears, as a preempted machine; -> the newest checkpoint's step.
    Its output goes to OUTPUT_DIR.log beside the output directory; raises if it ended before the kill."""
    log_path = os.path.join(os.path.dirname(str(output_dir)), f"{os.path.basename(str(output_dir))}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=log, start_new_session=True)
        target = checkpoint.step_dir(str(output_dir), kill_after)
        deadline = time.time() + timeout
        try:
            while not os.path.isdir(target) and proc.poll() is None and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(delay)
        finally:  # also when the caller is interrupted: no process of the run outlives this call
            if proc.poll() is None:
                _kill_tree(proc.pid)
            proc.wait()
    if proc.returncode != -signal.SIGKILL:
        with open(log_path) as log:
            raise RuntimeError(
                f"{command[1]} ended (exit {proc.returncode}) before it was killed:\n{log.read()[-3000:]}"
            )
    return checkpoint.list_checkpoints(str(output_dir))[-1][0]
