"""GPU self-check: one command, offline, under 10 minutes on one GPU, that says whether this machine runs the project.

    python benchmark/gpu_check.py                           # on a GPU: the GPT-2 124M shape, within --budget 540 s
    python benchmark/gpu_check.py --json gpu_check.json     # the same, and the results as JSON
    python benchmark/gpu_check.py --quick                   # CI-sized: 1 update per flag set

Steps, each in a process of its own under its own time limit (on CPU, where nothing global differs between them, in
one process, to pay the imports once), within an overall budget; a step that fails or runs out of time is reported
as such and the others still run:

- environment: torch, CUDA, the GPU, the transformers and accelerate versions, and whether the installed transformers
  works with the project's sampler (one sampled rollout of a tiny random GPT-2);
- decoding: one rollout sampled eagerly and with the compiled decoding step (`--compile_sampler`): responses,
  log-probs and values must be bit-identical;
- fp32, tf32, tf32 + compile_sampler, bf16: the real `train_policy.main` (benchmark/policy_throughput.py's setup) with
  those flags: seconds per PPO update, response tokens/s (OAI's `elapsed/fps`), peak memory, syncs per update (the
  CUDA runtime's sync debug mode on a GPU, `HostSyncCounter` on CPU), every logged statistic finite;
- fused: the same with the opt-in speed flags --fused_adam --fused_checks;
- successor: the same with the successor recipe's rollout: responses that end at EOS, a critic of its own (from the
  reward model), the k3 KL estimator;
- sft: train_sft.py, 2 steps of the successor recipe's supervised stage on the policy's shape;
- distributed: a process group of this one process (NCCL on a GPU, gloo on CPU): the policy sharded as --fsdp shards
  it, the decoding step compiled and captured once over 3 updates, a torch.distributed.checkpoint save and load of
  the sharded weights and Adam state (equal after), one step through DDP (its gradients equal those without);
- profile: one PPO update under torch.profiler: the matrix multiplies' share of the device time and the top kernels,
  printed as a table (on CPU: the operators' host time);
- resume: train_policy.py run whole, then run again, SIGKILLed after its checkpoint 2 and resumed with `--resume
  auto`: its logged scalars and final weights must equal the uninterrupted run's.

Random-weight GPT-2 models (benchmark/shapes.py) and the offline GPT-2 tokenizer: nothing is downloaded. On a GPU the
PPO steps use the gpt2-124m shape at OAI's per-process sizes (64 episodes of 64 + 24 tokens, 4 epochs); on CPU the
tiny shape, and the table says that its figures are not GPU figures. Exit status 1 when a check failed, timed out
or was skipped for lack of time.
"""

import contextlib
import dataclasses
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import tyro
from rich.console import Console
from rich.table import Table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

StepName = Literal[
    "environment",
    "decoding",
    "fp32",
    "tf32",
    "tf32_compile",
    "bf16",
    "fused",
    "successor",
    "sft",
    "distributed",
    "profile",
    "resume",
]
STEPS: tuple[StepName, ...] = get_args(StepName)

FLAG_SETS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "tf32": ("--tf32",),
    "tf32_compile": ("--tf32", "--compile_sampler"),
    "bf16": ("--bf16",),
    "fused": ("--fused_adam", "--fused_checks"),
    "successor": ("--task.end_at_eos", "--rewards.kl_estimator k3", "--ppo.value_model reward"),
}
"""the PPO steps: train_policy.py flags of each"""

STEP_TITLES = {
    "environment": "environment",
    "decoding": "decoding: compiled = eager",
    **{name: "PPO " + (" ".join(flags) or "fp32") for name, flags in FLAG_SETS.items()},
    "sft": "train_sft.py",
    "distributed": "one-process group: FSDP, DDP, DCP",
    "profile": "profile: one PPO update",
    "resume": "kill + --resume auto = whole",
}

STEP_LIMITS_S = {
    "environment": 90,
    "decoding": 150,
    "fp32": 120,
    "tf32": 90,
    "tf32_compile": 150,
    "bf16": 90,
    "fused": 90,
    "successor": 90,
    "sft": 60,
    "distributed": 120,
    "profile": 90,
    "resume": 180,
}
"""each step's time limit in seconds (on a GPU; the overall --budget caps them)"""

PHASES = ("rollout", "scoring", "optimisation")
"""train_policy's timed phases of an update"""

MIN_STEP_S = 20
"""a step that would start with less time left than this is skipped"""

RESUME_FLAGS = {"cuda": ("--tf32", "--bf16", "--compile_sampler", "--deterministic"), "cpu": ()}
"""train_policy.py flags of the resume round trip's runs (tiny shape): on a GPU, every flag that changes the
arithmetic, and --deterministic, without which CUDA's attention backward may sum in another order after the resume"""

RESUME_TOLERANCE = 1e-6
"""largest |difference| of a logged scalar or a final weight between the resumed and the uninterrupted run (the resume
tests' bound)"""

WORKER_FLAG = "--run_steps_in_this_process"
"""argv[1] of a worker process: the steps to run follow as one JSON object"""


@dataclass
class Args:
    json: str | None = None
    """also write the results as JSON to this file (the table's rows, every figure, each failure's traceback)"""
    quick: bool = False
    """CI-sized: 1 PPO update per flag set without warm-up, 1 PPO epoch, 16-token queries (a smoke test of the
    check itself: its figures include start-up and compile times)"""
    budget: float = 540.0
    """seconds for the whole check; a step is cut at its own limit or when these run out, and one that would start
    with less than 20 s left is skipped (reported, exit status 1)"""
    steps: tuple[StepName, ...] = STEPS
    """the steps to run, in this order"""
    fail: tuple[StepName, ...] = ()
    """make these steps fail on purpose: to see a failure reported while the other steps go on"""
    work_dir: str | None = None
    """where models, corpus, runs and each step process's log go (None: a temporary directory, deleted at the end
    when every check passed)"""


@dataclass(frozen=True)
class Plan:
    """The sizes every step uses on this device."""

    device: str
    model: str
    batch: int
    query_length: int
    response_length: int
    noptepochs: int
    warmup: int
    updates: int

    def title(self, gpu: str = "one GPU") -> str:
        """The table's title; `gpu`: the name the environment step read (the check's own process never touches the
        GPU, so that each step's process has it to itself)."""
        sizes = (
            f"{self.model} shape, {self.batch} episodes of {self.query_length} + {self.response_length} tokens, "
            f"{self.noptepochs} PPO epochs, {self.updates} timed updates after {self.warmup} warm-up"
        )
        if self.device == "cpu":
            return f"CPU: tiny shape, these are not GPU figures ({sizes})"
        return f"GPU self-check on {gpu} ({sizes})"


def make_plan(device: str, quick: bool) -> Plan:
    """OAI's per-process sizes at GPT-2 124M on a GPU; the tiny shape on CPU; fewer, smaller updates with --quick."""
    if device == "cuda":
        plan = Plan(device, "gpt2-124m", 64, 64, 24, 4, warmup=1, updates=3)
    else:
        plan = Plan(device, "tiny", 8, 64, 24, 1, warmup=1, updates=1)
    if quick:
        # OAI's 24 response tokens stay: the sentiment task's truncation starts after 16
        plan = dataclasses.replace(plan, query_length=16, noptepochs=1, warmup=0, updates=1)
    return plan


# ---------------------------------------------------------------------------------------------------- results


class CheckFailed(Exception):
    """A step ran but what it checks does not hold; `figures` are still reported."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


class StepTimeout(Exception):
    """A step ran past its time limit."""


def result(name: str, status: str, seconds: float, figures: dict | None = None, detail: str = "", error: str = ""):
    """One row of the table: status is ok, FAILED, TIMED OUT, SKIPPED or NOT RUN."""
    return {
        "step": name,
        "title": STEP_TITLES[name],
        "status": status,
        "seconds": round(seconds, 1),
        "figures": figures or {},
        "detail": detail,
        "error": error,
    }


# ---------------------------------------------------------------------------------------------------- inputs


def prepared_inputs(work_dir: str, model: str) -> tuple[str, str, str]:
    """The random policy and reward model of `model`'s shape and the query corpus, written once per work dir."""
    from benchmark.policy_throughput import write_corpus, write_models  # the worker's imports (see worker_main)

    root = os.path.join(work_dir, f"inputs-{model}")
    done = os.path.join(root, "complete")
    if not os.path.exists(done):
        os.makedirs(root, exist_ok=True)
        write_models(root, model)
        write_corpus(root)
        open(done, "w").close()
    return os.path.join(root, "policy_init"), os.path.join(root, "reward"), os.path.join(root, "queries.txt")


# ---------------------------------------------------------------------------------------------------- sync counting


class CudaSyncCounter:
    """Device syncs as the CUDA runtime reports them (`torch.cuda.set_sync_debug_mode("warn")`: every call that waits
    for the GPU), with `HostSyncCounter`'s `count` and `events` (each sync's first caller outside torch)."""

    MESSAGE = "synchronizing CUDA operation"

    def __init__(self):
        self.count = 0
        self.events: list[str] = []
        self._warnings = warnings.catch_warnings()

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.MESSAGE not in str(message):
            self._shown(message, category, filename, lineno, file, line)
            return
        self.count += 1
        torch_dir = os.path.dirname(torch.__file__)
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(torch_dir)]
        frames = [f for f in frames if "warnings" not in f.filename]
        self.events.append(f"sync at {frames[-1].filename}:{frames[-1].lineno}" if frames else "sync")

    def __enter__(self) -> "CudaSyncCounter":
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{self.MESSAGE}.*")
        self._shown, warnings.showwarning = warnings.showwarning, self._show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(0)
        self._warnings.__exit__(*exc)


def sync_counter(device: str, flags: tuple[str, ...]):
    """-> (what counts the syncs of a run with `flags`, and how it counts them)."""
    from lm_human_preference_details.instruments.host_syncs import HostSyncCounter

    if device == "cuda":
        return CudaSyncCounter, "CUDA sync debug mode"
    return HostSyncCounter, "HostSyncCounter (host reads of device values)"


# ---------------------------------------------------------------------------------------------------- peak memory


class PeakMemory:
    """Peak memory of a step: torch.cuda.max_memory_allocated on a GPU; on CPU the process's peak resident set size,
    from the step's start where Linux lets it be reset (/proc/self/clear_refs), else since the process started."""

    def __init__(self, device: str):
        self.device = device
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.measure = "torch.cuda.max_memory_allocated (the largest peak of one update)"
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
            self.measure = "peak RSS of the step (VmHWM)"
        except OSError:
            self.measure = "peak RSS of the process since it started (ru_maxrss)"

    def gib(self) -> float:
        if self.device == "cuda":
            return torch.cuda.max_memory_allocated() / 2**30
        if "VmHWM" in self.measure:
            with open("/proc/self/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            return kib / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


# ---------------------------------------------------------------------------------------------------- steps


def nvidia_gpu_present() -> bool:
    """Whether this machine shows an NVIDIA GPU (its device file or its driver's nvidia-smi), whatever torch sees."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def environment_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """Versions, the device, and one rollout of the project's sampler on a tiny random GPT-2 on it."""
    import accelerate
    import transformers
    from transformers import GPT2LMHeadModel

    from benchmark.shapes import gpt2_config
    from lm_human_preference_details.modeling import PolicyWithValueHead, sample

    figures = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        figures.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            compute_capability=f"{props.major}.{props.minor}",
            bf16_supported=torch.cuda.is_bf16_supported(),
            gpus_visible=torch.cuda.device_count(),
        )
    if plan.device == "cpu" and nvidia_gpu_present():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CheckFailed(
            f"this machine has an NVIDIA GPU but torch {torch.__version__} ({build}) cannot use it", figures
        )
    torch.manual_seed(0)
    policy = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config("tiny"))).to(plan.device).eval()
    contexts = torch.randint(0, 50000, (2, 8), device=plan.device)
    generator = torch.Generator(device=plan.device).manual_seed(0)
    responses, logprobs, values = sample(policy, contexts, 4, 0.7, 50257, generator, check_first_token=False)
    finite = bool(torch.isfinite(logprobs).all() and torch.isfinite(values).all())
    figures["sampler_works"] = finite and tuple(responses.shape) == (2, 4)
    if not figures["sampler_works"]:
        raise CheckFailed("the sampler's log-probs or values are not finite with this transformers", figures)
    where = f"{figures.get('gpu', 'no CUDA device, CPU')}, torch {torch.__version__}"
    return figures, f"{where}, transformers {transformers.__version__}: the sampler works"


def timed(device: str, fn) -> float:
    """Wall seconds of fn(), the device's queue drained before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decoding_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """One rollout at the plan's shape sampled eagerly and with the compiled decoding step, twice (compile, replay):
    responses, log-probs and values bit-identical; milliseconds per rollout of each."""
    from transformers import GPT2LMHeadModel

    from benchmark.shapes import gpt2_config
    from lm_human_preference_details.modeling import PolicyWithValueHead, sample
    from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline

    pad = gpt2_tokenizer_offline().pad_token_id
    torch.manual_seed(0)
    policy = PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(plan.model))).to(plan.device).eval()
    torch.nn.init.normal_(policy.value_head.weight)
    contexts = torch.randint(0, 50000, (plan.batch, plan.query_length), device=plan.device)
    contexts[1::2, -5:] = pad  # some rows end in PADs, as right-padded queries do

    def rollout(compile: bool):
        generator = torch.Generator(device=plan.device).manual_seed(0)
        return sample(policy, contexts, plan.response_length, 0.7, pad, generator, False, compile=compile)

    eager = rollout(False)
    compile_s = timed(plan.device, lambda: rollout(True))
    outputs = {"first": rollout(True), "replayed": rollout(True)}
    equal = {
        f"{name}_{call}": bool(torch.equal(a, b))
        for call, compiled in outputs.items()
        for name, a, b in zip(("responses", "logprobs", "values"), eager, compiled)
    }
    figures = {
        "equal": equal,
        "first_compiled_call_s": round(compile_s, 2),
        "eager_ms_per_rollout": round(1e3 * timed(plan.device, lambda: rollout(False)), 1),
        "compiled_ms_per_rollout": round(1e3 * timed(plan.device, lambda: rollout(True)), 1),
    }
    speed = f"{figures['eager_ms_per_rollout']:.0f} ms eager, {figures['compiled_ms_per_rollout']:.0f} ms compiled"
    if not all(equal.values()):
        differ = ", ".join(name for name, same in equal.items() if not same)
        raise CheckFailed(f"compiled decoding differs from eager: {differ}", figures)
    return figures, f"responses, log-probs, values bit-identical; {speed} per rollout"


@contextlib.contextmanager
def torch_precision_restored():
    """--tf32 sets torch's global float32 precision: the next step in the same process starts from the one before."""
    matmul, conv = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = matmul, conv


def ppo_step(plan: Plan, work_dir: str, name: str) -> tuple[dict, str]:
    """The real train_policy.main with the flag set `name`: seconds per update, tokens/s, peak memory, syncs per
    update, every logged statistic finite."""
    import numpy as np

    import train_policy
    from benchmark import policy_throughput
    from lm_human_preference_details import settings

    flags = FLAG_SETS[name]
    policy_dir, reward_dir, corpus = prepared_inputs(work_dir, plan.model)
    bench = policy_throughput.Args(
        model=plan.model,
        updates=plan.updates,
        warmup=plan.warmup,
        batch=plan.batch,
        query_length=plan.query_length,
        response_length=plan.response_length,
        noptepochs=plan.noptepochs,
        tf32="--tf32" in flags,
        bf16="--bf16" in flags,
        compile_sampler="--compile_sampler" in flags,
    )
    run_dir = os.path.join(work_dir, f"ppo-{name}")
    args = policy_throughput.policy_args(bench, run_dir, policy_dir, reward_dir, corpus)
    fused = {"fused_adam": "--fused_adam" in flags, "fused_checks": "--fused_checks" in flags}
    args = settings.with_run(args, overwrite_output_dir=True, **fused)
    if name == "successor":  # responses that end at EOS, a critic of its own (from the reward model), k3
        task = dataclasses.replace(args.task, end_at_eos=True, truncate_text=None, truncate_token=None)
        rewards = dataclasses.replace(args.rewards, kl_estimator="k3", allow_task_mismatch=True)
        ppo = dataclasses.replace(args.ppo, value_model="reward")
        args = dataclasses.replace(
            args, task=dataclasses.replace(task, penalty_mode="subtract"), rewards=rewards, ppo=ppo
        )
    counter, counted_by = sync_counter(plan.device, flags)
    memory = PeakMemory(plan.device)
    probe = policy_throughput.UpdateProbe(plan.device, True, counter)
    with torch_precision_restored(), probe.attached():
        history = train_policy.main(args)
    timed_updates = history[plan.warmup :]
    walls = np.diff([0.0] + [h["elapsed/time"] for h in history])[plan.warmup :]
    syncs = probe.syncs[plan.warmup :]
    figures = {
        "flags": " ".join(flags),
        "seconds_per_update": float(np.median(walls)),
        "tokens_per_s": float(np.median([h["elapsed/fps"] for h in timed_updates])),
        **{f"{phase}_s": float(np.median([h[f"debug/time/{phase}"] for h in timed_updates])) for phase in PHASES},
        # on a GPU the probe's per-update peaks (it resets the count as each update starts); on CPU the step's
        "peak_memory_gib": max(probe.memory[plan.warmup :]) if plan.device == "cuda" else memory.gib(),
        "peak_memory_measure": memory.measure,
        "syncs_per_update": max(syncs),
        "syncs_each_update": syncs,
        "syncs_counted_by": counted_by,
        "sync_sites_last_update": probe.sites[-1][:20],
        "updates": len(history),
    }
    bad = sorted({k for h in history for k, v in h.items() if isinstance(v, float) and not math.isfinite(v)})
    if len(history) != plan.warmup + plan.updates or bad:
        raise CheckFailed(f"{len(history)} updates logged; statistics not finite: {bad[:5]}", figures)
    phases = ", ".join(f"{phase} {figures[f'{phase}_s']:.2f}" for phase in PHASES)
    return figures, f"s per phase: {phases}"


class TwoProcesses:
    """The accelerator of a run on 2 processes as `distributed.data_parallel` reads it, in a group of one: FSDP2
    shards into one shard with the hooks, DTensors and gathers of several, DDP reduces over the group."""

    num_processes = 2

    def __init__(self, device: torch.device) -> None:
        self.device = device


def distributed_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """A process group of this one process (NCCL on a GPU, gloo on CPU): the policy sharded as --fsdp shards it, 3
    updates with the decoding step compiled (a CUDA graph on a GPU), which must be captured once over them; the
    sharded weights and Adam state saved and loaded through torch.distributed.checkpoint, equal after; one step
    through DDP (`distributed.data_parallel`), equal to the same step without it."""
    from transformers import GPT2LMHeadModel

    from benchmark.shapes import gpt2_config
    from lm_human_preference_details import decoding_graph, distributed, sharded
    from lm_human_preference_details.modeling import PolicyWithValueHead, sample
    from lm_human_preference_details.optim import make_optimizer

    on_gpu = plan.device == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    backend = "nccl" if on_gpu else "gloo"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    device_id = {"device_id": device} if on_gpu else {}
    torch.distributed.init_process_group(backend, init_method=address, rank=0, world_size=1, **device_id)
    captures = [0]
    new_step_graph = decoding_graph.new_step_graph

    def counted(step_device):
        graph = new_step_graph(step_device)
        capture = graph.capture

        def counting(step):
            captures[0] += 1
            return capture(step)

        graph.capture = counting
        return graph

    decoding_graph.new_step_graph = counted
    try:
        torch.manual_seed(0)

        def new_policy() -> PolicyWithValueHead:
            torch.manual_seed(0)
            return PolicyWithValueHead(GPT2LMHeadModel(gpt2_config(plan.model))).to(device).eval()

        policy = new_policy()
        trained = distributed.data_parallel(policy, TwoProcesses(device), fsdp=True)
        distributed.hold_gathered_weights(trained, policy)
        optimizer = make_optimizer(list(policy.parameters()), 1e-5, True)
        contexts = torch.randint(0, 50000, (plan.batch, plan.query_length), device=device)
        generator = torch.Generator(device).manual_seed(0)
        for _ in range(3):
            with distributed.gathered(trained):
                responses, _, _ = sample(policy, contexts, plan.response_length, 0.7, 50257, generator, compile=True)
            logits, values = trained(torch.cat([contexts, responses], 1), plan.query_length, 50257, 0.7)
            (logits.logsumexp(-1).mean() + values.square().mean()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # DCP: the shards of the weights and Adam moments saved, then loaded into a fresh sharded policy
        directory = os.path.join(work_dir, "dcp")
        sharded.save(directory, policy, optimizer)
        loaded = new_policy()
        distributed.data_parallel(loaded, TwoProcesses(device), fsdp=True)
        loaded_optimizer = make_optimizer(list(loaded.parameters()), 1e-5, True)
        sharded.load(directory, loaded, loaded_optimizer)
        weights_equal = all(
            torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(policy.parameters(), loaded.parameters())
        )
        moments = [
            torch.equal(a[key].full_tensor(), b[key].full_tensor())
            for a, b in zip(optimizer.state.values(), loaded_optimizer.state.values())
            for key in ("exp_avg", "exp_avg_sq")
        ]
        # DDP: one step's gradients through it equal those without it (a group of one averages nothing)
        plain, wrapped = new_policy().train(), new_policy().train()
        ddp = distributed.data_parallel(wrapped, TwoProcesses(device))
        for module in (plain, ddp):
            logits, values = module(torch.cat([contexts, responses], 1), plan.query_length, 50257, 0.7)
            (logits.logsumexp(-1).mean() + values.square().mean()).backward()
        ddp_difference = max(
            (a.grad - b.grad).abs().max().item() for a, b in zip(plain.parameters(), wrapped.parameters())
        )
    finally:
        decoding_graph.new_step_graph = new_step_graph
        torch.distributed.destroy_process_group()
    figures = {
        "backend": backend,
        "captures_over_3_updates": captures[0],
        "dcp_weights_equal": weights_equal,
        "dcp_adam_moments_equal": bool(moments) and all(moments),
        "ddp_max_gradient_difference": ddp_difference,
    }
    if captures[0] != 1 or not weights_equal or not figures["dcp_adam_moments_equal"] or ddp_difference > 1e-6:
        raise CheckFailed(json.dumps(figures), figures)
    return figures, f"{backend}: 1 capture over 3 --fsdp updates, DCP round trip equal, DDP gradients equal"


def sft_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """train_sft.py (the successor recipe's supervised stage) on the policy's shape: 2 steps of 8 prompt/completion
    rows, its loss finite and its model saved."""
    import train_sft

    policy_dir, _, _ = prepared_inputs(work_dir, plan.model)
    pairs = os.path.join(work_dir, "sft_pairs.jsonl")
    with open(pairs, "w", encoding="utf-8") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"Count to {i}: ", "completion": " ".join(str(k) for k in range(i % 5 + 1))}))
            f.write("\n")
    output_dir = os.path.join(work_dir, "sft")
    flags = ["--base_model", policy_dir, "--dataset", pairs, "--batch_size", "8", "--lr", "1e-4"]
    start = time.time()
    losses = train_sft.main(train_sft.parse([*flags, "--output_dir", output_dir, "--overwrite_output_dir"]))
    figures = {"steps": losses["steps"], "loss": losses["train_last"], "seconds": time.time() - start}
    if not math.isfinite(figures["loss"]) or not os.path.exists(os.path.join(output_dir, "config.json")):
        raise CheckFailed(f"loss {figures['loss']}; saved model: {os.listdir(output_dir)}", figures)
    return figures, f"{figures['steps']} steps, last loss {figures['loss']:.3f}"


MATMUL_NAMES = ("gemm", "mm", "matmul", "xmma", "cutlass")
"""parts of the names of matrix-multiply kernels (cuBLAS, CUTLASS) and operators (aten::mm, addmm, bmm)"""


def profile_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """One PPO update of the real train_policy.main (fp32, OAI's flags) under torch.profiler: the share of the device
    time (on CPU: of the operators' own host time) spent in matrix multiplies, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    import train_policy
    from benchmark import policy_throughput
    from lm_human_preference_details import settings

    policy_dir, reward_dir, corpus = prepared_inputs(work_dir, plan.model)
    bench = policy_throughput.Args(
        model=plan.model,
        updates=1,
        warmup=0,
        batch=plan.batch,
        query_length=plan.query_length,
        response_length=plan.response_length,
        noptepochs=plan.noptepochs,
        count_syncs=False,
    )
    args = policy_throughput.policy_args(bench, os.path.join(work_dir, "ppo-profile"), policy_dir, reward_dir, corpus)
    args = settings.with_run(args, overwrite_output_dir=True)
    on_gpu = plan.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch_precision_restored(), profile(activities=activities) as profiler:
        train_policy.main(args)
    events = profiler.key_averages()
    if on_gpu:  # the kernels: events with device time of their own
        times = {e.key: e.self_device_time_total for e in events if e.self_device_time_total > 0}
    else:  # the operators' own host time (aten::*)
        times = {e.key: e.self_cpu_time_total for e in events if e.key.startswith("aten::")}
    total = sum(times.values())
    matmul = sum(t for name, t in times.items() if any(part in name.lower() for part in MATMUL_NAMES))
    top = sorted(times.items(), key=lambda item: -item[1])[:10]
    figures = {
        "measured": "device time of each kernel" if on_gpu else "host time of each operator (CPU)",
        "total_ms": total / 1e3,
        "matmul_share": matmul / total if total else float("nan"),
        "top_kernels": [{"name": name[:70], "ms": t / 1e3, "share": t / total} for name, t in top],
    }
    if not total or not math.isfinite(figures["matmul_share"]):
        raise CheckFailed("the profiler recorded no time", figures)
    return figures, f"matrix multiplies {figures['matmul_share']:.0%} of {figures['measured']}"


def print_profile(console: Console, report: dict) -> None:
    """The profile step's top kernels, as a table of their own."""
    for row in report["steps"]:
        if row["step"] != "profile" or "top_kernels" not in row["figures"]:
            continue
        figures = row["figures"]
        title = f"one PPO update, {figures['measured']}: matrix multiplies {figures['matmul_share']:.1%} of the total"
        console.print(title, markup=False)  # a line of its own: a table's title wraps at the table's width
        table = Table()
        for column in ("kernel", "ms", "share"):
            table.add_column(column, justify="left" if column == "kernel" else "right")
        for kernel in figures["top_kernels"]:
            table.add_row(kernel["name"], f"{kernel['ms']:.1f}", f"{kernel['share']:.1%}")
        console.print(table)


def resume_step(plan: Plan, work_dir: str) -> tuple[dict, str]:
    """train_policy.py on the tiny shape: run whole; run again, SIGKILLed right after its checkpoint 2, and resumed
    with --resume auto; the logged scalars from the resumed step on and the final weights must agree."""
    import train_policy
    from lm_human_preference_details import checkpoint
    from lm_human_preference_details.resume_check import (
        max_metric_difference,
        max_weight_difference,
        saved_files,
        scalars,
        start_and_kill,
    )

    policy_dir, reward_dir, corpus = prepared_inputs(work_dir, "tiny")
    root = os.path.join(work_dir, "resume")
    os.makedirs(root, exist_ok=True)
    flags = RESUME_FLAGS[plan.device]

    def run_flags(output_dir: str, *more: str) -> list[str]:
        """4 updates of 8 episodes, a checkpoint every 2 (tests/test_resume.py's run)."""
        return [
            *("--base_model", policy_dir, "--rewards.trained_model", reward_dir, "--rewards.allow_task_mismatch"),
            *("--task.query_dataset", corpus, "--task.query_length", "16", "--task.response_length", "8"),
            *("--task.start_text", "None", "--task.end_text", "None", "--task.truncate_token", "None"),
            *("--task.truncate_after", "0", "--ppo.total_episodes", "32", "--ppo.batch_size", "8", "--ppo.lr", "1e-3"),
            *("--ppo.noptepochs", "2", "--save_interval", "2", "--log_interval", "100", "--print_samples", "1"),
            *("--keep_checkpoints", "0", *flags, *more, "--output_dir", output_dir),
        ]

    # the scripts' processes add up floats with this process's thread count
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}
    whole, killed = os.path.join(root, "whole"), os.path.join(root, "killed")
    train_policy.main(train_policy.parse(run_flags(whole, "--overwrite_output_dir")))
    script = [sys.executable, os.path.join(REPO, "train_policy.py")]
    resumed_from = start_and_kill([*script, *run_flags(killed, "--overwrite_output_dir")], killed, 2, 0.0, env, REPO)
    done = subprocess.run([*script, *run_flags(killed, "--resume", "auto")], cwd=REPO, env=env, capture_output=True)
    if done.returncode:
        raise RuntimeError(f"the resumed run failed (exit {done.returncode}): {done.stderr.decode()[-2000:]}")
    names = ("model.safetensors", "value_head.safetensors")
    figures = {
        "flags": " ".join(flags),
        "resumed_from_update": resumed_from,
        "checkpoints": [step for step, _ in checkpoint.list_checkpoints(killed)],
        "max_metric_difference": max_metric_difference(scalars(killed), scalars(whole), resumed_from),
        "max_weight_difference": max_weight_difference(saved_files(killed, names), saved_files(whole, names)),
    }
    worst = max(figures["max_metric_difference"], figures["max_weight_difference"])
    verdict = "bit-identical" if worst == 0 else f"equal within {RESUME_TOLERANCE:g}"
    if worst > RESUME_TOLERANCE:
        raise CheckFailed(f"the resumed run differs from the whole run by {worst:.3g}", figures)
    return figures, f"killed after update {resumed_from}, resumed: scalars and final weights {verdict}"


def run_step(name: str, plan: Plan, work_dir: str):
    """The step `name`'s function applied to the plan."""
    if name in FLAG_SETS:
        return ppo_step(plan, work_dir, name)
    steps = {"environment": environment_step, "decoding": decoding_step, "sft": sft_step, "profile": profile_step}
    return {**steps, "distributed": distributed_step, "resume": resume_step}[name](plan, work_dir)


# ---------------------------------------------------------------------------------------------------- worker


def _raise_timeout(signum, frame):
    raise StepTimeout()


def worker_main(job: dict) -> None:
    """Run `job["steps"]` in this process, one after the other, each under its limit and before the deadline;
    append each one's result to `job["results"]` as a JSON line as soon as it is known."""
    plan = Plan(**job["plan"])
    signal.signal(signal.SIGALRM, _raise_timeout)
    for name in job["steps"]:
        start = time.time()
        left = job["deadline"] - start
        if left < MIN_STEP_S:
            row = result(name, "SKIPPED", 0.0, detail=f"time budget spent ({left:.0f} s left)")
        else:
            limit = min(job["limits"][name], left)
            cut = f"cut at its limit of {limit:.0f} s" if limit < left else f"cut at {limit:.0f} s: --budget ran out"
            signal.setitimer(signal.ITIMER_REAL, limit)
            try:
                if name in job["fail"]:
                    raise RuntimeError(f"failing on purpose (--fail {name})")
                figures, detail = run_step(name, plan, job["work_dir"])
                row = result(name, "ok", time.time() - start, figures, detail)
            except StepTimeout:
                row = result(name, "TIMED OUT", time.time() - start, detail=cut)
            except CheckFailed as failure:
                row = result(name, "FAILED", time.time() - start, failure.figures, str(failure), traceback.format_exc())
            except Exception as error:  # reported in the table; the next step still runs
                detail = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                row = result(name, "FAILED", time.time() - start, detail=detail, error=traceback.format_exc())
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        with open(job["results"], "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


# ---------------------------------------------------------------------------------------------------- orchestration


def worker_groups(device: str, steps: tuple[str, ...]) -> list[tuple[str, ...]]:
    """On a GPU one process per step (a clean CUDA context, TF32 setting and peak-memory count for each); on CPU one
    process for all (nothing global differs between the steps there, and the imports are paid once)."""
    return [(name,) for name in steps] if device == "cuda" else [tuple(steps)]


def read_rows(path: str) -> list[dict]:
    """The results a worker has reported so far (one JSON line per finished step)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_group(
    steps: tuple[str, ...], plan: Plan, args: Args, work_dir: str, deadline: float, show=lambda row: None
) -> list[dict]:
    """Run `steps` in a worker process, `show` each result as it comes; steps it did not report (it crashed or ran
    out of time) are reported so."""
    index = len(os.listdir(os.path.join(work_dir, "logs")))
    results, log = (os.path.join(work_dir, "logs", f"{index}-{steps[0]}.{ext}") for ext in ("jsonl", "log"))
    limits = {name: STEP_LIMITS_S[name] * (1 if plan.device == "cuda" else 2) for name in steps}
    job = {
        "steps": steps,
        "plan": dataclasses.asdict(plan),
        "work_dir": work_dir,
        "results": results,
        "deadline": deadline,
        "limits": limits,
        "fail": list(args.fail),
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, json.dumps(job)]
    shown, last = 0, time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True)
        while proc.poll() is None:
            if time.time() > deadline + 30:  # the worker cuts its own steps; this is for a worker that hangs
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            for row in read_rows(results)[shown:]:
                show(row)
                shown, last = shown + 1, time.time()
            time.sleep(0.5)
    rows = read_rows(results)
    for row in rows[shown:]:
        show(row)
    unreported = steps[len(rows) :]
    if unreported:  # the first was running when the worker died or was killed; the others never started
        why = f"its process ended (exit {proc.returncode}) during the step; its output: {log}"
        rows.append(result(unreported[0], "FAILED", time.time() - last, detail=why))
        after = f"not started: {unreported[0]} ended its process"
        rows += [result(name, "NOT RUN", 0.0, detail=after) for name in unreported[1:]]
        for row in rows[-len(unreported) :]:
            show(row)
    return rows


def format_number(value, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(console: Console, report: dict) -> None:
    """The closing table: one row per step."""
    table = Table(title=report["title"], title_justify="left")
    for column in ("check", "result", "s / update", "tokens/s", "peak GiB", "syncs / update", "details", "s"):
        table.add_column(column, justify="right" if column in ("s / update", "tokens/s", "peak GiB", "s") else "left")
    for row in report["steps"]:
        figures = row["figures"]
        style = None if row["status"] == "ok" else "bold red"
        table.add_row(
            row["title"],
            row["status"],
            format_number(figures.get("seconds_per_update"), 3),
            format_number(figures.get("tokens_per_s"), 0),
            format_number(figures.get("peak_memory_gib"), 2),
            format_number(figures.get("syncs_per_update"), 0),
            row["detail"],
            f"{row['seconds']:.0f}",
            style=style,
        )
    console.print(table)
    if report["device"] == "cuda":
        console.print("peak GiB: torch.cuda.max_memory_allocated; syncs: what the CUDA sync debug mode reports")
    else:
        console.print("peak GiB: the peak resident set size; syncs: HostSyncCounter's host reads of device values")
    verdict = "every check passed" if report["ok"] else "SOME CHECKS FAILED (see the rows in red)"
    console.print(f"{verdict}; {report['seconds']:.0f} s in all; work directory {report['work_dir']}")


def write_json(path: str, report: dict) -> None:
    """`report` as JSON at `path`, written atomically."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def check(args: Args, work_dir: str) -> dict:
    """Every step in its worker, within the budget -> the report (also printed as a table)."""
    start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = make_plan(device, args.quick)
    console = Console(width=160)
    console.print(f"{plan.title()}; budget {args.budget:.0f} s; work directory {work_dir}", markup=False)
    os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
    rows = []

    def show(row: dict) -> None:
        console.print(f"{row['title']}: {row['status']} ({row['seconds']:.0f} s) {row['detail']}", markup=False)

    for group in worker_groups(device, args.steps):
        rows += run_group(group, plan, args, work_dir, start + args.budget, show)
    report = {
        "title": plan.title(next((row["figures"]["gpu"] for row in rows if "gpu" in row["figures"]), "one GPU")),
        "device": device,
        "plan": dataclasses.asdict(plan),
        "quick": args.quick,
        "ok": all(row["status"] == "ok" for row in rows),
        "seconds": round(time.time() - start, 1),
        "work_dir": work_dir,
        "steps": rows,
    }
    print_table(console, report)
    print_profile(console, report)
    if args.json:
        write_json(args.json, report)
        console.print(f"results written to {args.json}", markup=False)
    return report


def main(args: Args) -> int:
    """-> the exit status: 0 when every check passed. A temporary work directory is deleted only then (its logs
    explain a failure)."""
    if args.work_dir is not None:
        os.makedirs(args.work_dir, exist_ok=True)
        return 0 if check(args, os.path.abspath(args.work_dir))["ok"] else 1
    work_dir = tempfile.mkdtemp(prefix="gpu_check_")
    if not check(args, work_dir)["ok"]:
        print(f"the work directory {work_dir} is kept: each worker's log is in its logs/")
        return 1
    shutil.rmtree(work_dir)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER_FLAG:
        worker_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main(tyro.cli(Args, use_underscores=True)))
