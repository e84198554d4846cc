"""The whole RLHF pipeline of Ziegler et al. 2019 (arXiv:1909.08593) on a small offline world, on a CPU, in minutes.

    make demo                                  # installs the demo extra, then runs this script
    python demo/run_demo.py                    # full pipeline, seed 1
    python demo/run_demo.py --seed 2           # another seed; reuses the world and the pretrained model
    python demo/run_demo.py --quick            # shortened pipeline (tests/test_demo.py)
    python demo/run_demo.py --label_server     # labels through the browser labeling server, VADER as the human
    python demo/run_demo.py --quick --reward vader  # PPO straight against VADER: no labels, no reward model
    python demo/run_demo.py --reward python:demo/word_reward.py:word_count  # against a Python function
    python demo/run_demo.py --recipe nplus --quick  # the successor recipe: SFT, EOS-ended responses, a critic

Each stage runs one of the project's scripts in a subprocess with the flags a user would type (they are printed):
 1. demo/world.py        passages from a grammar whose adjectives, verbs, objects and endings carry VADER sentiment
 2. demo/pretrain.py     a tiny GPT-2 with the real GPT-2 tokenizer, pretrained on them (skipped when
                         OUTPUT_DIR/base_model already holds a model pretrained with the same settings)
 3. label_generation.py  best-of-4 labels on the pretrained model's samples; VADER picks the best (with
                         --label_server: `sample`, then `serve`, VADER answering through the server's HTTP API)
 4. train_reward.py      a reward model trained on those labels
 5. train_policy.py      PPO against the reward model; VADER, never seen by the policy, is the gold judge
 6. evaluate.py          base policy, trained policy and the policy's checkpoints sample the same held-out queries;
                         the reward PPO maximized and VADER score them; KL to the base model; gold score vs KL
Results go to OUTPUT_DIR/seed{SEED}/ (quick-seed{SEED}/ with --quick): results.json, curves.png, evaluation/
(results.md: the evaluation table; gold_vs_kl.png; results.json), the stage logs, the labels, the reward model and the
policy with its checkpoints.

With --reward vader (or classifier:... or python:FILE.py:FUNCTION, docs/rewards.md) stages 3 and 4 are skipped: PPO
maximizes that reward itself, normalized on the base model's samples, and VADER still scores every rollout as the gold
judge; stage 6 scores the held-out samples with that reward (the run's normalization) and VADER. Results go to
OUTPUT_DIR/seed{SEED}-{REWARD}/: results.json (first and last updates' scores, the evaluation's figures), evaluation/
and the policy.

With --recipe nplus the successor recipe (docs/nplus.md) runs on the same world and base model: demo/sft_data.py
(supervised rows and prompts from the world), train_sft.py, label_generation.py (VADER's best-of-2 labels of the SFT
model's EOS-ended samples), train_reward.py and train_policy.py from the SFT model (responses that end at EOS, a critic
from the reward model, a fixed k1 KL), evaluate.py on held-out prompts. Results go to OUTPUT_DIR/nplus-seed{SEED}/
(nplus-quick-seed{SEED}/): results.json with the gold score before PPO (the SFT policy) and after.
"""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
DEMO = Path(__file__).resolve().parent
# idle OpenMP threads sleep instead of spinning: on a busy machine, spinning threads of torch's two-thread pool steal
# the CPU from the thread doing the work (measured: a pretraining step 3-4x slower next to one other busy process)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if str(REPO) not in sys.path:  # the package and the training scripts, also when the project is not pip-installed
    sys.path.insert(0, str(REPO))

import pretrain  # noqa: E402
import world  # noqa: E402

from lm_human_preference_details import cli  # noqa: E402

QUICK_MIN_GOLD_MARGIN = 0.3
"""mean VADER gain (trained - base) on held-out queries that --quick guarantees (tests/test_demo.py checks it)"""
FULL_MIN_GOLD_MARGIN = 0.5
"""mean VADER gain that the full demo guarantees"""
NPLUS_QUICK_MIN_GOLD_MARGIN = 0.5
"""mean VADER gain (PPO policy - SFT policy) on held-out prompts that --recipe nplus --quick guarantees"""
NPLUS_FULL_MIN_GOLD_MARGIN = 0.6
"""mean VADER gain that the full --recipe nplus demo guarantees"""


DEMO_THREADS = 2
"""torch's intra-op threads in every stage, whatever the machine's cores: torch and MKL split a matmul's or a
reduction's sum into one partial sum per thread, so the thread count changes the rounding (two pretrainings that differ
only in 1 or 2 threads end at losses 1.5681 and 1.5690) and PPO carries such differences on to other samples and another
final gold score. Pinned, a run repeats exactly on the same CPU and the figures of docs/demo.md depend on the CPU's
kernels only; 2 is the count they were measured with."""
REWARD_MODEL = "reward_model"
DIRECT_NORMALIZE_SAMPLES = 256
"""base-model samples on which a programmatic reward is normalized (as train_reward.py normalizes the reward model)"""


@dataclass
class Args:
    seed: int = 1
    """seed of label sampling, reward-model training, PPO and the evaluation samples"""
    output_dir: str = "runs/demo"
    """the world and the pretrained model go here; everything of one seed goes to OUTPUT_DIR/seed{SEED}
    (OUTPUT_DIR/quick-seed{SEED} with --quick)"""
    quick: bool = False
    """shortened pipeline (fewer labels and PPO updates, the same base model): about two minutes, same story"""
    samples_to_show: int = 8
    """rows of the before/after table"""
    label_server: bool = False
    """label step through the browser labeling server: `label_generation.py sample` writes the candidates, `serve`
    serves them and a scripted human (VADER behind the server's HTTP API) labels every row"""
    recipe: Literal["oai", "nplus"] = "oai"
    """oai: Ziegler et al. 2019's pipeline; nplus: the successor recipe's (Huang et al. 2024, docs/nplus.md): SFT on the
    world's sentences, a reward model from the SFT model on VADER's best-of-2 labels of its EOS-ended samples, PPO with
    responses that end at EOS, a critic initialized from the reward model and a fixed KL coefficient"""
    reward: str = REWARD_MODEL
    """what PPO maximizes: reward_model (labels from VADER -> a reward model; the full story) or a programmatic reward
    that train_policy.py's --rewards.trained_model takes, e.g. vader or python:demo/word_reward.py:word_count (stages
    3 and 4 skipped)"""


@dataclass
class Settings:
    """Sizes of one demo mode."""

    pretrain: pretrain.Args
    """the base model and its pretraining budget"""
    num_labels: int
    """label rows (a query and 4 responses each) written by label_generation.py"""
    heldout_labels: int
    """the last rows of the label file, kept out of reward training to measure its accuracy"""
    reward_lr: float
    """train_reward.py --lr"""
    reward_batch_size: int
    """train_reward.py --batch_size (labels per step; one epoch over the labels, as OAI)"""
    ppo_episodes: int
    """train_policy.py --ppo.total_episodes"""
    ppo_batch_size: int
    """train_policy.py --ppo.batch_size (episodes per PPO update)"""
    ppo_lr: float
    """train_policy.py --ppo.lr"""
    checkpoint_interval: int
    """train_policy.py --save_interval with --save_checkpoints: the checkpoints of the gold-vs-KL curve"""
    eval_queries: int
    """held-out queries sampled by the base and the trained policy for the before/after figures"""


# the task: a query is the sentence after a passage's first '.' (12 tokens, padded to 16); the response is 12 tokens,
# one sentence of the grammar; it must hold a '.' at index >= 8 to pass the filter (the grammar puts it at 11)
QUERY_LENGTH, RESPONSE_LENGTH, TRUNCATE_AFTER = 16, 12, 8
# KL budget: enough for the policy to turn a continuation's mood positive, not enough to leave the grammar
KL_TARGET, KL_HORIZON, KL_COEF = 3.0, 512, 0.15

FULL = Settings(
    pretrain=pretrain.Args(),  # demo/pretrain.py's defaults: 2 layers, 64 wide, 250 steps of 32 x 24 tokens
    num_labels=1536,
    heldout_labels=128,
    reward_lr=1e-3,
    reward_batch_size=8,
    ppo_episodes=64 * 32,
    ppo_batch_size=64,
    ppo_lr=3e-4,
    checkpoint_interval=4,
    eval_queries=256,
)
QUICK = Settings(
    pretrain=FULL.pretrain,
    num_labels=768,
    heldout_labels=64,
    reward_lr=1e-3,
    reward_batch_size=8,
    ppo_episodes=64 * 12,
    ppo_batch_size=64,
    ppo_lr=3e-4,
    checkpoint_interval=4,
    eval_queries=128,
)


@dataclass
class NplusSettings:
    """Sizes of one mode of the successor recipe's pipeline (--recipe nplus)."""

    pretrain: pretrain.Args
    """the base model and its pretraining budget (the OAI pipeline's)"""
    num_sft: int
    """supervised examples (demo/sft_data.py --num_sft): one epoch of train_sft.py over them"""
    sft_lr: float
    """train_sft.py --lr"""
    sft_batch_size: int
    """train_sft.py --batch_size"""
    num_labels: int
    """best-of-2 label rows (a prompt and 2 EOS-ended samples of the SFT model each) written by label_generation.py"""
    heldout_labels: int
    """the last rows of the label file, kept out of reward training to measure its accuracy"""
    reward_lr: float
    """train_reward.py --lr"""
    reward_batch_size: int
    """train_reward.py --batch_size"""
    ppo_episodes: int
    """train_policy.py --ppo.total_episodes"""
    ppo_batch_size: int
    """train_policy.py --ppo.batch_size"""
    ppo_lr: float
    """train_policy.py --ppo.lr"""
    checkpoint_interval: int
    """train_policy.py --save_interval with --save_checkpoints: the checkpoints of the gold-vs-KL curve"""
    eval_queries: int
    """held-out prompts sampled by the SFT and the trained policy for the before/after figures"""


# the successor recipe's task: a prompt is a passage's first sentence (12 tokens, padded to 16), a response is written
# until its EOS (a sentence is 12 tokens), at most 16 tokens; one without EOS scores the penalty (nplus N20)
NPLUS_QUERY_LENGTH, NPLUS_RESPONSE_LENGTH = 16, 16
NPLUS_KL_COEF = 0.05
"""the fixed KL coefficient (nplus N21: beta 0.05, k1, no adaptive controller)"""

NPLUS_FULL = NplusSettings(
    pretrain=FULL.pretrain,
    num_sft=4000,
    sft_lr=3e-3,
    sft_batch_size=16,
    num_labels=1536,
    heldout_labels=128,
    reward_lr=1e-3,
    reward_batch_size=16,
    ppo_episodes=64 * 32,
    ppo_batch_size=64,
    ppo_lr=3e-4,
    checkpoint_interval=4,
    eval_queries=256,
)
# the same SFT as the full run: with half its rows (2000) seed 1 ends at a margin of +0.66 (KL 4.5), seed 2 at +0.90
NPLUS_QUICK = dataclasses.replace(NPLUS_FULL, num_labels=768, heldout_labels=64, ppo_episodes=64 * 12, eval_queries=128)


def child_env() -> dict[str, str]:
    """The environment of every stage: offline, the repository importable, DEMO_THREADS threads, no tokenizer thread
    pools, CPU tuning."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env.update(OMP_NUM_THREADS=str(DEMO_THREADS), MKL_NUM_THREADS=str(DEMO_THREADS))
    # glibc returns every freed block over 32 MiB to the OS and page-faults it in again at the next allocation; the
    # (batch, 50257) logits are such blocks. Keeping them in the heap halves label generation's wall time (sys time
    # 15s -> 1s for 512 labels); other C libraries ignore these variables
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(2**30))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(2**30))
    return env


def run_stage(name: str, script: Path, flags: list[str], log_dir: Path) -> float:
    """Run `python script flags...` like a user would, echo its output and save it to log_dir/name.log; seconds."""
    command = [sys.executable, str(script.relative_to(REPO)), *flags]
    print(f"\n=== {name} ===\n$ {' '.join(command[1:])}", flush=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log_dir / f"{name}.log", "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        process.wait()
    if process.returncode != 0:
        raise SystemExit(f"stage '{name}' failed with exit code {process.returncode}; see {log_dir / name}.log")
    seconds = time.time() - start
    print(f"--- {name}: {seconds:.0f}s", flush=True)
    return seconds


def label_through_server(flags: dict[str, object], labels: Path, log_dir: Path) -> float:
    """Stage 3 through the labeling server: sample the candidates, serve them, and let a scripted human (VADER picks
    the best of the responses as the page shows them) label every row over HTTP; seconds."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    from lm_human_preference_details.labeling.labelclient import LabelClient

    start = time.time()
    candidates = labels.parent / "candidates.json"
    sample_flags = flag_list({**flags, "--output": candidates})
    run_stage("candidates", REPO / "label_generation.py", ["sample", *sample_flags], log_dir)
    serve_flags = ["--candidates", str(candidates), "--output", str(labels), "--port", "0", "--shared_fraction", "0"]
    command = [sys.executable, "label_generation.py", "serve", *serve_flags]
    print(f"\n=== labels (a scripted human in the label server) ===\n$ {' '.join(command[1:])}", flush=True)
    server = subprocess.Popen(
        command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output, url = [], None
    for line in server.stdout:
        output.append(line)
        print(line, end="", flush=True)
        match = re.search(r"http://127\.0\.0\.1:\d+/", line)
        if match:
            url = match.group(0)
            break
    try:
        if url is None:
            raise SystemExit(f"the label server did not start; see {log_dir / 'labels.log'}")
        analyzer = SentimentIntensityAnalyzer()

        def vader_best(row: dict) -> int:
            scores = [analyzer.polarity_scores(text)["compound"] for text in row["responses"]]
            return scores.index(max(scores))

        labelled = LabelClient(url, "vader").label_all(vader_best)
    finally:
        server.send_signal(signal.SIGINT)
        output.append(server.communicate(timeout=120)[0])
        (log_dir / "labels.log").write_text("".join(output), encoding="utf-8")
    print(output[-1], end="")
    if server.returncode != 0:
        raise SystemExit(f"the label server failed with exit code {server.returncode}; see {log_dir / 'labels.log'}")
    seconds = time.time() - start
    print(f"--- labels: {labelled} rows labelled by VADER through {url} in {seconds:.0f}s", flush=True)
    return seconds


def flag_list(values: dict[str, object]) -> list[str]:
    """{'--a': 1, '--b': 'x'} -> ['--a', '1', '--b', 'x']."""
    return [item for key, value in values.items() for item in (key, str(value))]


def same_json(path: Path, key: str, expected: dict) -> bool:
    """True when the JSON file at `path` exists and its `key` equals `expected`."""
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        return json.load(f).get(key) == json.loads(json.dumps(expected))


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard events under tb_dir: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(s.step, s.value) for s in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def plot_curves(policy_scalars: dict, reward_scalars: dict, path: Path, title: str) -> None:
    """curves.png: the policy's score, gold score, KL and kl_coef per update; the reward model's accuracy and loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels = [
        ("objective/score", "reward-model score (what PPO maximizes)", None),
        ("objective/gold_score", "gold score: VADER compound (never trained on)", None),
        ("objective/kl", "KL(policy || base) per response, nats", KL_TARGET),
        ("objective/kl_coef", "kl_coef (adaptive KL controller)", None),
    ]
    for ax, (tag, label, target) in zip(axes.flat, panels):
        steps, values = zip(*policy_scalars[tag])
        ax.plot(steps, values, marker=".")
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", label=f"target {target:g}")
            ax.legend()
        ax.set_title(label)
        ax.set_xlabel("PPO update")
    ax = axes.flat[4]
    steps, values = zip(*reward_scalars["debug/accuracy"])
    ax.plot(steps, values, alpha=0.4, label="train minibatch")
    steps, values = zip(*reward_scalars["eval/accuracy"])
    ax.plot(steps, values, marker=".", label="held-out labels")
    ax.axhline(0.25, color="gray", linestyle=":", label="chance")
    ax.set_ylim(0, 1)
    ax.set_title("reward model: best-of-4 accuracy")
    ax.set_xlabel("reward training step")
    ax.legend()
    ax = axes.flat[5]
    steps, values = zip(*reward_scalars["train_reward/minibatch/loss"])
    ax.plot(steps, values, alpha=0.6, label="train minibatch")
    steps, values = zip(*reward_scalars["eval/loss"])
    ax.plot(steps, values, marker=".", label="held-out labels")
    ax.set_title("reward model: best-of-4 cross-entropy")
    ax.set_xlabel("reward training step")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(results: dict) -> None:
    """The before/after table of samples and the headline figures."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    table = Table(
        title="held-out queries: base policy vs PPO-trained policy, with the VADER compound of each response",
        show_lines=True,
    )
    for column in ("query", "base policy", "VADER", "trained policy", "VADER"):
        table.add_column(column, overflow="fold")
    for sample in results["samples"]:
        table.add_row(
            sample["query"],
            sample["base"],
            f"{sample['base_gold']:+.2f}",
            sample["trained"],
            f"{sample['trained_gold']:+.2f}",
        )
    console.print(table)
    gold, rm, policy = results["gold"], results["reward_model"], results["policy"]
    figures = Table(title=f"demo results (seed {results['seed']}, {results['mode']} mode)")
    figures.add_column("figure")
    figures.add_column("value")
    figures.add_row(
        f"gold score (mean VADER compound, {gold['queries']} held-out queries)",
        f"base {gold['base']:+.3f} ± {gold['base_stderr']:.3f}  ->  trained {gold['trained']:+.3f} ± "
        f"{gold['trained_stderr']:.3f}  (margin {gold['margin']:+.3f})",
    )
    reward_score, pass_rate, wins = results["reward_score"], results["filter_pass_rate"], results["win_rate"]
    figures.add_row(
        "reward-model score on the same samples (normalized, filter penalty)",
        f"base {reward_score['base']:+.3f}  ->  trained {reward_score['trained']:+.3f}",
    )
    figures.add_row(
        "win rate of the trained policy over the base policy (same query)",
        f"gold {wins['gold_score']:.3f}, reward model {wins['score']:.3f}",
    )
    figures.add_row(
        f"reward model held-out accuracy ({rm['heldout_rows']} best-of-4 labels, chance 0.25)",
        f"{rm['accuracy_before']:.3f} before training  ->  {rm['accuracy_after']:.3f} after",
    )
    figures.add_row(
        "final KL(policy || base) per response",
        f"{policy['final_kl']:.2f} nats at the last update, {policy['kl_last5']:.2f} over the last 5 "
        f"(target {policy['kl_target']:g}), {results['eval_kl']['trained']:.2f} on the held-out samples; "
        f"kl_coef {policy['final_kl_coef']:.4f}",
    )
    figures.add_row(
        f"response filter pass rate (a '.' at index >= {TRUNCATE_AFTER})",
        f"base {pass_rate['base']:.3f}  ->  trained {pass_rate['trained']:.3f}",
    )
    figures.add_row("wall time", ", ".join(f"{k} {v:.0f}s" for k, v in results["timings"].items()))
    console.print(figures)
    guaranteed = results["guaranteed_margin"]
    verdict = "as guaranteed" if gold["margin"] >= guaranteed else "BELOW the guaranteed margin: something is off"
    console.print(
        f"gold margin {gold['margin']:+.3f} vs {guaranteed:+.2f} guaranteed in {results['mode']} mode: {verdict}"
    )


def prepare_base(
    root: Path, pretrain_settings: pretrain.Args, logs: Path, timings: dict[str, float]
) -> tuple[Path, Path]:
    """Stages 1 and 2, the world and the pretrained model, each skipped when its settings already wrote it; -> the
    world's and the base model's directories."""

    # 1. world: regenerated only when its settings changed (it is deterministic)
    world_args = world.Args(output_dir=str(root / "world"))
    world_dir = Path(world_args.output_dir)
    fresh_world = not same_json(world_dir / "world.json", "args", dataclasses.asdict(world_args))
    if fresh_world:
        timings["world"] = run_stage("world", DEMO / "world.py", flag_list({"--output_dir": world_dir}), logs)

    # 2. pretraining, skipped when the same settings already produced a model from the same world
    pretrain_args = dataclasses.replace(
        pretrain_settings, corpus=str(world_dir / "pretrain.txt"), output_dir=str(root / "base_model")
    )
    base_dir = Path(pretrain_args.output_dir)
    if fresh_world or not same_json(base_dir / pretrain.SETTINGS_FILE, "args", dataclasses.asdict(pretrain_args)):
        pretrain_flags = {f"--{k}": v for k, v in dataclasses.asdict(pretrain_args).items()}
        timings["pretrain"] = run_stage("pretrain", DEMO / "pretrain.py", flag_list(pretrain_flags), logs)
    else:
        print(f"\n=== pretrain === skipped: {base_dir} holds a model pretrained with the same settings")
    return world_dir, base_dir


def run_stages(args: Args, settings: Settings, root: Path, run_dir: Path) -> tuple[Path, Path, dict[str, float]]:
    """Stages 1-5 as subprocesses; returns the world directory, the base model directory and the stage timings."""
    logs = run_dir / "logs"
    timings: dict[str, float] = {}
    world_dir, base_dir = prepare_base(root, settings.pretrain, logs, timings)

    # 3-6 start from scratch in the seed's directory
    for name in ("labels", "reward", "policy", "evaluation"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    task_flags = {
        "--task.query_dataset": world_dir / "queries.txt",
        "--task.query_length": QUERY_LENGTH,
        "--task.response_length": RESPONSE_LENGTH,
        "--task.truncate_after": TRUNCATE_AFTER,
    }
    if args.reward != REWARD_MODEL:  # PPO straight against a programmatic reward: no labels, no reward model
        reward_flags = {"--rewards.trained_model": args.reward, "--rewards.normalize_samples": DIRECT_NORMALIZE_SAMPLES}
        timings["policy"] = run_policy(args, settings, base_dir, run_dir, task_flags, reward_flags, logs)
        return world_dir, base_dir, timings
    labels = run_dir / "labels" / "vader.json"
    label_flags = {
        "--base_model": base_dir,
        "--num_queries": settings.num_labels,
        "--batch_size": 32,
        "--seed": args.seed,
        **task_flags,
    }
    if args.label_server:
        timings["labels"] = label_through_server(label_flags, labels, logs)
    else:
        generate_flags = flag_list({"--labeler": "vader", **label_flags, "--output": labels})
        timings["labels"] = run_stage("labels", REPO / "label_generation.py", ["generate", *generate_flags], logs)
    timings["reward"] = run_stage(
        "reward",
        REPO / "train_reward.py",
        flag_list(
            {
                "--base_model": base_dir,
                "--label_dataset": labels,
                "--labels.num_train": settings.num_labels - settings.heldout_labels,
                "--batch_size": settings.reward_batch_size,
                "--lr": settings.reward_lr,
                "--rollout_batch_size": 64,
                "--normalize_samples": 256,
                "--eval_interval": 2,
                "--seed": args.seed,
                "--output_dir": run_dir / "reward",
                **task_flags,
            }
        ),
        logs,
    )
    reward_flags = {"--rewards.trained_model": run_dir / "reward"}
    timings["policy"] = run_policy(args, settings, base_dir, run_dir, task_flags, reward_flags, logs)
    return world_dir, base_dir, timings


def run_policy(
    args: Args, settings: Settings, base_dir: Path, run_dir: Path, task_flags: dict, reward_flags: dict, logs: Path
) -> float:
    """Stage 5, train_policy.py against `reward_flags`' reward, VADER the gold judge; the seconds it took."""
    return run_stage(
        "policy",
        REPO / "train_policy.py",
        flag_list(
            {
                "--base_model": base_dir,
                **reward_flags,
                "--rewards.gold_model": "vader",
                "--rewards.kl_coef": KL_COEF,
                "--rewards.adaptive_kl.target": KL_TARGET,
                "--rewards.adaptive_kl.horizon": KL_HORIZON,
                "--ppo.total_episodes": settings.ppo_episodes,
                "--ppo.batch_size": settings.ppo_batch_size,
                "--ppo.lr": settings.ppo_lr,
                # the whole 64-episode batch is one whitening group, as each of OAI's 8 ranks whitened its own 64
                # episodes (512 / 8); the default, 8 virtual ranks of 64 / 8 = 8 episodes, whitens rewards and
                # advantages over 8 episodes: measured on seed 1, gold +0.41 instead of +0.77 (docs/demo.md)
                "--ppo.whiten_group_size": 0,
                "--log_interval": 8,
                "--save_interval": settings.checkpoint_interval,
                "--seed": args.seed,
                "--output_dir": run_dir / "policy",
                **task_flags,
            }
        )
        + ["--save_checkpoints"],
        logs,
    )


def run_evaluation(args: Args, settings: Settings | NplusSettings, queries: Path, run_dir: Path) -> tuple[dict, float]:
    """Stage 6, evaluate.py: base vs trained policy and the gold-vs-KL curve; its results.json and the seconds."""
    # the task, the base model, the reward (a reward model, or a programmatic reward with its normalization) and the
    # gold judge (VADER) come from the policy's args.json; the queries come from texts the policy never saw
    output_dir = run_dir / "evaluation"
    flags = {
        "--policy": run_dir / "policy",
        "--checkpoints": run_dir / "policy" / "checkpoints" / "update*",
        "--task.query_dataset": queries,
        "--num_queries": settings.eval_queries,
        "--seed": args.seed,
        "--examples": args.samples_to_show,
        "--output_dir": output_dir,
    }
    seconds = run_stage("evaluation", REPO / "evaluate.py", flag_list(flags), run_dir / "logs")
    with open(output_dir / "results.json", encoding="utf-8") as f:
        return json.load(f), seconds


def evaluation_figures(evaluation: dict) -> dict:
    """Base vs trained policy on the held-out queries, from evaluate.py's results.json."""
    metrics = evaluation["metrics"]
    gold = metrics["gold_score"]
    return {
        "gold": {
            "queries": evaluation["queries"]["num"],
            "base": gold["base"]["mean"],
            "base_stderr": gold["base"]["stderr"],
            "trained": gold["trained"]["mean"],
            "trained_stderr": gold["trained"]["stderr"],
            "margin": gold["trained"]["mean"] - gold["base"]["mean"],
        },
        "reward_score": {k: metrics["score"][k]["mean"] for k in ("base", "trained")},
        "filter_pass_rate": {k: metrics["filter_pass_rate"][k]["mean"] for k in ("base", "trained")},
        "eval_kl": {k: metrics["kl"][k]["mean"] for k in ("base", "trained")},
        "win_rate": evaluation["win_rate"],
        "samples": [
            {
                "query": e["query"].strip(),
                "base": e["base"]["response"].strip(),
                "base_gold": e["base"]["gold_score"],
                "trained": e["trained"]["response"].strip(),
                "trained_gold": e["trained"]["gold_score"],
            }
            for e in evaluation["examples"]
        ],
    }


def summarize(
    args: Args, settings: Settings, evaluation: dict, policy_scalars: dict, reward_meta: dict, timings: dict[str, float]
) -> dict:
    """The figures written to results.json; `evaluation` is evaluate.py's results.json."""
    kl = [value for _, value in policy_scalars["objective/kl"]]
    return {
        "seed": args.seed,
        "mode": "quick" if args.quick else "full",
        "guaranteed_margin": QUICK_MIN_GOLD_MARGIN if args.quick else FULL_MIN_GOLD_MARGIN,
        **evaluation_figures(evaluation),
        "reward_model": {
            "heldout_rows": reward_meta["eval_after"]["rows"],
            "accuracy_before": reward_meta["eval_before"]["accuracy"],
            "accuracy_after": reward_meta["eval_after"]["accuracy"],
        },
        "policy": {
            "updates": len(kl),
            "kl_target": KL_TARGET,
            "final_kl": kl[-1],
            "kl_last5": sum(kl[-5:]) / len(kl[-5:]),
            "final_kl_coef": policy_scalars["objective/kl_coef"][-1][1],
            "final_score": policy_scalars["objective/score"][-1][1],
            "final_gold_score": policy_scalars["objective/gold_score"][-1][1],
        },
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "settings": {
            **dataclasses.asdict(settings),
            "query_length": QUERY_LENGTH,
            "response_length": RESPONSE_LENGTH,
            "truncate_after": TRUNCATE_AFTER,
            "kl_coef": KL_COEF,
            "kl_target": KL_TARGET,
            "kl_horizon": KL_HORIZON,
        },
    }


def slug(spec: str) -> str:
    """A directory-name form of a reward: vader -> vader, python:demo/word_reward.py:word_count -> word_count."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", spec.rpartition(":")[2] or spec).strip("-") or "reward"


def main_direct(args: Args, settings: Settings, root: Path, run_dir: Path, start: float) -> dict:
    """World, base model, PPO straight against a programmatic reward and the evaluation; results.json with the first
    and last updates' scores (normalized on the base model's samples), the VADER gold score and the held-out figures."""
    if args.reward.startswith("python:"):  # the stages run from the repository: FILE relative to the caller's cwd
        path, _, function = args.reward.removeprefix("python:").rpartition(":")
        args = dataclasses.replace(args, reward=f"python:{Path(path).resolve()}:{function}")
    world_dir, _, timings = run_stages(args, settings, root, run_dir)
    evaluation, timings["evaluation"] = run_evaluation(args, settings, world_dir / "heldout.txt", run_dir)
    timings["total"] = time.time() - start
    scalars = read_scalars(run_dir / "policy" / "tb")
    series = {tag: [value for _, value in scalars[tag]] for tag in ("objective/score", "objective/gold_score")}
    kl = [value for _, value in scalars["objective/kl"]]
    results = {
        "seed": args.seed,
        "mode": "quick" if args.quick else "full",
        "reward": args.reward,
        **{
            tag.split("/")[1]: {"first": values[0], "last5": sum(values[-5:]) / len(values[-5:])}
            for tag, values in series.items()
        },
        "policy": {"updates": len(kl), "final_kl": kl[-1], "kl_target": KL_TARGET},
        **evaluation_figures(evaluation),
        "timings": {k: round(v, 1) for k, v in timings.items()},
    }
    with open(run_dir / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    score, gold, heldout = results["score"], results["gold_score"], results["gold"]
    print(
        f"\nPPO against {args.reward} (normalized: mean 0, std 1 on the base model's samples): score "
        f"{score['first']:+.3f} at the first update -> {score['last5']:+.3f} over the last 5; VADER gold score "
        f"{gold['first']:+.3f} -> {gold['last5']:+.3f}; final KL {kl[-1]:.2f} nats (target {KL_TARGET:g})\n"
        f"held-out queries ({heldout['queries']}): VADER gold score base {heldout['base']:+.3f} -> trained "
        f"{heldout['trained']:+.3f}, win rate {results['win_rate']['gold_score']:.3f}; {args.reward} score base "
        f"{results['reward_score']['base']:+.3f} -> trained {results['reward_score']['trained']:+.3f}\n"
        f"wrote {run_dir / 'results.json'}, {run_dir / 'evaluation'} and the policy in {run_dir / 'policy'}"
    )
    return results


# ---------------------------------------------------------------- the successor recipe (--recipe nplus)


def nplus_task_flags(world_dir: Path) -> list[str]:
    """The task of every N+ stage: the world's prompts as they are (no OAI trimming at a '.'), responses that end at
    their first EOS and nothing else (no truncation token)."""
    flags = {
        "--task.query_dataset": world_dir / "prompts.jsonl",
        "--task.query_length": NPLUS_QUERY_LENGTH,
        "--task.response_length": NPLUS_RESPONSE_LENGTH,
        "--task.start_text": None,
        "--task.end_text": None,
        "--task.truncate_text": None,
        "--task.truncate_token": None,
        "--task.truncate_after": 0,
        "--task.temperature": 0.7,
    }
    return [*flag_list(flags), "--task.end_at_eos"]


def run_nplus_stages(args: Args, settings: NplusSettings, root: Path, run_dir: Path) -> tuple[Path, dict[str, float]]:
    """The successor recipe's stages as subprocesses: world, pretraining, SFT data, SFT, best-of-2 labels of the SFT
    model's samples, reward model, PPO; -> the world directory and the stage timings."""
    logs = run_dir / "logs"
    timings: dict[str, float] = {}
    world_dir, base_dir = prepare_base(root, settings.pretrain, logs, timings)
    sft_data_flags = flag_list({"--world_dir": world_dir, "--num_sft": settings.num_sft})
    timings["sft_data"] = run_stage("sft_data", DEMO / "sft_data.py", sft_data_flags, logs)
    for name in ("sft", "labels", "reward", "policy", "evaluation"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    task_flags = nplus_task_flags(world_dir)
    sft_dir = run_dir / "sft"
    sft_flags = {
        "--base_model": base_dir,
        "--dataset": world_dir / "sft.jsonl",
        "--lr": settings.sft_lr,
        "--batch_size": settings.sft_batch_size,
        "--seed": args.seed,
        "--output_dir": sft_dir,
    }
    timings["sft"] = run_stage("sft", REPO / "train_sft.py", flag_list(sft_flags), logs)
    # VADER picks the better of two EOS-ended samples of the SFT model per prompt (best_of_2)
    labels = run_dir / "labels" / "vader.json"
    label_flags = {
        "--labeler": "vader",
        "--base_model": sft_dir,
        "--num_labels": 2,
        "--num_queries": settings.num_labels,
        "--batch_size": 32,
        "--seed": args.seed,
        "--output": labels,
    }
    timings["labels"] = run_stage(
        "labels", REPO / "label_generation.py", ["generate", *flag_list(label_flags), *task_flags], logs
    )
    reward_flags = {
        "--base_model": sft_dir,
        "--label_dataset": labels,
        "--labels.type": "best_of_2",
        "--labels.num_train": settings.num_labels - settings.heldout_labels,
        "--batch_size": settings.reward_batch_size,
        "--lr": settings.reward_lr,
        "--rollout_batch_size": 64,
        "--normalize_samples": 256,
        "--eval_interval": 4,
        "--seed": args.seed,
        "--output_dir": run_dir / "reward",
    }
    timings["reward"] = run_stage("reward", REPO / "train_reward.py", [*flag_list(reward_flags), *task_flags], logs)
    policy_flags = {
        "--base_model": sft_dir,
        "--rewards.trained_model": run_dir / "reward",
        "--ppo.value_model": "reward",  # a critic of its own, initialized from the reward model (nplus N16)
        "--rewards.kl_estimator": "k1",
        "--rewards.kl_coef": NPLUS_KL_COEF,
        "--rewards.gold_model": "vader",
        "--ppo.total_episodes": settings.ppo_episodes,
        "--ppo.batch_size": settings.ppo_batch_size,
        "--ppo.lr": settings.ppo_lr,
        "--ppo.whiten_group_size": 0,
        "--log_interval": 8,
        "--save_interval": settings.checkpoint_interval,
        "--seed": args.seed,
        "--output_dir": run_dir / "policy",
    }
    policy_argv = [*flag_list(policy_flags), "--rewards.adaptive_kl.no_enabled", "--save_checkpoints", *task_flags]
    timings["policy"] = run_stage("policy", REPO / "train_policy.py", policy_argv, logs)
    return world_dir, timings


def main_nplus(args: Args, settings: NplusSettings, run_dir: Path, start: float) -> dict:
    """The successor recipe's pipeline on the demo world and its evaluation on held-out prompts; results.json with the
    gold score of the SFT policy (before PPO) and of the trained policy."""
    root = Path(args.output_dir).resolve()
    world_dir, timings = run_nplus_stages(args, settings, root, run_dir)
    evaluation, timings["evaluation"] = run_evaluation(args, settings, world_dir / "heldout_prompts.jsonl", run_dir)
    policy_scalars = read_scalars(run_dir / "policy" / "tb")
    with open(run_dir / "reward" / "reward_model.json", encoding="utf-8") as f:
        reward_meta = json.load(f)
    timings["total"] = time.time() - start
    kl = [value for _, value in policy_scalars["objective/kl"]]
    results = {
        "seed": args.seed,
        "recipe": "nplus",
        "mode": "quick" if args.quick else "full",
        "guaranteed_margin": NPLUS_QUICK_MIN_GOLD_MARGIN if args.quick else NPLUS_FULL_MIN_GOLD_MARGIN,
        **evaluation_figures(evaluation),
        "reward_model": {
            "heldout_rows": reward_meta["eval_after"]["rows"],
            "accuracy_before": reward_meta["eval_before"]["accuracy"],
            "accuracy_after": reward_meta["eval_after"]["accuracy"],
        },
        "policy": {
            "updates": len(kl),
            "kl_coef": NPLUS_KL_COEF,
            "final_kl": kl[-1],
            "final_score": policy_scalars["objective/score"][-1][1],
            "final_gold_score": policy_scalars["objective/gold_score"][-1][1],
        },
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "settings": {
            **dataclasses.asdict(settings),
            "query_length": NPLUS_QUERY_LENGTH,
            "response_length": NPLUS_RESPONSE_LENGTH,
            "kl_coef": NPLUS_KL_COEF,
        },
    }
    with open(run_dir / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    gold, rm = results["gold"], results["reward_model"]
    guaranteed = results["guaranteed_margin"]
    verdict = "as guaranteed" if gold["margin"] >= guaranteed else "BELOW the guaranteed margin: something is off"
    print(
        f"\nsuccessor recipe, seed {args.seed} ({results['mode']}): VADER gold score on {gold['queries']} held-out "
        f"prompts: SFT policy {gold['base']:+.3f} -> PPO policy {gold['trained']:+.3f}\nmargin {gold['margin']:+.3f}, "
        f"{guaranteed:+.2f} guaranteed: {verdict}; win rate {results['win_rate']['gold_score']:.3f}; reward model "
        f"held-out accuracy {rm['accuracy_before']:.3f} -> {rm['accuracy_after']:.3f} (best of 2, chance 0.5); final "
        f"KL {kl[-1]:.2f} nats; {timings['total']:.0f}s\nwrote {run_dir / 'results.json'}, {run_dir / 'evaluation'}"
    )
    return results


def main(args: Args) -> dict:
    """Run every stage, evaluate, write results.json and curves.png; returns the results."""
    start = time.time()
    settings = QUICK if args.quick else FULL
    root = Path(args.output_dir).resolve()
    run_dir = root / (f"quick-seed{args.seed}" if args.quick else f"seed{args.seed}")
    if args.recipe == "nplus":
        return main_nplus(
            args, NPLUS_QUICK if args.quick else NPLUS_FULL, run_dir.with_name(f"nplus-{run_dir.name}"), start
        )
    if args.reward != REWARD_MODEL:
        return main_direct(args, settings, root, run_dir.with_name(f"{run_dir.name}-{slug(args.reward)}"), start)
    world_dir, _, timings = run_stages(args, settings, root, run_dir)

    # 6. evaluation on held-out queries; the curves come from the TensorBoard events of the two training runs
    evaluation, timings["evaluation"] = run_evaluation(args, settings, world_dir / "heldout.txt", run_dir)
    policy_scalars = read_scalars(run_dir / "policy" / "tb")
    reward_scalars = read_scalars(run_dir / "reward" / "tb")
    with open(run_dir / "reward" / "reward_model.json", encoding="utf-8") as f:
        reward_meta = json.load(f)
    timings["total"] = time.time() - start

    results = summarize(args, settings, evaluation, policy_scalars, reward_meta, timings)
    with open(run_dir / "results.json", "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    gold, policy = results["gold"], results["policy"]
    title = (
        f"demo seed {args.seed} ({results['mode']}): gold {gold['base']:+.2f} -> {gold['trained']:+.2f}, "
        f"reward-model accuracy {results['reward_model']['accuracy_after']:.2f}, "
        f"final KL {policy['final_kl']:.2f} (target {KL_TARGET:g})"
    )
    plot_curves(policy_scalars, reward_scalars, run_dir / "curves.png", title)
    print_report(results)
    evaluation_dir = run_dir / "evaluation"
    print(
        f"wrote {run_dir / 'results.json'}, {run_dir / 'curves.png'}, {evaluation_dir / 'results.md'} and "
        f"{evaluation_dir / 'gold_vs_kl.png'}"
    )
    return results


if __name__ == "__main__":
    main(cli.tyro_cli(Args))
