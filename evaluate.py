"""Evaluate a policy written by train_policy.py against its base model: held-out samples scored by the reward it was
trained against and a gold judge, the KL to the base model, win rates, example texts; and gold score vs KL over saved
checkpoints.

Settings default to the policy's training run (its args.json: task, base model, reward, gold judge, data_seed), so the
policy samples and is scored exactly as in training; every flag overrides one of them. The reward is a reward-model
directory or a programmatic reward (vader, classifier:..., python:FILE.py:FUNCTION), as --rewards.trained_model of
train_policy.py names it; a programmatic reward that the run normalized (--rewards.normalize_samples) gets the run's
gain and bias, as in training. Relative paths in args.json (base model, query file, reward file) are read from the
working directory, as train_policy.py read them: run evaluate.py where the training ran, or pass the flag.

    python evaluate.py --policy models/policy --gold vader
    python evaluate.py --policy models/policy --gold classifier:lvwerra/distilbert-imdb#POSITIVE --num_queries 1024
    python evaluate.py --policy models/policy --checkpoints 'models/policy/checkpoints/*' models/policy_kl12 \\
        --gold reward_model:models/gold_reward

Held-out queries: a run with data_seed D drew the first nupdates * ppo.batch_size queries of the task's query stream
(all processes together). By default (--skip_queries unset) the evaluation skips exactly those when it reads the same
dataset with the same data_seed; --skip_queries N starts at query N instead, and --task.query_dataset FILE or
--split test evaluates on other texts. results.json records whether the queries were held out (they are not when
the stream wrapped around: a small dataset repeats).

Writes OUTPUT_DIR/results.json and results.md (OUTPUT_DIR defaults to POLICY/eval) and, with --checkpoints,
gold_vs_kl.png: the gold and reward scores of every checkpoint against sqrt(KL), one line per training run.
"""

import dataclasses
import glob
import json
import os
import re
import sys
from dataclasses import dataclass, field

import torch
import tyro

from lm_human_preference_details import checkpoint, cli, devices, files, sizes, validation
from lm_human_preference_details.data import load_texts
from lm_human_preference_details.evaluation import (
    BASE_RUN,
    FINAL_POLICY,
    GOLD,
    curve_point,
    examples,
    heldout_queries,
    markdown,
    plot_gold_vs_kl,
    print_report,
    sample_and_score,
    score_title,
    summarize,
    write_text_atomic,
)
from lm_human_preference_details.labelers import judge_task_mismatch, load_labeler
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm, saved_kind
from lm_human_preference_details.rewards import (
    attach_conversations,
    describe_normalization,
    load_reward,
    python_file_and_function,
    reward_input_path,
)
from lm_human_preference_details.sources import OAI_TEXT_SOURCES
from lm_human_preference_details.tasks import TASKS, TaskHParams, resolve_truncation
from lm_human_preference_details.tokenizer import check_same_tokenizer, load_tokenizer

RUN_PRESET = "policy"
"""--task name of the settings read from the policy's args.json (the default when it has one)"""


@dataclass
class Args:
    policy: str | None = None
    """trained policy directory (train_policy.py --output_dir) compared with its base model"""
    checkpoints: tuple[str, ...] = ()
    """policy directories (or quoted globs) for the gold-vs-KL plot, all evaluated on the same queries; points are
    grouped into one line per training run (the output_dir in their args.json) and labelled by directory name"""
    base_model: str | None = None
    """the base (reference) model that KL and the base scores are measured against: hub id or local directory; None:
    the --base_model of the policy's training run (its args.json), gpt2 for a policy without args.json. Another model
    than the run's is refused unless --allow_base_model_mismatch"""
    allow_base_model_mismatch: bool = False
    """compare the policy with a --base_model other than the one its training run started from (its args.json): the
    KL is then to that model, not the policy's reference policy"""
    reward_model: str = "models/reward"
    """the proxy score, as train_policy.py's --rewards.trained_model names it (default: the run's): a reward-model
    DIR (train_reward.py --output_dir; also reward_model:DIR), vader, classifier:NAME_OR_DIR[#LABEL] or
    python:FILE.py:FUNCTION; scored on the truncated response with the task's filter penalty, and with the run's
    normalization gain and bias when the run normalized this reward (args.json rewards.normalization)"""
    gold: str | None = None
    """gold judge, never trained on: reward_model:DIR | classifier:NAME_OR_DIR[#LABEL] | vader (label_generation's
    syntax); None: no gold score"""
    num_queries: int = 256
    """evaluation queries, each from another text of the query dataset; each policy samples one response per query. A
    dataset whose texts give fewer distinct queries stops the run with one line (its stream would repeat them)"""
    batch_size: int = 64
    """queries per sampling batch"""
    seed: int = 1
    """sampler seed; every policy samples with a fresh generator seeded with it (paired, common random numbers)"""
    data_seed: int = 0
    """seed of the query order (the training run's, so that --skip_queries counts the queries it consumed)"""
    skip_queries: int | None = None
    """start at this query of the stream; None: after the queries the training run consumed when the dataset and
    data_seed are the run's, else 0"""
    split: str = "train"
    """split of a named query dataset (books, tldr, cnndm); its test texts are held out from training"""
    examples: int = 8
    """side-by-side example texts in results.json and results.md"""
    output_dir: str | None = None
    """directory for results.json, results.md and gold_vs_kl.png; None: POLICY/eval (or eval/ without --policy)"""
    device: str | None = None
    """torch device; None: cuda when available, else cpu"""
    tf32: bool = False
    """run float32 matmuls on TF32 tensor cores (NVIDIA Ampere or newer: A100, H100): GEMMs ~5-7x faster, with
    relative errors up to ~1e-3 (docs/gpu.md); off: full float32, as OAI trained"""
    deterministic: bool = False
    """use torch's deterministic algorithms (CUBLAS_WORKSPACE_CONFIG=:4096:8, no cuDNN benchmarking): the same samples
    and scores from the same seed on the same GPU model and software; an operator without a deterministic kernel
    stops the run; CPU runs are deterministic anyway"""
    dry_run: bool = False
    """print the settings, check that every directory exists, and exit"""
    task_id: tyro.conf.Suppress[str] = "sentiment"
    """name of the --task preset these settings started from (recorded in results.json)"""
    task: TaskHParams = field(default_factory=lambda: dataclasses.replace(TASKS["sentiment"]))
    """query data, lengths, truncation, filter penalty and sampling temperature, as in training"""


def oai_presets() -> dict[str, Args]:
    """One `Args` per OAI task (launch.py's task settings), for policies without an args.json."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L8-L47
    return {name: Args(task_id=name, task=dataclasses.replace(task)) for name, task in TASKS.items()}


# ---------------------------------------------------------------- the training run's settings


def read_run_args(policy_dir: str | None) -> dict | None:
    """The args.json that train_policy.py saved beside a policy, or None."""
    path = os.path.join(policy_dir, "args.json") if policy_dir else ""
    if policy_dir and saved_kind(policy_dir) == "reward model":
        raise ValueError(
            f"--policy '{policy_dir}' holds a reward model written by train_reward.py, not a policy; pass the "
            f"--output_dir of train_policy.py as --policy (or --checkpoints), and this directory as --reward_model."
        )
    if policy_dir and (run_dir := training_state_run(policy_dir)) is not None:
        raise ValueError(
            f"--policy '{policy_dir}' is a training-state checkpoint (what --resume continues from), not a saved "
            f"policy; pass the run's --output_dir '{run_dir}' (the policy of its last save), or a snapshot that "
            "train_policy.py --save_checkpoints keeps (OUTPUT_DIR/checkpoints/update{N}), as --policy or --checkpoints."
        )
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def training_state_run(directory: str) -> str | None:
    """The run directory of a training-state checkpoint (OUTPUT_DIR/training_state/step{N}, or training_state itself)
    given where a policy is expected; None for any other directory."""
    path = os.path.normpath(directory)
    is_model = os.path.isfile(os.path.join(path, "config.json"))
    if os.path.isfile(os.path.join(path, checkpoint.META_FILE)) and not is_model:
        return os.path.dirname(os.path.dirname(path)) or "."
    if os.path.basename(path) == checkpoint.STATE_DIR and checkpoint.list_checkpoints(os.path.dirname(path)):
        return os.path.dirname(path) or "."
    return None


def defaults_from_run(run: dict) -> Args:
    """Args whose task, models, gold judge and data_seed are those of a training run's args.json."""
    task_fields = {f.name for f in dataclasses.fields(TaskHParams)}
    return Args(
        base_model=run["base_model"],
        reward_model=run["rewards"]["trained_model"],
        gold=run["rewards"].get("gold_model"),
        data_seed=run["data_seed"],
        task_id=run.get("task_id", "sentiment"),
        task=TaskHParams(**{k: v for k, v in run["task"].items() if k in task_fields}),
    )


def consumed_queries(run: dict) -> int:
    """Queries a training run drew from its stream: nupdates * ppo.batch_size (spec P15)."""
    batch = run["ppo"]["batch_size"]
    return sizes.ceil_div(run["ppo"]["total_episodes"], batch) * batch


def first_policy_dir(argv: list[str]) -> str | None:
    """The value of --policy, else the first directory given to --checkpoints (globs expanded), in raw argv."""
    for flag in ("--policy", "--checkpoints"):
        for i, arg in enumerate(argv):
            value = arg.split("=", 1)[1] if arg.startswith(f"{flag}=") else None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            if value:
                return (sorted(glob.glob(value)) or [value])[0]
    return None


def natural_key(path: str) -> list:
    """Sort key that orders numbers inside names by value: update8 before update16."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def expand_checkpoints(patterns: tuple[str, ...]) -> list[str]:
    """Directories named by --checkpoints, globs expanded in natural order; FileNotFoundError when one matches none."""
    dirs = []
    for pattern in patterns:
        matches = sorted((os.path.normpath(p) for p in glob.glob(pattern) if os.path.isdir(p)), key=natural_key)
        if not matches:
            raise FileNotFoundError(f"--checkpoints '{pattern}' matches no directory; pass policy directories.")
        dirs += matches
    return list(dict.fromkeys(dirs))


# ---------------------------------------------------------------- main


def main(args: Args) -> dict:
    """Evaluate; returns the report written to results.json."""
    cli.quiet_transformers()
    console = cli.make_console()
    checkpoints = expand_checkpoints(args.checkpoints)
    if args.policy is not None:  # one spelling per directory: a checkpoint may name the policy too
        args = dataclasses.replace(args, policy=os.path.normpath(args.policy))
    if args.policy is None and not checkpoints:
        raise ValueError("nothing to evaluate: pass --policy DIR (base vs trained) and/or --checkpoints DIR...")
    if args.num_queries < 2 or args.batch_size < 1:
        raise ValueError(f"--num_queries must be >= 2 and --batch_size >= 1, got {args.num_queries}, {args.batch_size}")
    output_dir = args.output_dir or (os.path.join(args.policy, "eval") if args.policy else "eval")
    validation.check_writable_dir(output_dir, "--output_dir")  # before the evaluation, not after it
    runs = {d: read_run_args(d) for d in [args.policy, *checkpoints] if d is not None}
    known_runs = [r for r in runs.values() if r is not None]
    args = dataclasses.replace(args, base_model=args.base_model or next(iter(known_runs), {}).get("base_model", "gpt2"))
    if mismatch := check_base_model(args.base_model, runs, args.allow_base_model_mismatch):
        console.print(f"warning: --allow_base_model_mismatch: {mismatch}", style="bold yellow", markup=False)
    skip = query_offset(args, known_runs)
    normalization = run_normalization(args.reward_model, runs)
    tf32 = devices.use_tf32(args.tf32)
    devices.use_deterministic(args.deterministic)
    cli.print_table(
        console,
        "evaluation (evaluate.py)",
        {
            "task": args.task_id,
            "policy": args.policy or "-",
            "checkpoints": ", ".join(checkpoints) or "-",
            "base model": args.base_model,
            "reward": args.reward_model,
            "reward normalization": describe_normalization(normalization) if normalization else "-",
            "gold judge": args.gold or "-",
            "queries": f"{args.num_queries} of {args.task.query_dataset} ({args.split}), from query {skip}",
            "TF32": tf32,
            "deterministic": devices.describe_deterministic(),
            "output dir": output_dir,
        },
    )
    if args.policy is not None and not os.path.isdir(args.policy):
        raise FileNotFoundError(f"--policy directory '{args.policy}' does not exist; pass the --output_dir of a run")
    check_reward_input(args.reward_model, runs)
    if args.dry_run:
        with cli.unchecked_when_offline(console.print, "the context lengths"):
            check_context(args, load_tokenizer(args.base_model), checkpoints)
        return {}

    # 1. models and judges, all loaded before anything is written
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = load_tokenizer(args.base_model)
    args = dataclasses.replace(args, task=resolve_truncation(args.task, tokenizer))  # the truncation token's id
    check_context(args, tokenizer, checkpoints)
    pad_id = tokenizer.pad_token_id
    # the held-out queries, the same for every policy, drawn (and checked) before any model is loaded
    texts = load_texts(args.task.query_dataset, args.split)
    queries, wrapped, conversation_of, distinct = heldout_queries(
        texts, tokenizer, args.task, args.data_seed, skip, args.num_queries
    )
    check_distinct_queries(args, len(texts), distinct)
    reward = load_reward(args.reward_model, tokenizer, pad_id, device, flag="--reward_model")
    if reward.metadata is not None:  # a reward-model directory, not a programmatic reward
        check_same_tokenizer(
            reward.metadata,
            tokenizer,
            f"the reward model '{args.reward_model}'",
            f"the base model uses '{args.base_model}'",
        )
    if normalization is not None:  # the gain and bias the run trained with (spec RS1)
        reward.gain, reward.bias = normalization["gain"], normalization["bias"]
    judges = {GOLD: load_labeler(args.gold, tokenizer, pad_id, device, flag="--gold")} if args.gold else {}
    if any(judge.interactive for judge in judges.values()):
        raise ValueError("--gold human is interactive; pass reward_model:DIR, classifier:NAME_OR_DIR[#LABEL] or vader")
    # a judge of another thing than the run's task (vader on a descriptiveness policy): said, and in the report
    warnings = [
        warning
        for measures, name, flag in (
            (reward.measures, args.reward_model, "--reward_model"),
            *((judge.measures, args.gold, "--gold") for judge in judges.values()),
        )
        if (warning := judge_task_mismatch(measures, name, args.task_id, flag))
    ]
    for warning in warnings:
        console.print(f"warning: {warning}", style="bold yellow", markup=False)
    base = PolicyWithValueHead(load_causal_lm(args.base_model)).to(device).eval().requires_grad_(False)

    # 2. the held-out queries' chats for the scorers; whether a training run drew them
    attach_conversations(conversation_of, reward, *judges.values())  # chats for a reward model with its own template
    unseen = held_out(args, known_runs, skip, wrapped)
    if unseen is False:
        console.print(
            f"[bold yellow]warning:[/] these queries are not held out: a training run drew them too "
            f"({args.task.query_dataset}, {len(texts)} texts repeated in every pass of the stream, data_seed "
            f"{args.data_seed}, from query {skip}). Pass --skip_queries beyond the run's queries, another "
            "--task.query_dataset, or --split test."
        )

    def run(policy: PolicyWithValueHead):
        """Episodes of one policy on the queries, from a fresh generator with the evaluation seed."""
        generator = torch.Generator(device=device).manual_seed(args.seed)
        return sample_and_score(policy, base, queries, args.task, tokenizer, reward, judges, generator, args.batch_size)

    # 3. base vs trained; every checkpoint for the curve
    base_episodes = run(base)
    report = {
        "policy": args.policy,
        "base_model": args.base_model,
        "reward_model": args.reward_model,
        "reward_normalization": normalization,
        "gold": args.gold,
        "seed": args.seed,
        "task_id": args.task_id,
        "task": dataclasses.asdict(args.task),
        "warnings": warnings,
        "queries": {
            "dataset": args.task.query_dataset,
            "split": args.split,
            "data_seed": args.data_seed,
            "skip": skip,
            "num": args.num_queries,
            "held_out": unseen,
        },
    }
    episodes = {}
    if args.policy is not None:
        episodes[args.policy] = run(load_policy(args.policy, "--policy", device))
        report.update(summarize(base_episodes, episodes[args.policy]))
        report["examples"] = examples(tokenizer, queries, base_episodes, episodes[args.policy], args.examples)
    if checkpoints:
        # the curve: the base model (KL 0), every checkpoint, and the policy itself (evaluated once)
        report["curve"] = [curve_point(BASE_RUN, policy_label(args.base_model), base_episodes)]
        for directory in dict.fromkeys([*checkpoints, *([args.policy] if args.policy else [])]):
            if directory not in episodes:
                episodes[directory] = run(load_policy(directory, "--checkpoints", device))
            name = FINAL_POLICY if directory == args.policy else policy_label(directory)
            report["curve"].append(curve_point(run_label(directory, runs[directory]), name, episodes[directory]))

    # 4. results.json, results.md, gold_vs_kl.png
    files.write_json_atomic(os.path.join(output_dir, "results.json"), report)
    write_text_atomic(os.path.join(output_dir, "results.md"), markdown(report))
    written = [os.path.join(output_dir, name) for name in ("results.json", "results.md")]
    print_report(console, report)
    if checkpoints:
        plot_path = os.path.join(output_dir, "gold_vs_kl.png")
        title = f"scores vs sqrt(KL to {policy_label(args.base_model)}), {args.num_queries} queries, gold: {args.gold}"
        plot_gold_vs_kl(report["curve"], plot_path, title, score_title(report))
        written.append(plot_path)
    console.print("wrote " + ", ".join(written))
    return report


def check_distinct_queries(args: Args, num_texts: int, distinct: int) -> None:
    """ValueError when the --num_queries queries come from fewer distinct texts: the stream repeats its texts, so the
    report would count a text sampled k times as k independent queries (n and the standard errors overstated)."""
    if distinct >= args.num_queries:
        return
    gives = f"its {num_texts} texts give {distinct} distinct queries"
    if distinct == num_texts:
        gives = f"it holds {num_texts} texts"
    raise ValueError(
        f"--num_queries {args.num_queries} is more queries than --task.query_dataset '{args.task.query_dataset}' "
        f"({args.split}) has: {gives}, so the stream would repeat each about {args.num_queries / distinct:.1f} "
        "times and the report would count every repeat as another query (its standard errors too small); pass "
        f"--num_queries {distinct} or fewer, or a query dataset with more texts."
    )


def run_normalization(reward: str, runs: dict[str, dict | None]) -> dict | None:
    """The normalization (args.json rewards.normalization: gain, bias, mean, std, samples) of the first run trained
    against `reward`, with the args.json it came from; None when that run used raw scores or no run trained on it."""
    for directory, run in runs.items():
        if run is not None and run["rewards"]["trained_model"] == reward:
            saved = run["rewards"].get("normalization")
            return {**saved, "args_json": os.path.join(directory, "args.json")} if saved else None
    return None


def check_base_model(base_model: str, runs: dict[str, dict | None], allow: bool) -> str | None:
    """ValueError when --base_model is a reward model, or another model than a policy's training run started from
    (its args.json) unless `allow`; -> the mismatch, or None when the base models agree."""
    if validation.is_reward_model(base_model):
        raise ValueError(
            f"--base_model '{base_model}' is a reward model, not the language model a policy starts from; pass the "
            "policy's base model (its args.json records it; drop --base_model to use it), and a reward model as "
            "--reward_model or --gold reward_model:DIR."
        )
    others = {d: run["base_model"] for d, run in runs.items() if run and not same_model(base_model, run["base_model"])}
    if not others:
        return None
    listed = ", ".join(f"'{d}' started from '{base}'" for d, base in others.items())
    mismatch = (
        f"--base_model '{base_model}' is not the base model of the training run (its args.json): {listed}; the KL and "
        "the base scores would be measured against another model than the policy's reference policy"
    )
    if not allow:
        raise ValueError(
            f"{mismatch}. Drop --base_model (the default is the run's), or pass --allow_base_model_mismatch to compare "
            "with it anyway."
        )
    return mismatch


def check_context(args: Args, tokenizer, checkpoints: list[str]) -> None:
    """ValueError in one line when the task's tokens exceed the context of the base model, a policy, the reward model
    or a reward-model gold judge (`validation.check_evaluate_context`)."""
    policies = [("--policy", args.policy)] if args.policy else []
    policies += [("--checkpoints", directory) for directory in checkpoints]
    validation.check_evaluate_context(args.task, tokenizer, args.base_model, policies, args.reward_model, args.gold)


def same_model(a: str, b: str) -> bool:
    """Whether two model names (hub ids or local directories) name the same model: equal, or the same directory."""
    return a == b or (validation.local_path(a) is not None and validation.local_path(a) == validation.local_path(b))


def check_reward_input(spec: str, runs: dict[str, dict | None]) -> None:
    """One line when --reward_model is malformed or names a local file or directory that does not exist."""
    if spec.startswith("python:"):
        python_file_and_function(spec, "--reward_model")
    path = reward_input_path(spec)
    if path is None or spec.startswith(("classifier:", "sequence_classifier:")) or os.path.exists(path):
        return  # vader; a classifier may be a hub name (its loader names a missing one)
    trained = [directory for directory, run in runs.items() if run and run["rewards"]["trained_model"] == spec]
    origin = f" (the --rewards.trained_model of {os.path.join(trained[0], 'args.json')})" if trained else ""
    what = "reward file" if spec.startswith("python:") else "reward-model directory"
    raise FileNotFoundError(
        f"--reward_model '{spec}'{origin}: the {what} '{path}' does not exist in the working directory {os.getcwd()}; "
        "run evaluate.py where the training ran (relative paths are read from there) or pass --reward_model DIR | "
        "vader | classifier:NAME_OR_DIR[#LABEL] | python:FILE.py:FUNCTION with an existing path."
    )


def stream_runs(args: Args, runs: list[dict]) -> list[dict]:
    """The training runs that drew queries from the texts evaluated here (same dataset; hub datasets: train split)."""
    if args.task.query_dataset in OAI_TEXT_SOURCES and args.split != "train":
        return []
    return [r for r in runs if r["task"]["query_dataset"] == args.task.query_dataset]


def query_offset(args: Args, runs: list[dict]) -> int:
    """--skip_queries, or by default the most queries any of the runs drew from this very stream (dataset and seed)."""
    if args.skip_queries is not None:
        return args.skip_queries
    same = [consumed_queries(r) for r in stream_runs(args, runs) if r["data_seed"] == args.data_seed]
    return max(same, default=0)


def held_out(args: Args, runs: list[dict], skip: int, wrapped: bool) -> bool | None:
    """Whether no run trained on these queries; None when no args.json tells what the runs trained on."""
    if not runs:
        return None
    for run in stream_runs(args, runs):
        # another data_seed is another order of the same texts; a wrapped stream repeats the training queries
        if run["data_seed"] != args.data_seed or skip < consumed_queries(run) or wrapped:
            return False
    return True


def load_policy(directory: str, flag: str, device: torch.device) -> PolicyWithValueHead:
    """A policy saved by train_policy.py, on `device`, frozen."""
    return PolicyWithValueHead.load(directory, flag).to(device).eval().requires_grad_(False)


def run_label(directory: str, run: dict | None) -> str:
    """Name of the training run a checkpoint belongs to: its args.json output_dir, else its parent directory."""
    return os.path.basename(os.path.normpath(run["output_dir"] if run else os.path.dirname(directory)))


def policy_label(directory: str) -> str:
    """Label of one checkpoint: its directory name."""
    return os.path.basename(os.path.normpath(directory))


def parse(argv: list[str] | None = None) -> Args:
    """Args from the command line, starting from the policy's training settings (or the `--task` preset)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    presets, default = oai_presets(), "sentiment"
    run = read_run_args(first_policy_dir(argv))
    if run is not None:
        presets[RUN_PRESET], default = defaults_from_run(run), RUN_PRESET
    return cli.parse_args(Args, presets, default, __doc__, argv)[1]


if __name__ == "__main__":
    cli.run(main, parse)
