"""Reward model training from best-of-4 human labels, as in openai/lm-human-preferences train_reward.py.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py

Run:   accelerate launch --num_processes 8 train_reward.py --task sentiment --output_dir models/sentiment_reward
Steps: normalize the untrained reward to N(0, 1) on samples of the pretrained policy, train one epoch of best-of-4
cross-entropy on the labels, normalize again, save. Batch sizes are global (summed over processes), as in OAI.
"""

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from accelerate.utils import broadcast
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from lm_human_preference_details import cli
from lm_human_preference_details.core import (
    Tracker,
    allreduce_gradients,
    broadcast_parameters,
    ceil_div,
    exact_div,
    make_accelerator,
    run_name,
    save_args,
    set_seed,
)
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.labels import Labels, best_of_n_loss, load_labels
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    load_causal_lm,
    sample,
    score_label_rows,
)
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.tasks import TASKS, TaskHParams, encode_context_affixes, format_contexts
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint


# ---------------------------------------------------------------- hyperparameters
@dataclass
class LabelHParams:
    num_train: int = 4992
    """labels used for training: the first `num_train` rows of the label file; the rest are held out for eval/ (OAI
    launch.py#L71, it had no held-out set)"""
    num_samples: int = 4
    """responses per label row; the label type is best-of-`num_samples` (OAI launch.py#L70: best_of_4)"""


@dataclass
class Args:
    exp_name: str = "train_reward"
    """name of this experiment (run name prefix)"""
    seed: int = 1
    """run seed; process r seeds NumPy and torch with seed + r*100003 (OAI utils/core.py#L108-L113)"""
    data_seed: int = 0
    """seed of the one global shuffle of the query texts, identical on every process (OAI datasets.py#L33)"""
    base_model: str = "gpt2"
    """pretrained model (hub id or local directory) for the reward trunk and for the normalization samples"""
    label_dataset: str = "sentiment/offline_5k.json"
    """label file: a local JSON path in OAI's schema, or a file of the hub dataset vwxyzjn/lm-human-preferences"""
    task: TaskHParams = field(default_factory=lambda: dataclasses.replace(TASKS["sentiment"]))
    """query construction, response length and sampling temperature (OAI lm_tasks.py)"""
    labels: LabelHParams = field(default_factory=LabelHParams)
    """which labels to train on"""
    batch_size: int = 32
    """labels per optimizer step, summed over all processes (OAI launch.py#L73)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per process and step; gives the same update with less memory"""
    lr: float = 5e-5
    """Adam learning rate, annealed linearly to lr*batch_size/num_train at the last step (OAI train_reward.py#L249)"""
    rollout_batch_size: int = 512
    """queries per normalization batch, summed over all processes (OAI launch.py#L74)"""
    normalize_samples: int = 256
    """normalization draws ceil(normalize_samples / rollout_batch_size) whole rollout batches (OAI launch.py#L75)"""
    normalize_before: bool = True
    """set gain/bias so the untrained reward is N(0, 1) on samples of the pretrained policy (OAI launch.py#L76)"""
    normalize_after: bool = True
    """set gain/bias again after training (OAI launch.py#L77)"""
    use_tensorflow_adam: bool = True
    """TF1-style Adam (eps after bias correction, as OAI); off: torch.optim.Adam with the same eps"""
    eval_interval: int = 0
    """evaluate held-out accuracy every this many steps (0: only before and after training)"""
    output_dir: str = "models/reward"
    """where the reward model, tokenizer, TensorBoard events and wandb files are written"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to log without network)"""
    wandb_project_name: str = "lm_human_preference_details"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team or user)"""
    dry_run: bool = False
    """print the derived per-process sizes and exit"""
    task_id: tyro.conf.Suppress[str] = "sentiment"
    """name of the --task preset these settings started from (recorded in the run config)"""


def books_preset(label_file: str) -> Args:
    """OAI's sentiment/descriptiveness reward training (launch.py#L49-L80)."""
    task_id = label_file.split("/")[0]
    return Args(label_dataset=label_file, task=dataclasses.replace(TASKS[task_id]), task_id=task_id)


def summarization_preset(task: str) -> Args:
    """OAI's tldr/cnndm reward training (launch.py#L82-L111): 46k online labels, batch 16, lr 2.5e-5, rollouts 128."""
    return Args(
        task_id=task,
        label_dataset=f"{task}/online_45k.json",
        task=dataclasses.replace(TASKS[task]),
        labels=LabelHParams(num_train=46_000),
        batch_size=16,
        lr=2.5e-5,
        rollout_batch_size=128,
    )


def oai_presets() -> dict[str, Args]:
    """OAI's launch.py reward experiments, one `Args` per `--task` name."""
    return {
        "sentiment": books_preset("sentiment/offline_5k.json"),
        "descriptiveness": books_preset("descriptiveness/offline_5k.json"),
        "tldr": summarization_preset("tldr"),
        "cnndm": summarization_preset("cnndm"),
    }


# ---------------------------------------------------------------- algorithm helpers
@torch.no_grad()
def normalize_rewards(args, accelerator, reward_model, ref_policy, query_stream, affixes, pad_id, generator) -> dict:
    """Set gain/bias so rewards of the pretrained policy's samples have mean 0 and std 1 over all processes."""
    # reset, sample ceil(normalize_samples/rollout_batch_size) global rollout batches from the pretrained policy at
    # the task temperature (raw, untruncated), score raw query ⊕ response, population std of the global sample
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L149-L219
    reward_model.gain.fill_(1.0)
    reward_model.bias.fill_(0.0)
    local_rollout_batch_size = exact_div(args.rollout_batch_size, accelerator.num_processes, "rollout_batch_size")
    scores = []
    for _ in range(ceil_div(args.normalize_samples, args.rollout_batch_size)):
        queries = query_stream.next_batch(local_rollout_batch_size).to(accelerator.device)
        contexts = format_contexts(queries, *affixes)
        responses, _, _ = sample(
            ref_policy, contexts, args.task.response_length, args.task.temperature, pad_id, generator
        )
        scores.append(reward_model(torch.cat([queries, responses], dim=1), pad_id))
    scores = torch.cat(scores)
    moments = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), reduction="mean")
    mean, std = moments[0], (moments[1] - moments[0].square()).clamp_min(0).sqrt()  # TF-PARITY: population std
    # target N(0, 1) for best-of-N labels: gain = 1/std, bias = -gain*mean
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L73-L89
    if not torch.isfinite(std) or std <= 0:
        raise ValueError(
            f"reward normalization failed: sample std is {std.item()} over "
            f"{accelerator.num_processes * len(scores)} samples; check the reward model and --normalize_samples"
        )
    reward_model.gain.fill_(1.0 / std)
    reward_model.bias.fill_(-mean / std)
    return {
        "mean": mean.item(),
        "std": std.item(),
        "gain": reward_model.gain.item(),
        "bias": reward_model.bias.item(),
        "samples": accelerator.num_processes * len(scores),
    }


@torch.no_grad()
def evaluate_labels(accelerator, reward_model, labels: Labels, pad_id: int, micro_batch_size: int) -> dict:
    """Loss and accuracy of the reward model on label rows (each process scores a rank-strided share)."""
    rows = torch.arange(accelerator.process_index, len(labels), accelerator.num_processes)
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, rows
    for chunk in rows.split(micro_batch_size):
        rewards = score_label_rows(
            reward_model,
            labels.query[chunk].to(accelerator.device),
            labels.samples[chunk].to(accelerator.device),
            pad_id,
        )
        best = labels.best[chunk].to(accelerator.device)
        totals += torch.stack(
            [
                F.cross_entropy(rewards, best, reduction="sum"),
                (rewards.argmax(1) == best).sum().float(),
                torch.tensor(float(len(chunk)), device=totals.device),
            ]
        )
    totals = accelerator.reduce(totals, reduction="sum")
    return {
        "loss": (totals[0] / totals[2]).item(),
        "accuracy": (totals[1] / totals[2]).item(),
        "rows": int(totals[2].item()),
    }


# ---------------------------------------------------------------- main
def main(args: Args) -> dict:
    """Train and save a reward model; returns the final figures, this process's label indices and the model."""
    # 0. processes, derived sizes (spec D1), seeding, tracking
    cli.quiet_transformers()
    accelerator = make_accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    local_batch_size = exact_div(args.batch_size, world, "batch_size (labels per step) over processes")
    accum = args.gradient_accumulation_steps
    micro_batch_size = exact_div(local_batch_size, accum, "per-process batch over gradient_accumulation_steps")
    exact_div(args.labels.num_train, args.batch_size, "labels.num_train over batch_size")  # OAI train_reward.py#L56-L58
    exact_div(args.rollout_batch_size, world, "rollout_batch_size over processes")
    num_steps = args.labels.num_train // args.batch_size
    console = cli.make_console()
    if accelerator.is_main_process:
        normalize_batches = ceil_div(args.normalize_samples, args.rollout_batch_size)
        cli.print_table(
            console,
            "reward training (train_reward.py)",
            {
                "task": args.task_id,
                "processes": world,
                "labels per step": f"{args.batch_size} ({local_batch_size} per process)",
                "micro-batch": f"{micro_batch_size} x {accum}",
                "steps": f"{num_steps} (one epoch over {args.labels.num_train} labels)",
                "normalization samples": f"{normalize_batches} x {args.rollout_batch_size}",
                "label file": args.label_dataset,
                "output dir": args.output_dir,
            },
        )
    if args.dry_run:
        return {}
    # per-process seeds; rank 0's NumPy RNG draws the label order
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    set_seed(args.seed + rank * 100003)
    generator = torch.Generator(accelerator.device).manual_seed(args.seed + rank * 100003)

    # 1. tokenizer, labels (validated before any model is loaded), models, optimizer, query stream
    tokenizer = load_tokenizer(args.base_model)
    pad_id = tokenizer.pad_token_id
    labels = load_labels(
        args.label_dataset,
        args.task.query_length,
        args.task.response_length,
        pad_id,
        args.labels.num_train,
        args.labels.num_samples,
    )
    train_labels, heldout_labels = labels[: args.labels.num_train], labels[args.labels.num_train :]
    reward_model = RewardModel.from_base(args.base_model).to(accelerator.device)
    broadcast_parameters(reward_model, accelerator)  # rank 0's random head everywhere (OAI train_reward.py#L316-L318)
    ref_policy = PolicyWithValueHead(load_causal_lm(args.base_model)).to(accelerator.device).requires_grad_(False)
    # gain and bias are trained too (their effect is reset by normalize_after)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L69-L71
    params = list(reward_model.parameters())
    optimizer = make_optimizer(params, args.lr, args.use_tensorflow_adam)
    query_stream = QueryStream(load_texts(args.task.query_dataset), tokenizer, args.task, rank, world, args.data_seed)
    affixes = encode_context_affixes(tokenizer, args.task)
    name = run_name(accelerator, args.task_id, args.exp_name, args.seed)
    tracker = Tracker(
        args.output_dir,
        args.track,
        args.wandb_project_name,
        args.wandb_entity,
        name,
        {**dataclasses.asdict(args), "world_size": world},
        accelerator.is_main_process,
    )

    def normalize(when: str, step: int) -> dict:
        """Normalize the reward on fresh samples; log and print the statistics measured before the change."""
        result = normalize_rewards(
            args, accelerator, reward_model, ref_policy, query_stream, affixes, pad_id, generator
        )
        tracker.log({f"normalize_{when}/{k}": v for k, v in result.items()}, step)
        accelerator.print(f"normalize {when}: mean {cli.number(result['mean'], 4)} +- {cli.number(result['std'], 4)}")
        return result

    def log_eval(step: int) -> dict | None:
        """Held-out loss and accuracy, logged under eval/ (None when every label row is trained on)."""
        if len(heldout_labels) == 0:
            return None
        rows = micro_batch_size * args.labels.num_samples
        result = evaluate_labels(accelerator, reward_model, heldout_labels, pad_id, rows)
        tracker.log({"eval/loss": result["loss"], "eval/accuracy": result["accuracy"]}, step)
        return result

    # 2. normalize before training
    norms = {}
    if args.normalize_before:
        norms["before"] = normalize("before", 0)
    eval_before = log_eval(0)

    # 3. one epoch over the labels: rank 0's permutation, rank-strided slices, lr annealed linearly
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L221-L254
    permutation = torch.from_numpy(np.random.permutation(args.labels.num_train)).to(accelerator.device)
    permutation = broadcast(permutation, from_process=0).cpu()
    seen = []
    columns = (
        TextColumn("reward"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
    )
    progress = Progress(*columns, disable=not accelerator.is_main_process, console=console)
    with progress:
        bar = progress.add_task("train", total=num_steps, stats="")
        for step, start in enumerate(range(0, args.labels.num_train, args.batch_size)):
            lr = args.lr * (1 - start / args.labels.num_train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            local_indices = permutation[start : start + args.batch_size][rank::world]
            seen.append(local_indices)
            stats = torch.zeros(2, device=accelerator.device)  # loss, accuracy
            for micro_indices in local_indices.split(micro_batch_size):
                query = train_labels.query[micro_indices].to(accelerator.device)
                samples = train_labels.samples[micro_indices].to(accelerator.device)
                rewards = score_label_rows(reward_model, query, samples, pad_id)  # (b, N)
                best = train_labels.best[micro_indices].to(accelerator.device)
                loss = best_of_n_loss(rewards, best)
                (loss / accum).backward()
                stats += torch.stack([loss.detach(), (rewards.argmax(1) == best).float().mean()]) / accum
            # gradients averaged over processes, then one Adam step (spec O4)
            allreduce_gradients(params, accelerator)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value, accuracy = accelerator.reduce(stats, reduction="mean").tolist()
            if not math.isfinite(loss_value):
                raise ValueError(f"reward training diverged: loss is {loss_value} at step {step}; try a smaller --lr")
            # OAI's stats for best-of-N: loss and error are the same cross-entropy
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L124-L146
            tracker.log(
                {
                    "train_reward/minibatch/loss": loss_value,
                    "train_reward/minibatch/error": loss_value,
                    "debug/accuracy": accuracy,
                    "debug/lr": lr,
                },
                step,
            )
            if args.eval_interval and (step + 1) % args.eval_interval == 0:
                log_eval(step + 1)
            progress.update(bar, advance=1, stats=f"loss {cli.number(loss_value)} acc {accuracy:.2f}")
    eval_after = log_eval(num_steps)

    # 4. normalize after training
    if args.normalize_after:
        norms["after"] = normalize("after", num_steps)

    # 5. save
    if accelerator.is_main_process:
        metadata = {
            "base_model": args.base_model,
            "tokenizer": args.base_model,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
            "pad_token_id": pad_id,
            "task": dataclasses.asdict(args.task),
            "label_dataset": args.label_dataset,
            "num_train": args.labels.num_train,
            "eval_before": eval_before,
            "eval_after": eval_after,
        }
        reward_model.save(args.output_dir, metadata)
        tokenizer.save_pretrained(args.output_dir)
        save_args(args, args.output_dir)
        cli.print_table(
            console,
            "reward training done",
            {
                "held-out rows": len(heldout_labels),
                "held-out accuracy": f"{eval_before['accuracy']:.3f} -> {eval_after['accuracy']:.3f}"
                if eval_after
                else "-",
                "gain, bias": f"{cli.number(reward_model.gain.item(), 4)}, {cli.number(reward_model.bias.item(), 4)}",
                "reward model, tokenizer": args.output_dir,
                "TensorBoard": f"{args.output_dir}/tb",
            },
        )
    accelerator.wait_for_everyone()
    tracker.close()
    return {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "normalization": norms,
        "label_indices": torch.cat(seen).tolist(),
        "gain": reward_model.gain.item(),
        "bias": reward_model.bias.item(),
        "model": reward_model,
    }


def parse(argv: list[str] | None = None) -> Args:
    """Args from the command line, starting from the `--task` preset (default sentiment)."""
    return cli.parse_args(Args, oai_presets(), "sentiment", __doc__, argv)[1]


if __name__ == "__main__":
    cli.run(main, parse)
