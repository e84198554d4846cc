"""Reward model training from human labels (best-of-4 by default), as in openai/lm-human-preferences train_reward.py.
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py

Run:   accelerate launch --num_processes 8 train_reward.py --task sentiment --output_dir models/sentiment_reward
Steps: normalize the untrained reward to N(0, 1) on samples of the pretrained policy, train one epoch of best-of-4
cross-entropy on the labels (or the MSE of --labels.type scalar_rating / scalar_compare), normalize again, save.
Batch sizes are global (summed over processes), as in OAI.

`spec X` in the comments is docs/implementation-details.md#x, the section on OAI's detail X: spec R4 is
docs/implementation-details.md#r4 (a numbered one, spec §4.2, is that document's section 4.2).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import torch
import torch.nn.functional as F
import tyro
from accelerate.utils import broadcast

from lm_human_preference_details import (
    cli,
    devices,
    distributed,
    labels,
    presets,
    resumable,
    reward_plumbing,
    settings,
    validation,
)
from lm_human_preference_details import sizes as sizing
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.devices import to_device
from lm_human_preference_details.labels import (
    Labels,
    LabelType,
    get_label_type,
    pearson_r,
    target_scales,
)
from lm_human_preference_details.modeling import (
    PolicyWithValueHead,
    RewardModel,
    check_finite_weights,
    load_causal_lm,
    reduce_training_memory,
    sample,
    score_label_rows,
)
from lm_human_preference_details.optim import make_optimizer
from lm_human_preference_details.tasks import (
    TASKS,
    TaskHParams,
    encode_context_affixes,
    format_contexts,
    resolve_truncation,
    truncate_response,
)
from lm_human_preference_details.tokenizer import added_bos_id, load_tokenizer


# ---------------------------------------------------------------- hyperparameters
@dataclass
class LabelHParams:
    type: str = "best_of_4"
    """label type: best_of_N (pick the best of N responses), scalar_rating or scalar_compare (OAI launch.py#L70)"""
    num_train: int = 4992
    """labels used for training: the first `num_train` rows of the label file; the rest are held out for eval/ (OAI
    launch.py#L71, it had no held-out set)"""
    allow_task_mismatch: bool = False
    """train on a label file made for another --task than this run's (its .meta.json task_id, or the folder of OAI's
    label file); the reward model records this run's --task. By default a mismatch stops the run"""


@dataclass(slots=True)  # a misspelt field is an AttributeError, not a new attribute
class Args:
    seed: int = 1
    """run seed; process r seeds Python, NumPy, torch and the sampler with seed + 100003 * r (OAI
    utils/core.py#L108-L113)"""
    data_seed: int = 0
    """seed of the one global shuffle of the query texts, the same on every process (OAI shuffles with 0 whatever the
    run seed, datasets.py#L33)"""
    base_model: str = "gpt2"
    """pretrained causal LM, hub id or local directory (OAI: GPT-2 124M): the reward model's trunk and the policy that
    samples the normalization responses start from it"""
    label_dataset: str = "sentiment/offline_5k.json"
    """label file: a local JSON path in OAI's schema, or a file of the hub dataset vwxyzjn/lm-human-preferences"""
    task: TaskHParams = field(default_factory=lambda: dataclasses.replace(TASKS["sentiment"]))
    """query data, lengths, truncation and sampling temperature (OAI lm_tasks.TaskHParams)"""
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
    """normalization draws ceil(normalize_samples / rollout_batch_size) whole rollout batches; 0 skips normalization
    (OAI launch.py#L75, train_reward.py#L207-L209)"""
    debug_normalize: int = 0
    """after each normalization, score this many fresh samples and print their mean and std (should be the target);
    0: no check (OAI train_reward.py#L48, #L216-L219)"""
    normalize_before: bool = True
    """set gain/bias so the untrained reward is N(0, 1) on samples of the pretrained policy (OAI launch.py#L76)"""
    normalize_after: bool = True
    """set gain/bias again after training (OAI launch.py#L77)"""
    use_tensorflow_adam: bool = True
    """TF1 Adam as OAI (epsilon added after bias correction); off: torch.optim.Adam with the same eps 1e-5"""
    weight_decay: float = 0.0
    """with --no_use_tensorflow_adam: torch.optim.AdamW's decoupled weight decay (the successor recipe uses AdamW's
    default 0.01, eps 1e-5); 0: no decay, as OAI (the TF1 Adam refuses any other value)"""
    eval_interval: int = 0
    """evaluate held-out accuracy every this many steps (0: only before and after training)"""
    task_id: tyro.conf.Suppress[str] = "sentiment"
    """name of the --task preset these settings started from (recorded in the run config)"""
    run: Annotated[settings.RewardRunSettings, tyro.conf.arg(name="")] = field(
        default_factory=lambda: settings.RewardRunSettings("train_reward", "models/reward")
    )
    """where the run writes, how it logs, saves, resumes and speeds up (flags without a prefix: --output_dir, ...)"""


RESUME_IGNORED = (*resumable.RESUME_IGNORED, "labels.allow_task_mismatch")
"""settings that may change on --resume: they do not change what the run computes"""


# ---------------------------------------------------------------- algorithm
# in the order a run uses them: normalization (steps 2 and 4), the loss, held-out evaluation and the non-finite counts
# of a training step (step 3). The sizes are derived in sizes.py, the plumbing (label checks, tracking, checkpoints,
# saving) is in reward_plumbing.py.
@torch.no_grad()
def reward_moments(
    args, accelerator, reward_model, ref_policy, query_stream, affixes, pad_id, generator, rollout_batch: int, n: int
) -> tuple:
    """Mean and population std, over all processes, of the rewards of ceil(n / rollout_batch_size) global rollout
    batches (`rollout_batch` queries per process) of the pretrained policy's samples; -> mean, std, number of
    samples."""
    # sample at the task temperature (raw, untruncated), score raw query ⊕ response, all-reduce sums and squares
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L162-L168
    scores = []
    for _ in range(sizing.ceil_div(n, args.rollout_batch_size)):
        queries = query_stream.next_batch(rollout_batch).to(accelerator.device)
        contexts = format_contexts(queries, *affixes)
        responses, _, _ = sample(
            ref_policy, contexts, args.task.response_length, args.task.temperature, pad_id, generator
        )
        if args.task.end_at_eos:  # the successor recipe's policy is scored on responses cut at EOS (nplus N19)
            responses = truncate_response(responses, args.task.truncate_token, args.task.truncate_after, pad_id)
        scores.append(reward_model(torch.cat([queries, responses], dim=1), pad_id))
    scores = torch.cat(scores)
    moments = accelerator.reduce(torch.stack([scores.mean(), scores.square().mean()]), reduction="mean")
    mean, std = moments[0], (moments[1] - moments[0].square()).clamp_min(0).sqrt()  # TF-PARITY: population std
    return mean, std, accelerator.num_processes * len(scores)


@torch.no_grad()
def normalize_rewards(
    args,
    accelerator,
    reward_model,
    ref_policy,
    query_stream,
    affixes,
    pad_id,
    generator,
    rollout_batch: int,
    target: tuple[float, float],
) -> dict:
    """Set gain/bias so rewards of the pretrained policy's samples have the target mean and std over all processes."""
    # reset gain/bias, measure on ceil(normalize_samples/rollout_batch_size) global rollout batches, then
    # gain = target_std / std, bias = target_mean - gain * mean
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L149-L219
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L73-L89
    reward_model.gain.fill_(1.0)
    reward_model.bias.fill_(0.0)
    sampling = (args, accelerator, reward_model, ref_policy, query_stream, affixes, pad_id, generator, rollout_batch)
    with distributed.gathered(reward_model):  # --fsdp: the weights gathered once for all the scoring
        mean, std, count = reward_moments(*sampling, args.normalize_samples)
    target_mean, target_std = target
    if not torch.isfinite(std) or std <= 0:
        raise ValueError(
            f"reward normalization failed: sample std is {std.item()} over {count} samples; check the reward model "
            "and --normalize_samples"
        )
    gain = target_std / std
    reward_model.gain.fill_(gain)
    reward_model.bias.fill_(target_mean - gain * mean)
    result = {
        "mean": mean.item(),
        "std": std.item(),
        "target_mean": target_mean,
        "target_std": target_std,
        "gain": reward_model.gain.item(),
        "bias": reward_model.bias.item(),
        "samples": count,
    }
    if args.debug_normalize:
        # OAI's check: fresh samples under the new gain/bias should have the target mean and std
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L216-L219
        with distributed.gathered(reward_model):
            check_mean, check_std, _ = reward_moments(*sampling, args.debug_normalize)
        result.update(debug_mean=check_mean.item(), debug_std=check_std.item())
    return result


def normalization_target(label_type: LabelType, train_labels: Labels) -> tuple[float, float]:
    """Mean and population std of the label type's target scales over the training labels; (0, 1) when it has none."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L149-L159
    scales = target_scales(label_type, train_labels)
    if scales is None:
        return 0.0, 1.0
    var, mean = torch.var_mean(scales.double(), correction=0)  # TF-PARITY: tf.nn.moments
    return mean.item(), var.sqrt().item()


def label_row_errors(label_type: LabelType, rewards: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """(b,) error of each label row from the rewards (b, S) of its S responses: the softmax cross-entropy with the
    labeled best response as the target (best_of_N), the squared error of the reward (scalar_rating) or of r1 - r0
    (scalar_compare)."""
    # best_of_N: the S rewards of a row are the logits of a softmax over its responses (spec R5)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L44-L49
    if label_type.label_field == "best":
        return F.cross_entropy(rewards, label, reduction="none")
    # scalar_rating: squared error between score and reward; scalar_compare: between difference and r1 - r0
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L70-L77
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L95-L102
    predicted = rewards[:, 0] if label_type.label_field == "score" else rewards[:, 1] - rewards[:, 0]
    return (label - predicted) ** 2


def label_loss(label_type: LabelType, rewards: torch.Tensor, label: torch.Tensor) -> dict[str, torch.Tensor]:
    """OAI's loss of the label type, the mean of `label_row_errors`, and its statistics: loss and error (equal);
    scalar_rating adds the labels' mean and population variance and the Pearson correlation of score and reward."""
    error = label_row_errors(label_type, rewards, label).mean()
    stats = {"loss": error, "error": error}
    if label_type.label_field == "score":
        label_var, label_mean = torch.var_mean(label, correction=0)  # TF-PARITY: tf.nn.moments
        stats.update(label_mean=label_mean, label_var=label_var, corr=pearson_r(label, rewards[:, 0]))
    return stats


@torch.no_grad()
def evaluate_labels(
    accelerator, reward_model, labels: Labels, label_type: LabelType, pad_id: int, micro_batch_size: int
) -> dict:
    """Mean loss (and best-of-N accuracy) of the reward model on label rows; each process scores a rank-strided part."""
    rows = torch.arange(accelerator.process_index, len(labels), accelerator.num_processes)
    totals = torch.zeros(3, device=accelerator.device)  # loss sum, correct, rows
    # --fsdp: the weights gathered once, so that a process with fewer rows (fewer forwards) waits for no other
    with distributed.gathered(reward_model):
        for chunk in rows.split(micro_batch_size):
            rewards = score_label_rows(
                reward_model,
                labels.query[chunk].to(accelerator.device),
                labels.samples[chunk].to(accelerator.device),
                pad_id,
            )
            label = labels.label[chunk].to(accelerator.device)
            correct = (rewards.argmax(1) == label).sum().float() if label_type.label_field == "best" else 0.0
            totals += torch.stack(
                [
                    label_row_errors(label_type, rewards, label).sum(),
                    torch.as_tensor(correct, device=totals.device),
                    torch.tensor(float(len(chunk)), device=totals.device),
                ]
            )
    totals = accelerator.reduce(totals, reduction="sum")
    result = {"loss": (totals[0] / totals[2]).item(), "rows": int(totals[2].item())}
    if label_type.label_field == "best":
        result["accuracy"] = (totals[1] / totals[2]).item()
    return result


def nonfinite_stats(
    rewards: torch.Tensor, loss: torch.Tensor, gradients: torch.Tensor, params: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Device-side counts of one step's NaN/infinite rewards, loss, gradients (counted before the step) and weights."""
    return {
        "nonfinite/rewards": validation.nonfinite_count([rewards]),
        "nonfinite/loss": validation.nonfinite_count([loss]),
        "nonfinite/gradients": gradients,
        "nonfinite/weights": validation.nonfinite_tensors(params),
    }


# ---------------------------------------------------------------- main
# The plumbing calls name their module (cli., devices., distributed., labels., resumable., reward_plumbing., settings.,
# sizing., validation.): skip them to read the algorithm.
@resumable.one_run_per_output_dir
def main(args: Args) -> dict:
    """Train and save a reward model; returns the final figures, this process's label indices and the model."""
    # 0. processes, derived sizes (spec D1), printed, then checked by --dry_run; seeds; --resume
    validation.check_reward_args(args)
    label_warnings = labels.label_task_warnings(args.label_dataset, args.task_id, args.labels.allow_task_mismatch)
    cli.quiet_transformers()
    accelerator = distributed.make_accelerator(args.run.dist_timeout)
    tf32 = devices.use_tf32(args.run.tf32)
    devices.use_deterministic(args.run.deterministic)
    sizes = sizing.derive_reward_sizes(args, validation.dry_run_world(args.run, accelerator.num_processes))
    rank, world, accum = accelerator.process_index, sizes.world, args.gradient_accumulation_steps
    console = cli.make_console()
    if accelerator.is_main_process:
        reward_plumbing.print_setup(console, args, sizes, tf32, label_warnings)
    if args.run.dry_run:
        reward_plumbing.check_inputs(args, accelerator)
        return {}
    # per-process seeds; rank 0's NumPy RNG draws the label order
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L108-L113
    devices.set_seed(args.seed + rank * 100003)
    generator = torch.Generator(accelerator.device).manual_seed(args.seed + rank * 100003)
    # the truncation token's id in the base model's tokenizer, once: in args.json, the checkpoints and the reward model
    tokenizer = load_tokenizer(args.base_model)
    args = dataclasses.replace(args, task=resolve_truncation(args.task, tokenizer))
    validation.check_reward_context(args, tokenizer)  # the reward model's and the policy's context hold their tokens
    # a killed run continues from its checkpoint (--resume); a fresh one never writes into another run's output_dir
    loop = resumable.CheckpointedLoop(args, world, RESUME_IGNORED, accelerator, "step", sizes.steps)
    if loop.finished is not None:  # a finished run is a result: its summary shown, every file kept as it is
        return reward_plumbing.report_finished(console, args, loop.finished, accelerator)

    # 1. labels (validated before any model is loaded), models, optimizer, query stream
    label_type = get_label_type(args.labels.type)
    pad_id = tokenizer.pad_token_id
    label_rows = reward_plumbing.read_labels(args, tokenizer)
    train_labels, heldout_labels = label_rows[: args.labels.num_train], label_rows[args.labels.num_train :]
    # the reward model's inputs get the BOS that the tokenizer adds (Llama), recorded in its reward_model.json
    reward_model = RewardModel.from_base(args.base_model, bos_token_id=added_bos_id(tokenizer)).to(accelerator.device)
    # rank 0's random head everywhere (OAI train_reward.py#L316-L318)
    distributed.broadcast_parameters(reward_model, accelerator)
    reduce_training_memory(
        reward_model, args.run.gradient_checkpointing, args.run.bf16
    )  # the label loss's forward only
    ref_policy = PolicyWithValueHead(load_causal_lm(args.base_model)).to(accelerator.device).requires_grad_(False)
    # gain and bias are trained too (their effect is reset by normalize_after)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/rewards.py#L69-L71
    # the module the label loss's forwards run through: DDP averages its gradients over processes (spec O4), or
    # --fsdp shards it
    trained = distributed.data_parallel(reward_model, accelerator, args.run.fsdp)
    params = list(reward_model.parameters())
    optimizer = make_optimizer(params, args.lr, args.use_tensorflow_adam, args.weight_decay)
    texts = load_texts(args.task.query_dataset, args.task.query_split)
    query_stream = QueryStream(texts, tokenizer, args.task, rank, world, args.data_seed)
    affixes = encode_context_affixes(tokenizer, args.task)

    # plumbing: the tracker, the checkpoints' metadata
    tracker, meta = reward_plumbing.start_tracker(args, accelerator, loop)  # TensorBoard (and wandb)

    def normalize(when: str, step: int, target: tuple[float, float]) -> dict | None:
        """Normalize the reward on fresh samples to `target` (mean, std); log and print what was measured."""
        # OAI skips normalization altogether when normalize_samples is 0
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L207-L209
        if not args.normalize_samples:
            accelerator.print(f"normalize {when}: skipped (--normalize_samples 0)")
            return None
        sampling = (reward_model, ref_policy, query_stream, affixes, pad_id, generator, sizes.rollout_batch)
        result = normalize_rewards(args, accelerator, *sampling, target)
        tracker.log({f"normalize_{when}/{k}": v for k, v in result.items()}, step)
        reward_plumbing.print_normalization(accelerator.print, when, result, target, bool(args.debug_normalize))
        return result

    def log_eval(step: int) -> dict | None:
        """Held-out loss (and accuracy), logged under eval/ (None when every label row is trained on)."""
        if len(heldout_labels) == 0:
            return None
        result = evaluate_labels(accelerator, reward_model, heldout_labels, label_type, pad_id, sizes.micro)
        tracker.log({f"eval/{k}": v for k, v in result.items() if k != "rows"}, step)
        return result

    def save(steps: int) -> None:
        """The training state after `steps` steps, written in the background."""
        run_state = {"permutation": permutation, "normalization": norms, "eval_before": eval_before}
        saved = (reward_model, optimizer, run_state, query_stream, generator)
        reward_plumbing.save_checkpoint(args, accelerator, steps, *saved, tracker, meta, loop.saves)

    # 2. normalize before training (a resumed run takes gain, bias and what was measured from its checkpoint)
    norms = {}
    if args.normalize_before and loop.resumed is None:
        norms["before"] = normalize("before", 0, normalization_target(label_type, train_labels))
    eval_before = log_eval(0) if loop.resumed is None else loop.resumed.shared["eval_before"]

    # 3. one epoch over the labels: rank 0's permutation, rank-strided slices, lr annealed linearly
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L221-L254
    if loop.resumed is None:
        permutation = torch.from_numpy(np.random.permutation(args.labels.num_train)).to(accelerator.device)
        permutation = broadcast(permutation, from_process=0).cpu()
    else:
        permutation, norms = loop.resumed.shared["permutation"], loop.resumed.shared["normalization"]
        reward_plumbing.restore(loop.resumed, accelerator, args, reward_model, optimizer, query_stream, generator)
        if args.eval_interval and loop.first_step % args.eval_interval == 0:
            log_eval(loop.first_step)  # logged before the checkpoint, hidden by the TensorBoard purge at first_step
    seen = []
    progress = reward_plumbing.progress_bar(console, accelerator)
    # Ctrl-C or SIGTERM during training: the step in progress finishes, a checkpoint is saved, the run stops
    with progress, loop.saving(save, tracker.close):
        bar = progress.add_task("train", total=sizes.steps, stats="", completed=loop.first_step)
        for step, start in enumerate(range(0, args.labels.num_train, args.batch_size)):
            if step < loop.first_step:  # trained before the checkpoint this run resumed from
                seen.append(permutation[start : start + args.batch_size][rank::world])
                continue
            lr = args.lr * (1 - start / args.labels.num_train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            local_indices = permutation[start : start + args.batch_size][rank::world]
            seen.append(local_indices)
            step_rewards = []
            # the step's rows, copied at its start through pinned memory: a copy between micro-batches from pageable
            # memory would wait for the previous micro-batch's kernels
            label, queries, all_samples = (
                to_device(rows[local_indices], accelerator.device)
                for rows in (train_labels.label, train_labels.query, train_labels.samples)
            )  # (b,), (b, Lq), (b, S, L)
            for query, samples, micro_label in zip(
                queries.split(sizes.micro), all_samples.split(sizes.micro), label.split(sizes.micro)
            ):
                # the last micro-batch's backward averages the gradients over processes (spec O4), overlapped with it
                with distributed.averaging_gradients(trained, len(step_rewards) == accum - 1):
                    # queries of label files start with a real token (checked on loading): no check, no host sync
                    rewards = score_label_rows(trained, query, samples, pad_id, check_first_token=False)  # (b, S)
                    loss = label_loss(label_type, rewards, micro_label)["loss"]
                    (loss / accum).backward()
                step_rewards.append(rewards.detach())
            # the gradients averaged over processes, then one Adam step (spec O4)
            nonfinite_gradients = validation.nonfinite_tensors(p.grad for p in params if p.grad is not None)
            optimizer.step()
            distributed.clear_gradients(optimizer, trained)
            # OAI's statistics of the label type on this process's labels (best-of-N: loss = error, the cross-entropy),
            # averaged over processes, under train_reward/minibatch/
            # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L124-L146
            step_rewards = torch.cat(step_rewards)
            oai_stats = label_loss(label_type, step_rewards, label)
            local_stats = {f"train_reward/minibatch/{k}": v for k, v in oai_stats.items()}
            if label_type.label_field == "best":
                local_stats["debug/accuracy"] = (step_rewards.argmax(1) == label).float().mean()
            local_stats.update(nonfinite_stats(step_rewards, oai_stats["loss"], nonfinite_gradients, params))
            local_stats["stop/signal"] = loop.stop.flag(accelerator.device)  # a signal to any process stops all
            values = accelerator.reduce(torch.stack(list(local_stats.values())), reduction="mean").tolist()
            stats = dict(zip(local_stats, values))
            stopping = stats.pop("stop/signal") > 0
            validation.check_finite_stats(stats, f"reward training step {step}", "Try a smaller --lr.")
            loss_value = stats["train_reward/minibatch/loss"]
            tracker.log({**stats, "debug/lr": lr}, step)
            if args.eval_interval and (step + 1) % args.eval_interval == 0:
                log_eval(step + 1)
            accuracy = f" acc {stats['debug/accuracy']:.2f}" if "debug/accuracy" in stats else ""
            progress.update(bar, advance=1, stats=f"loss {cli.number(loss_value)}{accuracy}")
            # a checkpoint every save_interval steps and at the end, or now when a signal stops the run
            loop.step_done(step + 1, stopping)
    loop.wait()  # the last checkpoint is on disk before the model is normalized and saved
    eval_after = log_eval(sizes.steps)

    # 4. normalize after training
    if args.normalize_after:
        norms["after"] = normalize("after", sizes.steps, (0.0, 1.0))

    # 5. save (--fsdp: the whole weights gathered onto the main process)
    with distributed.gathered(reward_model):
        check_finite_weights(reward_model, "the trained reward model", "not saved; try a smaller --lr.")
    whole = reward_plumbing.whole_reward_model(reward_model)
    if accelerator.is_main_process:
        evals = (eval_before, eval_after)
        reward_plumbing.save_reward_model(whole, tokenizer, args, label_type, evals, label_warnings)
        summary = reward_plumbing.run_summary(whole, label_type, len(heldout_labels), evals, norms)
        resumable.write_summary(args.run.output_dir, meta["run_name"], summary)  # the result, after the model
        reward_plumbing.print_summary(console, args, summary)
    loop.finish()  # every process past the save; the gradient hooks and the tracker closed
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
    return cli.parse_args(Args, task_presets(), "sentiment", __doc__, argv)[1]


def task_presets() -> dict[str, Args]:
    """One `Args` per `--task` name: OAI's launch.py experiments and the successor recipe's (presets.py)."""
    return presets.build(Args, presets.REWARD)


if __name__ == "__main__":
    cli.run(main, parse)
