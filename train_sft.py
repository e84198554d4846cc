"""Supervised fine-tuning of a causal LM on prompt/completion pairs, the first stage of the successor recipe (N+,
Huang et al. 2024, arXiv:2403.17031), as vwxyzjn/summarize_from_feedback_details sft.py trains it.
https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/sft.py

Run:   torchrun --nproc_per_node 8 train_sft.py --base_model EleutherAI/pythia-1b-deduped --dataset hf:trl-lib/tldr
       python train_sft.py --dataset pairs.jsonl --base_model gpt2 --gradient_accumulation_steps 16
Steps: tokenize prompt ⊕ completion ⊕ EOS (a `messages` row through the tokenizer's chat template), right-padded with
a PAD distinct from EOS; one epoch of next-token cross-entropy over every non-PAD token (or only the completion's:
--loss_on completion), AdamW with a cosine lr; save a directory that --base_model of train_reward.py and
train_policy.py takes. Batch sizes are global (summed over processes).

`nplus NX` in the comments is docs/nplus-details.md#nx, the section on N+'s detail X.
"""

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
import tyro
from transformers import PreTrainedModel

from lm_human_preference_details import cli, devices, distributed, resumable, settings, validation
from lm_human_preference_details import sizes as sizing
from lm_human_preference_details.devices import to_device
from lm_human_preference_details.modeling import (
    check_finite_weights,
    load_causal_lm,
    model_vocab_size,
    pad_invisible_hidden,
)
from lm_human_preference_details.nplus import sft_data, sft_plumbing
from lm_human_preference_details.tokenizer import load_tokenizer

IGNORE_INDEX = -100
"""the target of a token the loss does not count (F.cross_entropy's default ignore_index)"""


# ---------------------------------------------------------------- hyperparameters
# defaults are N+'s SFT stage (nplus §1, §4): batch 128, one epoch, AdamW lr 3e-6 eps 1e-5, cosine, loss on all tokens
@dataclass(slots=True)  # a misspelt field is an AttributeError, not a new attribute
class Args:
    seed: int = 1
    """run seed: process r seeds Python, NumPy and torch with seed + 100003 * r, and the one shuffle of the pairs (the
    same on every process) is drawn from it (nplus N9)"""
    base_model: str = "gpt2"
    """pretrained causal LM to fine-tune, hub id or local directory (gpt2, gpt_neox, llama or qwen2; N+: Pythia)"""
    dataset: str = "hf:trl-lib/tldr"
    """the pairs: a .jsonl file (rows with --prompt_column and --completion_column texts, or `messages`: a chat whose
    last message is the assistant's completion) or hf:NAME_OR_DIR (a hub dataset or a directory of `datasets`'
    save_to_disk)"""
    dataset_split: str = "train"
    """the split of an hf: --dataset to train on"""
    eval_split: str | None = None
    """rows whose loss is evaluated before and after training (and every --eval_interval steps): a split of an hf:
    --dataset, or a second .jsonl file for a .jsonl --dataset; None: no evaluation"""
    prompt_column: str = "prompt"
    """the column (JSONL field) of the prompt texts"""
    completion_column: str = "completion"
    """the column (JSONL field) of the completion texts (N+: a leading space, then the summary)"""
    loss_on: Literal["all", "completion"] = "all"
    """the tokens the loss counts: all (every non-PAD token of prompt and completion but the first, N+, nplus N10) or
    completion (the completion's tokens and EOS only)"""
    max_length: int = 562
    """pairs longer than this many tokens (EOS included) are dropped, counted in the start-up table (N+'s longest SFT
    pair has 562, nplus N4)"""
    batch_size: int = 128
    """pairs per optimizer step, summed over all processes (N+: 128)"""
    gradient_accumulation_steps: int = 1
    """micro-batches per process and step; gives the same update with less memory"""
    lr: float = 3e-6
    """AdamW learning rate at the first step, annealed to 0 on a cosine without warm-up (nplus N8)"""
    eps: float = 1e-5
    """AdamW epsilon (nplus N8)"""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (torch's default, which N+ kept, nplus N8)"""
    eval_interval: int = 0
    """evaluate the --eval_split loss every this many steps (0: only before and after training)"""
    run: Annotated[settings.RunSettings, tyro.conf.arg(name="")] = field(
        default_factory=lambda: settings.RunSettings("train_sft", "models/sft")
    )
    """where the run writes, how it logs, saves, resumes and speeds up (flags without a prefix: --output_dir, ...)"""


RESUME_IGNORED = (*resumable.RESUME_IGNORED, "eval_interval")
"""settings that may change on --resume: they do not change what the run computes"""


# ---------------------------------------------------------------- algorithm
def with_loss_mask(pairs: sft_data.TokenizedPairs, pad_id: int, loss_on: str) -> sft_data.SftData:
    """The pairs and the tokens the next-token loss counts (nplus N10): every non-PAD token but the first (nothing
    predicts it), or with --loss_on completion the completion's tokens and EOS. A row with none of them has nothing
    to learn: it is dropped (counted in `empty`)."""
    # SFD: labels = tokens with PAD -> -1 (ignored), shifted by one; the prompt is counted
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/sft.py#L389-L402
    # the position of each row's first counted token: 1 (position 0 is predicted by nothing) or the prompt's length
    first_counted = [p if loss_on == "completion" else 1 for p in pairs.prompt_tokens]
    kept = [i for i, (length, first) in enumerate(zip(pairs.lengths, first_counted)) if length > max(first, 1)]
    rows = pairs.select(kept)
    first = torch.tensor([first_counted[i] for i in kept]).clamp_min(1)  # (N,)
    positions = torch.arange(rows.tokens.shape[1])  # (T,)
    loss_mask = (rows.tokens != pad_id) & (positions[None, :] >= first[:, None])  # (N, T)
    empty = len(pairs.prompt_tokens) - len(kept)
    return sft_data.SftData(rows.tokens, loss_mask, rows.lengths, loss_mask.sum(1).numpy(), pairs.too_long, empty)


def next_token_loss_sum(
    model: PreTrainedModel, tokens: torch.Tensor, loss_mask: torch.Tensor, pad_id: int, bf16: bool = False
) -> torch.Tensor:
    """Sum over the tokens of `loss_mask` of -log p(token | the tokens before it), PADs invisible (B, T right-padded
    rows that start with a real token)."""
    # the model sees PAD ids as 0 with PAD keys masked out of attention (nplus N3); the last token predicts nothing
    hidden = pad_invisible_hidden(model, tokens[:, :-1], pad_id, check_first_token=False, bf16=bf16)  # (B, T-1, D)
    logits = model.get_output_embeddings()(hidden)[..., : model.config.vocab_size].float()
    # SFD: labels = tokens with PAD -> ignored, shifted by one (nplus N10)
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/sft.py#L389-L402
    targets = tokens[:, 1:].masked_fill(~loss_mask[:, 1:], IGNORE_INDEX)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class NextTokenLoss(torch.nn.Module):
    """`next_token_loss_sum` of `model` as a module's forward: DDP averages the gradients of the forwards it runs."""

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, loss_mask: torch.Tensor, pad_id: int, bf16: bool) -> torch.Tensor:
        return next_token_loss_sum(self.model, tokens, loss_mask, pad_id, bf16)


def make_optimizer(model: PreTrainedModel, args: Args) -> torch.optim.Optimizer:
    """torch's AdamW, betas (0.9, 0.999), with --eps and --weight_decay (nplus N8)."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/sft.py#L347-L356
    return torch.optim.AdamW(model.parameters(), lr=args.lr, eps=args.eps, weight_decay=args.weight_decay)


def data_order(num_rows: int, seed: int) -> torch.Tensor:
    """The one shuffle of the rows, the same on every process: the order in which torch's RandomSampler yields them
    after `torch.manual_seed(seed)`, as SFD's DataLoader does (nplus N9)."""
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L502-L507
    # RandomSampler without a generator draws its seed from the global generator, then permutes with it
    seed_draw = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(seed))
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(int(seed_draw)))


def cosine_factor(step: int, steps: int) -> float:
    """The lr's factor at optimizer step `step` (0-based) of `steps`: transformers' get_cosine_schedule_with_warmup
    with no warm-up, 0.5 (1 + cos(pi step / steps)), from 1 at the first step towards 0 after the last (nplus N8)."""
    # transformers/optimization.py _get_cosine_schedule_with_warmup_lr_lambda (num_cycles 0.5, no warm-up)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * step / max(1, steps))))


@torch.no_grad()
def evaluate_loss(accelerator, model, data: sft_data.SftData, pad_id: int, micro: int, bf16: bool) -> float:
    """Mean next-token loss over every counted token of `data`; each process scores a rank-strided part."""
    rows = torch.arange(accelerator.process_index, len(data.tokens), accelerator.num_processes)
    total = torch.zeros((), device=accelerator.device)
    for chunk in rows.split(micro):
        width = int(data.lengths[chunk.numpy()].max())  # host lengths: no device sync
        tokens = to_device(data.tokens[chunk, :width], accelerator.device)
        mask = to_device(data.loss_mask[chunk, :width], accelerator.device)
        total += next_token_loss_sum(model, tokens, mask, pad_id, bf16)
    return accelerator.reduce(total, reduction="sum").item() / int(data.counted.sum())


# ---------------------------------------------------------------- main
# The plumbing calls name their module (cli., devices., distributed., resumable., settings., sft_plumbing., sizing.,
# validation.): skip them to read the algorithm.
@resumable.one_run_per_output_dir
def main(args: Args) -> dict:
    """Fine-tune and save a causal LM; returns the losses and the model."""
    # 0. processes, the pairs tokenized, derived sizes, printed, then --dry_run stops; seeds; --resume
    sft_plumbing.check_args(args)
    cli.quiet_transformers()
    accelerator = distributed.make_accelerator(args.run.dist_timeout)
    tf32 = devices.use_tf32(args.run.tf32)
    devices.use_deterministic(args.run.deterministic)
    console = cli.make_console()
    tokenizer = load_tokenizer(args.base_model)  # a PAD distinct from EOS, right padding (nplus N3, N5)
    pad_id = tokenizer.pad_token_id

    # 1. the pairs: prompt.strip() ⊕ completion ⊕ EOS, right-padded, and the tokens the loss counts
    pairs = sft_data.tokenize_pairs(sft_data.read_pairs(args, tokenizer), tokenizer, args.max_length)
    data = with_loss_mask(pairs, pad_id, args.loss_on)
    sft_plumbing.check_usable(data, f"--dataset {args.dataset}", args.max_length)
    eval_data = None
    if args.eval_split is not None:
        eval_pairs = sft_data.tokenize_pairs(sft_data.read_pairs(args, tokenizer, True), tokenizer, args.max_length)
        eval_data = with_loss_mask(eval_pairs, pad_id, args.loss_on)
        sft_plumbing.check_usable(eval_data, f"--eval_split {args.eval_split}", args.max_length)
    sizes = sizing.derive_sft_sizes(
        args, validation.dry_run_world(args.run, accelerator.num_processes), len(data.tokens)
    )
    rank, world, accum = accelerator.process_index, sizes.world, args.gradient_accumulation_steps
    if accelerator.is_main_process:
        sft_plumbing.print_setup(console, args, sizes, data, tf32)
    if args.run.dry_run:
        sft_plumbing.check_token_ids(data, model_vocab_size(args.base_model), pad_id, args.base_model)
        accelerator.print("dry run: every input checked; nothing written")
        return {}
    # per-process seeds (nplus N9)
    # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/ppo.py#L421
    devices.set_seed(args.seed + rank * 100003)
    generator = torch.Generator().manual_seed(args.seed + rank * 100003)
    loop = resumable.CheckpointedLoop(args, world, RESUME_IGNORED, accelerator, "step", sizes.steps)
    if loop.finished is not None:  # a finished run is a result: its summary shown, every file kept as it is
        return sft_plumbing.report_finished(console, args, loop.finished, accelerator)

    # 2. the model (dropout off: load_causal_lm zeroes every dropout probability, nplus N6), rank 0's weights
    # everywhere, AdamW, the gradients averaged over processes
    model = load_causal_lm(args.base_model).to(accelerator.device)
    sft_plumbing.check_token_ids(data, model.config.vocab_size, pad_id, args.base_model)
    distributed.broadcast_parameters(model, accelerator)
    trained = distributed.data_parallel(NextTokenLoss(model), accelerator)  # DDP: gradients averaged over processes
    optimizer = make_optimizer(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    # the one shuffle, the same on every process; a step trains on the next batch_size rows, process r on every
    # world-th of them (SFD's DataLoader with 1 pair per process and micro-batch gives the same split, nplus N9)
    order = data_order(len(data.tokens), args.seed)
    tracker, meta = sft_plumbing.start_tracker(args, accelerator, loop)

    def log_eval(step: int) -> float | None:
        """The --eval_split loss, logged under eval/ (None without --eval_split)."""
        if eval_data is None:
            return None
        loss = evaluate_loss(accelerator, model, eval_data, pad_id, sizes.micro, args.run.bf16)
        tracker.log({"eval/loss": loss}, step)
        return loss

    def save(steps: int) -> None:
        """The training state after `steps` steps, written in the background."""
        run_state = {"eval_before": eval_before, "train_first": train_first}
        sft_plumbing.save_checkpoint(
            args, accelerator, steps, model, optimizer, run_state, generator, tracker, meta, loop.saves
        )

    if loop.resumed is None:
        eval_before, train_first = log_eval(0), None
    else:
        sft_plumbing.restore(loop.resumed, model, optimizer, generator)
        eval_before, train_first = loop.resumed.shared["eval_before"], loop.resumed.shared["train_first"]
        if args.eval_interval and loop.first_step % args.eval_interval == 0:
            log_eval(loop.first_step)  # logged before the checkpoint, hidden by the TensorBoard purge at first_step

    # 3. one epoch: next-token cross-entropy, mean over the counted tokens of the global batch; AdamW, lr on a cosine
    loss_value = None
    progress = sft_plumbing.progress_bar(console, accelerator)
    # Ctrl-C or SIGTERM during training: the step in progress finishes, a checkpoint is saved, the run stops
    with progress, loop.saving(save, tracker.close):
        bar = progress.add_task("train", total=sizes.steps, stats="", completed=loop.first_step)
        for step in range(loop.first_step, sizes.steps):
            # cosine from lr to 0 over the run's steps, no warm-up, one value per optimizer step (nplus N8)
            # https://github.com/vwxyzjn/summarize_from_feedback_details/blob/ee77a9abc31f5338365ee087945c5bcafac7f1ca/summarize_from_feedback_details/sft.py#L405-L406
            lr = args.lr * cosine_factor(step, sizes.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            rows = order[step * args.batch_size : (step + 1) * args.batch_size]
            # the mean over every counted token of the global batch, whatever the micro-batches and processes (unlike
            # SFD, nplus N10, whose mean of micro-batch token means, 1 pair per process and micro-batch, is a mean of
            # per-pair means that weighs a short pair's tokens more)
            counted = int(data.counted[rows.numpy()].sum())  # host counts: no device sync
            local = rows[rank::world]
            # the step's rows, copied at its start, cut to its longest row (host lengths)
            width = int(data.lengths[local.numpy()].max())
            tokens = to_device(data.tokens[local, :width], accelerator.device)
            loss_mask = to_device(data.loss_mask[local, :width], accelerator.device)
            loss_sum = torch.zeros((), device=accelerator.device)
            for micro, (micro_tokens, micro_mask) in enumerate(
                zip(tokens.split(sizes.micro), loss_mask.split(sizes.micro))
            ):
                # the last micro-batch's backward averages the gradients over processes, overlapped with it
                with distributed.averaging_gradients(trained, micro == accum - 1):
                    micro_sum = trained(micro_tokens, micro_mask, pad_id, args.run.bf16)
                    # the processes' gradients are averaged: world x this process's share of the global token mean
                    (micro_sum * (world / counted)).backward()
                loss_sum += micro_sum.detach()
            nonfinite_gradients = validation.nonfinite_tensors(p.grad for p in params if p.grad is not None)
            optimizer.step()
            distributed.clear_gradients(optimizer, trained)
            local_stats = {
                "train/loss": loss_sum * (world / counted),  # averaged over processes: the global token mean
                "nonfinite/loss": validation.nonfinite_count([loss_sum]),
                "nonfinite/gradients": nonfinite_gradients,
                "nonfinite/weights": validation.nonfinite_tensors(params),
                "stop/signal": loop.stop.flag(accelerator.device),  # a signal to any process stops all
            }
            values = accelerator.reduce(torch.stack([v.float() for v in local_stats.values()]), reduction="mean")
            stats = dict(zip(local_stats, values.tolist()))
            stopping = stats.pop("stop/signal") > 0
            validation.check_finite_stats(stats, f"SFT step {step}", "Try a smaller --lr.")
            loss_value = stats["train/loss"]
            train_first = loss_value if train_first is None else train_first
            tracker.log({**stats, "train/lr": lr, "train/tokens": counted}, step)
            if args.eval_interval and (step + 1) % args.eval_interval == 0:
                log_eval(step + 1)
            progress.update(bar, advance=1, stats=f"loss {cli.number(loss_value)}")
            # a checkpoint every save_interval steps and at the end, or now when a signal stops the run
            loop.step_done(step + 1, stopping)
    loop.wait()  # the last checkpoint is on disk before the model is saved
    eval_after = log_eval(sizes.steps) if eval_data is not None else None

    # 4. save: the model, its tokenizer, args.json (also when a finished run is resumed: a kill may have cut it)
    check_finite_weights(model, "the fine-tuned model", "not saved; try a smaller --lr.")
    losses = {
        "train_first": train_first,
        "train_last": loss_value,
        "eval_before": eval_before,
        "eval_after": eval_after,
    }
    if accelerator.is_main_process:
        sft_plumbing.save_model(model, tokenizer, args)
        resumable.write_summary(args.run.output_dir, meta["run_name"], {**losses, "steps": sizes.steps})
        sft_plumbing.print_summary(console, args, losses)
    loop.finish()  # every process past the save; the gradient hooks and the tracker closed
    return {**losses, "steps": sizes.steps, "model": model}


def parse(argv: list[str] | None = None) -> Args:
    """Args from the command line."""
    return cli.tyro_cli(Args, description=cli.keep_line_breaks(__doc__), use_underscores=True, args=argv)


if __name__ == "__main__":
    cli.run(main, parse)
