"""Every size the training scripts derive from their global batch sizes, each computed once, by exact division, with
the error that names the flag to change (OAI derives every per-rank size with `exact_div`, spec D1).

train_policy.py: episodes per process, minibatch and micro-batch, the virtual ranks that whiten and permute as OAI's 8
ranks did (spec D4), and the number of updates. train_reward.py: labels per process and step, micro-batch, steps, and
queries per process of a normalization batch. train_sft.py: pairs per process and step, micro-batch, steps (one epoch in
whole batches).
"""

from dataclasses import dataclass

from lm_human_preference_details.settings import PolicyArgs, PpoFlags, RewardArgs, SftArgs

OAI_RANKS = 8
"""processes of OAI's runs (launch.py runs every experiment with mpi=8): by default virtual ranks make any number of
processes whiten, permute and average statistics as these 8 ranks did (spec D4)"""
# https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/launch.py#L192


def exact_div(a: int, b: int, what: str) -> int:
    """a // b, raising ValueError when b does not divide a (OAI derives every per-rank size this way)."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L116-L124
    if b == 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}; choose sizes so that {a} is a multiple of {b}.")
    return a // b


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/utils/core.py#L127-L128
    return -(-a // b)


def divisors(n: int, most: int = 10) -> str:
    """The divisors of `n` in increasing order ("1, 2, 4, ..."), at most `most` of them, for error messages."""
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[:most])) + (", ..." if len(found) > most else "")


def check_divides(parts: int, total: int, flag: str, what: str, fix: str = "") -> None:
    """ValueError unless `parts` (the value of `flag`) divides `total` (`what`), naming the values that would."""
    if total % parts:
        raise ValueError(f"{flag} {parts} does not divide {what} ({total}); {fix or f'pass one of {divisors(total)}'}.")


def split(total: int, parts: int, flag: str, what: str, fix: str = "") -> int:
    """total // parts; ValueError naming `flag` (its value `parts`) and `what` (`total`) unless parts divides total."""
    check_divides(parts, total, flag, what, fix)
    return total // parts


def per_process(total: int, world: int, flag: str, fix: str) -> int:
    """total // world; ValueError naming `flag` unless the global size `total` splits over `world` processes."""
    if total % world:
        raise ValueError(f"{flag} {total} does not split over {world} processes; {fix}.")
    return total // world


# ---------------------------------------------------------------- train_policy.py


@dataclass
class Sizes:
    """Per-process sizes derived from the global ones (spec D1)."""

    world: int
    """processes"""
    batch: int
    """episodes per process and update"""
    minibatch: int
    """episodes per process and optimizer step"""
    micro: int
    """episodes per backward pass"""
    group: int
    """episodes per virtual rank and update (spec D4)"""
    virtual_ranks: int
    """virtual ranks per process"""
    whiten_group: int
    """episodes whitened together: a virtual rank's minibatch"""
    nupdates: int
    """PPO updates in the run"""
    not_oai_ranks: str | None = None
    """why the default virtual ranks could not stand for OAI's 8 ranks (None: they do, or sizes were chosen)"""


def derive_sizes(args: PolicyArgs, world: int) -> Sizes:
    """Split the global batch over processes, minibatches and micro-batches; ValueError naming the flag of a size
    that does not divide."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L157-L159
    ppo = args.ppo
    fix = f"pass a multiple of {world} (e.g. --ppo.batch_size {ceil_div(ppo.batch_size, world) * world}) or run "
    batch = per_process(ppo.batch_size, world, "--ppo.batch_size", f"{fix}{divisors(ppo.batch_size)} processes")
    where = f"the {batch} episodes per process (--ppo.batch_size {ppo.batch_size} over {world} processes)"
    minibatch = split(batch, ppo.nminibatches, "--ppo.nminibatches", where, f"pass one of {divisors(batch)} (OAI: 1)")
    where = f"the episodes per process and minibatch ({batch} / --ppo.nminibatches {ppo.nminibatches})"
    micro = split(minibatch, ppo.gradient_accumulation_steps, "--ppo.gradient_accumulation_steps", where)
    group, not_oai_ranks = virtual_rank_size(ppo, batch, world)
    fix = f"pass one of {divisors(batch)}, or 0 to whiten each process's batch"
    virtual_ranks = split(batch, group, "--ppo.whiten_group_size", "the episodes per process", fix)
    where = f"the episodes per virtual rank of --ppo.whiten_group_size {ppo.whiten_group_size}"
    whiten_group = split(group, ppo.nminibatches, "--ppo.nminibatches", where)
    # whitening needs enough episodes per rank minibatch (spec P17)
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L69-L75
    if ppo.whiten_rewards and whiten_group < 8:
        raise ValueError(
            f"ppo.whiten_rewards needs at least 8 episodes per whitening group, got {whiten_group} (a rank's "
            f"{group} episodes / nminibatches {ppo.nminibatches}, ppo.whiten_group_size {ppo.whiten_group_size}); "
            "raise ppo.batch_size or ppo.whiten_group_size, or pass --ppo.no_whiten_rewards"
        )
    # nupdates rounds up (spec P15): books ceil(1e6 / 512) = 1954
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L78-L79
    nupdates = ceil_div(ppo.total_episodes, ppo.batch_size)
    return Sizes(world, batch, minibatch, micro, group, virtual_ranks, whiten_group, nupdates, not_oai_ranks)


def virtual_rank_size(ppo: PpoFlags, batch: int, world: int) -> tuple[int, str | None]:
    """Episodes per virtual rank: --ppo.whiten_group_size (0: the process's `batch`), else OAI's rank share
    batch_size / 8; -> that size and, when the sizes rule OAI's 8 ranks out, the process's batch and the reason."""
    if ppo.whiten_group_size is not None:
        return ppo.whiten_group_size or batch, None
    oai_group = ppo.batch_size // OAI_RANKS
    if world > OAI_RANKS or OAI_RANKS % world:
        reason = f"{world} processes do not divide OAI's {OAI_RANKS} ranks"
    elif ppo.batch_size % OAI_RANKS or oai_group % ppo.nminibatches:
        reason = (
            f"ppo.batch_size {ppo.batch_size} is not a multiple of {OAI_RANKS} ranks x {ppo.nminibatches} minibatches"
        )
    elif ppo.whiten_rewards and oai_group // ppo.nminibatches < 8:
        reason = f"a rank's minibatch of {oai_group // ppo.nminibatches} episodes is too small to whiten"
    else:
        return oai_group, None
    return batch, reason


# ---------------------------------------------------------------- train_reward.py


@dataclass
class RewardSizes:
    """train_reward.py's per-process sizes (spec D1, D7)."""

    world: int
    """processes"""
    batch: int
    """labels per process and optimizer step"""
    micro: int
    """labels per backward pass"""
    steps: int
    """optimizer steps: one epoch over --labels.num_train in whole batches"""
    rollout_batch: int
    """queries per process and normalization batch"""


def derive_reward_sizes(args: RewardArgs, world: int) -> RewardSizes:
    """Split the label batch and the normalization's rollout batch over processes and micro-batches, the labels into
    whole steps; ValueError naming the flag of a size that does not divide."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_reward.py#L56-L58
    batch = per_process(args.batch_size, world, "--batch_size", f"pass a multiple of {world}")
    where = f"the labels per process and step (--batch_size {args.batch_size} over {world} processes)"
    micro = split(batch, args.gradient_accumulation_steps, "--gradient_accumulation_steps", where)
    num_train = args.labels.num_train
    fix = (
        f"each step trains on one whole batch (OAI): pass --batch_size {divisors(num_train)} or "
        f"--labels.num_train {num_train // args.batch_size * args.batch_size}"
    )
    steps = split(num_train, args.batch_size, "--batch_size", "--labels.num_train", fix)
    rollout_batch = per_process(args.rollout_batch_size, world, "--rollout_batch_size", f"pass a multiple of {world}")
    return RewardSizes(world, batch, micro, steps, rollout_batch)


# ---------------------------------------------------------------- train_sft.py


@dataclass
class SftSizes:
    """train_sft.py's per-process sizes."""

    world: int
    """processes"""
    batch: int
    """pairs per process and optimizer step"""
    micro: int
    """pairs per backward pass"""
    steps: int
    """optimizer steps: one epoch in whole batches"""
    left_over: int
    """pairs of the last, partial batch, not trained on"""


def derive_sft_sizes(args: SftArgs, world: int, rows: int) -> SftSizes:
    """Split the batch over processes and micro-batches and the rows into whole batches (SFD: total // batch, nplus
    N8); ValueError naming the flag of a size that does not divide."""
    batch = per_process(args.batch_size, world, "--batch_size", f"pass a multiple of {world}")
    where = f"the pairs per process and step (--batch_size {args.batch_size} over {world} processes)"
    micro = split(batch, args.gradient_accumulation_steps, "--gradient_accumulation_steps", where)
    if rows < args.batch_size:
        raise ValueError(
            f"--batch_size {args.batch_size} is more than the {rows} usable pairs of --dataset; pass at most {rows} "
            f"(e.g. one of {divisors(rows)})."
        )
    return SftSizes(world, batch, micro, rows // args.batch_size, rows % args.batch_size)
