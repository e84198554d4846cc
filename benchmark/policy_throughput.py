"""PPO-update throughput of train_policy.py at OAI's books shapes, on a random GPT-2, against a matmul lower bound.

    python benchmark/policy_throughput.py --model tiny --updates 3
    python benchmark/policy_throughput.py --model gpt2-124m --updates 1 --warmup 1

Runs the real `train_policy.main` (no re-implementation): random-weight policy and reward model saved to a temporary
directory with the offline GPT-2 tokenizer, a synthetic query corpus whose lines fill all 64 query tokens, OAI's
per-process shapes (64-token queries, 24-token responses, 64 episodes, 4 PPO epochs of 1 minibatch). Random weights
change nothing about the cost, so no download is needed.

Reported per update: seconds split into rollout (sampling + reference forward), scoring (reward model) and optimisation
(4 x forward + backward + Adam), response tokens per second as OAI's `elapsed/fps` counts them (batch x response
length / wall seconds of the update), host syncs from the update's start to its statistics copy, and peak memory.
Then a summary against a lower bound: the matrix-multiply FLOPs an update cannot avoid, each term divided by the GEMM
throughput measured for its shape on the run's device (the GPU on a GPU run, in the float32 matmul precision the run
left set: TF32 after --tf32).
"""

import collections
import contextlib
import dataclasses
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2LMHeadModel, GPT2Model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_policy  # noqa: E402
from benchmark.shapes import SHAPES, gpt2_config  # noqa: E402
from lm_human_preference_details import cli, ppo_plumbing  # noqa: E402
from lm_human_preference_details.instruments.host_syncs import HostSyncCounter  # noqa: E402
from lm_human_preference_details.modeling import RewardModel  # noqa: E402
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline, tokenizer_fingerprint  # noqa: E402

PHASES = ("rollout", "scoring", "optimisation")
# CPU allocator knobs (see benchmark/README.md): glibc's malloc returns large freed blocks to the OS, so every fresh
# tensor over its thresholds is paid again in page faults; PyTorch's THP_MEM_ALLOC_ENABLE backs large ones by huge pages
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "THP_MEM_ALLOC_ENABLE", "LD_PRELOAD")


@dataclass
class Args:
    model: Literal["tiny", "gpt2-124m"] = "tiny"
    """random GPT-2 shape to time: tiny (2 layers, width 32, full vocab) or gpt2-124m (12 layers, width 768)"""
    updates: int = 3
    """timed PPO updates (after --warmup untimed ones)"""
    warmup: int = 1
    """untimed PPO updates first (allocator and kernel warm-up)"""
    batch: int = 64
    """episodes per update on this process (OAI: 512 over 8 processes = 64)"""
    query_length: int = 64
    """query tokens (OAI books tasks: 64); every query fills them all"""
    response_length: int = 24
    """response tokens (OAI books tasks: 24)"""
    noptepochs: int = 4
    """PPO epochs per update (OAI: 4)"""
    nminibatches: int = 1
    """minibatches per epoch (OAI: 1)"""
    accum: int = 1
    """gradient-accumulation micro-batches per minibatch (lowers peak memory; the FLOPs stay the same)"""
    gradient_checkpointing: bool = False
    """train_policy.py --gradient_checkpointing: recompute block activations in the backward (less memory; the lower
    bound does not count the recompute)"""
    bf16: bool = False
    """train_policy.py --bf16: bfloat16 autocast of the PPO forward's transformer (the bound stays the float32 one)"""
    count_syncs: bool = True
    """count the host syncs of every update (a Python hook on every torch call: it adds host time per op, which a
    GPU run with launch-bound phases feels; --no_count_syncs for the cleanest GPU timings)"""
    tf32: bool = False
    """train_policy.py --tf32: float32 matmuls on TF32 tensor cores (A100, H100; no effect on CPU)"""
    compile_sampler: bool = False
    """train_policy.py --compile_sampler: each decoding step of the rollout replayed as one CUDA graph (GPUs; run
    eagerly on CPU), captured in the first update"""
    threads: int = 0
    """torch intra-op CPU threads (0: torch's default)"""
    gemm_repeats: int = 5
    """timings per GEMM shape for the lower bound; the fastest counts"""
    work_dir: str | None = None
    """where models, corpus and policy output go (None: a temporary directory, deleted at the end)"""


# ---------------------------------------------------------------- setup: random models, corpus, train_policy args


def write_models(work_dir: str, model: str) -> tuple[str, str]:
    """A random GPT-2 LM (policy) and a reward model on the same trunk shape, saved as the scripts expect."""
    tokenizer = gpt2_tokenizer_offline()
    config = gpt2_config(model)
    policy_dir, reward_dir = os.path.join(work_dir, "policy_init"), os.path.join(work_dir, "reward")
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    # metadata as train_reward.py writes it (train_policy checks fingerprint and PAD id)
    metadata = {
        "base_model": policy_dir,
        "tokenizer": policy_dir,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
    }
    RewardModel(GPT2Model(config)).save(reward_dir, metadata)
    tokenizer.save_pretrained(reward_dir)
    return policy_dir, reward_dir


def write_corpus(work_dir: str, lines: int = 512, words: int = 120) -> str:
    """A .txt corpus of random-word lines, each far longer than 64 tokens, so every query is full (no PAD)."""
    vocabulary = (
        "the a of and to in was he she it that his her with as for had you not on at but they be by one said "
        "house river morning letter window stranger village road night light door voice city summer table"
    ).split()
    rng = np.random.RandomState(0)
    path = os.path.join(work_dir, "queries.txt")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choice(vocabulary, words)) + ".\n")
    return path


def policy_args(args: Args, work_dir: str, policy_dir: str, reward_dir: str, corpus: str) -> train_policy.Args:
    """train_policy.Args for warmup + updates PPO updates at the benchmark's shapes; nothing logged or printed."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    batch_size = args.batch * world_size
    base = train_policy.task_presets()["sentiment"]
    task = dataclasses.replace(
        base.task,
        query_dataset=corpus,
        query_length=args.query_length,
        response_length=args.response_length,
        start_text=None,
        end_text=None,
    )
    ppo = dataclasses.replace(
        base.ppo,
        batch_size=batch_size,
        total_episodes=batch_size * (args.warmup + args.updates),
        noptepochs=args.noptepochs,
        nminibatches=args.nminibatches,
        gradient_accumulation_steps=args.accum,
    )
    # a random reward model trained for no task: skip the task check
    rewards = dataclasses.replace(base.rewards, trained_model=reward_dir, allow_task_mismatch=True)
    run = dataclasses.replace(
        base.run,
        output_dir=os.path.join(work_dir, "policy"),
        log_interval=10**9,
        save_interval=0,
        print_samples=1,
        gradient_checkpointing=args.gradient_checkpointing,
        bf16=args.bf16,
        tf32=args.tf32,
        compile_sampler=args.compile_sampler,
    )
    return dataclasses.replace(base, base_model=policy_dir, task=task, rewards=rewards, ppo=ppo, run=run)


# ---------------------------------------------------------------- lower bound: unavoidable matmul FLOPs / GEMM speed


@dataclass(frozen=True)
class Gemm:
    """`count` matmuls of (m, k) x (k, n), each over `batch` independent matrices."""

    m: int
    k: int
    n: int
    count: float = 1.0
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.k * self.n * self.count


def linear_gemms(tokens: int, d: int, n_layer: int, count: float = 1.0) -> list[Gemm]:
    """The four weight matmuls of each GPT-2 block (qkv, attention out, MLP up, MLP down) over `tokens` rows."""
    shapes = ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d))
    return [Gemm(tokens, k, n, count * n_layer) for k, n in shapes]


def attention_gemms(rows: int, queries: int, keys: float, d: int, n_head: int, n_layer: int) -> list[Gemm]:
    """Scores q k^T and weighted values p v per head; `keys` = mean number of visible keys per query (causal)."""
    head = d // n_head
    batch = rows * n_head
    # FLOPs counted at the causal average key count; speed measured at the full key length
    full = max(int(round(keys)), 1)
    scale = keys / full
    return [Gemm(queries, head, full, n_layer * scale, batch), Gemm(queries, full, head, n_layer * scale, batch)]


def backward_gemms(forward: list[Gemm]) -> list[Gemm]:
    """Each forward matmul's backward: input gradient (m, n) x (n, k) and weight gradient (k, m) x (m, n)."""
    out = []
    for g in forward:
        out.append(Gemm(g.m, g.n, g.k, g.count, g.batch))
        out.append(Gemm(g.k, g.m, g.n, g.count, g.batch))
    return out


def trunk_gemms(rows: int, length: int, config: dict, count: float = 1.0) -> list[Gemm]:
    """A full causal trunk forward over (rows, length) tokens."""
    d, h, n = config["n_embd"], config["n_head"], config["n_layer"]
    attention = attention_gemms(rows, length, (length + 1) / 2, d, h, n)
    return linear_gemms(rows * length, d, n, count) + [dataclasses.replace(g, count=g.count * count) for g in attention]


def update_gemms(args: Args, config: dict, vocab: int) -> dict[str, list[Gemm]]:
    """Every matmul one PPO update cannot avoid, per phase (value/reward heads and other d x 1 products ignored)."""
    B, C, L = args.batch, args.query_length, args.response_length
    d, h, n = config["n_embd"], config["n_head"], config["n_layer"]
    T = C + L
    # sampling: the context once (LM head only at its last position), then L-1 single-token KV-cached steps
    sampling = trunk_gemms(B, C, config) + [Gemm(B, d, vocab)]
    for t in range(1, L):
        sampling += linear_gemms(B, d, n) + attention_gemms(B, 1, C + t, d, h, n) + [Gemm(B, d, vocab)]
    # reference policy: trunk over context + response minus the last token (it predicts nothing), LM head on the L
    # response positions only
    reference = trunk_gemms(B, T - 1, config) + [Gemm(B * L, d, vocab)]
    # reward model: trunk over all T tokens, its head is d x 1
    scoring = trunk_gemms(B, T, config)
    # PPO: noptepochs x (forward + backward) over the whole batch (micro-batching keeps the total)
    forward = trunk_gemms(B, T - 1, config, args.noptepochs) + [Gemm(B * L, d, vocab, args.noptepochs)]
    optimisation = forward + backward_gemms(forward)
    return {"rollout": sampling + reference, "scoring": scoring, "optimisation": optimisation}


GEMM_TIMING_FLOPS = {"cpu": 2e8, "cuda": 2e10}
"""FLOPs per timing of one GEMM shape (0.2 GFLOP on a CPU, 20 on a GPU: about a millisecond or more on either)"""
GEMM_TIMING_MAX_CALLS = 10_000
"""at most this many matmuls per timing (tiny batched attention GEMMs on a GPU)"""


def run_device() -> torch.device:
    """The device train_policy.main runs on in this process (CUDA when available)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def measure_gemm_seconds(g: Gemm, repeats: int, device: torch.device | str | None = None) -> float:
    """Fastest time of one (batched) matmul of this shape on `device` (None: `run_device()`), in seconds; on CUDA
    between CUDA events around back-to-back matmuls, as the GPU runs them."""
    device = torch.device(device) if device is not None else run_device()
    shape_a = (g.batch, g.m, g.k) if g.batch > 1 else (g.m, g.k)
    shape_b = (g.batch, g.k, g.n) if g.batch > 1 else (g.k, g.n)
    a, b = torch.randn(shape_a, device=device), torch.randn(shape_b, device=device)
    torch.matmul(a, b)  # warm-up: library handles, workspace, kernel selection
    target = GEMM_TIMING_FLOPS.get(device.type, GEMM_TIMING_FLOPS["cpu"])
    inner = min(GEMM_TIMING_MAX_CALLS, max(1, int(target // max(g.flops / g.count, 1))))
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                torch.matmul(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            for _ in range(inner):
                torch.matmul(a, b)
            seconds = time.perf_counter() - begin
        best = min(best, seconds / inner)
    return best


def lower_bound(
    gemms: dict[str, list[Gemm]], repeats: int, device: torch.device | str | None = None
) -> tuple[dict[str, float], dict[str, float], dict[tuple, list[float]]]:
    """Per phase: unavoidable FLOPs and seconds (each shape's FLOPs / its FLOP rate measured on `device`, None: the
    run's device); per shape totals."""
    measured: dict[tuple, float] = {}
    per_shape: dict[tuple, list[float]] = {}  # (m, k, n, batch) -> [GFLOP per update, seconds per update]
    flops, seconds = {}, {}
    for phase, items in gemms.items():
        flops[phase], seconds[phase] = 0.0, 0.0
        for g in items:
            key = (g.m, g.k, g.n, g.batch)
            if key not in measured:
                measured[key] = measure_gemm_seconds(g, repeats, device)
            flops[phase] += g.flops
            seconds[phase] += measured[key] * g.count
            totals = per_shape.setdefault(key, [0.0, 0.0])
            totals[0] += g.flops / 1e9
            totals[1] += measured[key] * g.count
    return flops, seconds, per_shape


# ---------------------------------------------------------------- main


def peak_memory_gib(device: str) -> float:
    """Peak device memory allocated (GPU) or peak resident set size of this process (CPU), in GiB."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class UpdateProbe:
    """Per update of train_policy.main: host syncs from its start to its statistics copy, and peak memory then."""

    def __init__(self, device: str, count_syncs: bool, counter: Callable[[], HostSyncCounter] = HostSyncCounter):
        self.device = device
        self.count_syncs = count_syncs
        self.make_counter = counter  # anything with HostSyncCounter's `count` and `events`, entered as a context
        self.syncs: list[int] = []
        self.sites: list[list[str]] = []  # each sync's first caller outside torch, per update
        self.memory: list[float] = []
        self._start = 0

    @contextlib.contextmanager
    def attached(self):
        """train_policy's PhaseTimer (ppo_plumbing.PhaseTimer) and reduce_stats report to this probe while the block
        runs."""
        probe, timer, reduce_stats = self, ppo_plumbing.PhaseTimer, train_policy.reduce_stats

        class ProbedTimer(timer):
            def mark(self) -> None:
                if not self.marks:  # an update starts
                    probe.start()
                super().mark()

        def probed_reduce_stats(*args, **kwargs):
            stats = reduce_stats(*args, **kwargs)  # the statistics copy: the update's last sync
            probe.end()
            return stats

        with contextlib.ExitStack() as stack:
            self.counter = stack.enter_context(self.make_counter()) if self.count_syncs else None
            ppo_plumbing.PhaseTimer, train_policy.reduce_stats = ProbedTimer, probed_reduce_stats
            stack.callback(setattr, ppo_plumbing, "PhaseTimer", timer)
            stack.callback(setattr, train_policy, "reduce_stats", reduce_stats)
            yield self

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._start = self.counter.count if self.counter else 0

    def end(self) -> None:
        self.syncs.append(self.counter.count - self._start if self.counter else -1)
        self.sites.append(self.counter.events[self._start :] if self.counter else [])
        self.memory.append(peak_memory_gib(self.device))


def print_updates(console: Console, args: Args, history: list[dict[str, float]], probe: UpdateProbe) -> None:
    """One row per update: phase seconds, OAI's elapsed/fps, host syncs, peak memory."""
    table = Table(title="per update (OAI's elapsed/fps: batch x response length / wall seconds of the update)")
    columns = ("update", *PHASES, "wall s", "tokens/s", "host syncs", "peak GiB")
    for column in columns:
        table.add_column(column, justify="right")
    ends = [0.0] + [h["elapsed/time"] for h in history]
    for update, h in enumerate(history):
        syncs = "-" if probe.syncs[update] < 0 else str(probe.syncs[update])
        table.add_row(
            f"{update}{' (warm-up)' if update < args.warmup else ''}",
            *(f"{h[f'debug/time/{phase}']:.3f}" for phase in PHASES),
            f"{ends[update + 1] - ends[update]:.3f}",
            f"{h['elapsed/fps']:.0f}",
            syncs,
            f"{probe.memory[update]:.2f}",
        )
    console.print(table)
    if probe.sites:
        sites = collections.Counter(probe.sites[-1])
        console.print("host syncs of the last update, where:", markup=False)
        for site, count in sites.most_common():
            console.print(f"  {count} x {site}", markup=False)


def run(args: Args, work_dir: str) -> None:
    """Build the inputs, run train_policy.main, print the measured table against the lower bound."""
    console = Console(width=120)
    device = run_device().type
    policy_dir, reward_dir = write_models(work_dir, args.model)
    corpus = write_corpus(work_dir)
    with UpdateProbe(device, args.count_syncs).attached() as probe:
        history = train_policy.main(policy_args(args, work_dir, policy_dir, reward_dir, corpus))
    print_updates(console, args, history, probe)
    timed = history[args.warmup :]
    measured = {p: np.array([h[f"debug/time/{p}"] for h in timed]) for p in PHASES}
    ends = [0.0] + [h["elapsed/time"] for h in history]  # seconds since the first update started
    update_times = np.diff(ends)[args.warmup :]
    fps = [h["elapsed/fps"] for h in timed]
    memory = peak_memory_gib(device)

    config = SHAPES[args.model]
    gemms = update_gemms(args, config, vocab=50257)
    flops, bound, per_shape = lower_bound(gemms, args.gemm_repeats, device)

    load = os.getloadavg()
    tuning = {k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ}
    params = sum(p.numel() for p in GPT2LMHeadModel(gpt2_config(args.model)).parameters())
    console.print(
        f"model {args.model} ({params / 1e6:.1f}M params) on {device}, {torch.get_num_threads()} threads, "
        f"{args.batch} episodes of {args.query_length}+{args.response_length} tokens, {args.noptepochs} epochs x "
        f"{args.nminibatches} minibatch, accum {args.accum}; {len(timed)} timed updates after {args.warmup} warm-up; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; allocator environment {tuning or 'default'}"
    )
    table = Table(title="seconds per PPO update (min / median over timed updates)")
    for column in ("phase", "min s", "median s", "GFLOP", "lower bound s", "ratio (min / bound)"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in PHASES:
        values = measured[phase]
        table.add_row(
            phase,
            f"{values.min():.3f}",
            f"{np.median(values):.3f}",
            f"{flops[phase] / 1e9:.1f}",
            f"{bound[phase]:.3f}",
            f"{values.min() / bound[phase]:.2f}x",
        )
    total = sum(measured[p] for p in PHASES)
    total_bound, total_flops = sum(bound.values()), sum(flops.values())
    table.add_row(
        "update",
        f"{total.min():.3f}",
        f"{np.median(total):.3f}",
        f"{total_flops / 1e9:.1f}",
        f"{total_bound:.3f}",
        f"{total.min() / total_bound:.2f}x",
        style="bold",
    )
    console.print(table)
    shapes = Table(title=f"lower bound: the GEMM shapes that dominate it (measured on {device})")
    for column in ("(batch x) m x k x n", "GFLOP / update", "GFLOP/s", "seconds / update"):
        shapes.add_column(column, justify="right")
    for (m, k, n, batch), (gflop, seconds) in sorted(per_shape.items(), key=lambda kv: -kv[1][1])[:8]:
        name = f"{batch} x {m} x {k} x {n}" if batch > 1 else f"{m} x {k} x {n}"
        shapes.add_row(name, f"{gflop:.1f}", f"{gflop / seconds:.1f}", f"{seconds:.3f}")
    console.print(shapes)
    console.print(
        f"wall seconds per update (incl. stats and logging): min {update_times.min():.3f}, "
        f"median {np.median(update_times):.3f}; episodes/s {args.batch / np.median(total):.2f} "
        f"(phases, median); response tokens/s (elapsed/fps, median) {np.median(fps):.0f}; "
        f"host syncs per update {probe.syncs[args.warmup :] if args.count_syncs else 'not counted'}; "
        f"peak memory {memory:.2f} GiB ({'max allocated' if device == 'cuda' else 'max RSS'}); "
        f"lower-bound GEMM rate {total_flops / total_bound / 1e9:.1f} GFLOP/s"
    )


def main(args: Args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.updates < 1 or args.warmup < 0:
        raise ValueError(f"need --updates >= 1 and --warmup >= 0, got {args.updates} and {args.warmup}.")
    if args.work_dir is not None:
        os.makedirs(args.work_dir, exist_ok=True)
        run(args, args.work_dir)
        return
    with tempfile.TemporaryDirectory(prefix="policy_throughput_") as work_dir:
        run(args, work_dir)


if __name__ == "__main__":
    main(cli.tyro_cli(Args, use_underscores=True))
