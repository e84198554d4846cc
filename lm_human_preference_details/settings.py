"""The training scripts' settings as the package sees them.

The run group: the settings that say how a training script runs, not what it computes (where it writes, how it is
tracked, saved, resumed, checked and sped up). OAI keeps such settings in one `run` group beside the algorithm's
(train_policy.py's RunHParams: seed, log_interval, save_interval, save_dir).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/train_policy.py#L25-L31
Each training script nests one of these groups as `args.run` without a prefix, so its flags keep their plain names
(--output_dir, --track, --resume auto); args.json, the tracker's config and the checkpoints record them at the top
level (`recorded`), as flags are written.

The scripts' own settings: a typed view of each script's `Args` (PolicyArgs, RewardArgs, SftArgs), one place where a
reader of the package's helpers sees the flags they read (the scripts define the fields, their defaults and help).
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from lm_human_preference_details.lora import LoraHParams
from lm_human_preference_details.tasks import TaskHParams

S = TypeVar("S")


@dataclass
class RunSettings:
    """Every training script's run settings (train_sft.py, train_reward.py, train_policy.py)."""

    exp_name: str = "train"
    """experiment name, part of the run name"""
    output_dir: str = "models/run"
    """where the run writes the trained model with its tokenizer and args.json, its training states (training_state/),
    TensorBoard logs (tb/) and wandb files"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to log without network)"""
    wandb_project_name: str = "lm_human_preference_details"
    """Weights & Biases project"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user); None = your default entity"""
    dist_timeout: float = 1800.0
    """seconds a process waits in an all-reduce or broadcast for the others before it stops with an error: bounds a
    hang when a process or node stalls without exiting (one that exits stops the others at once); must exceed the
    longest time one process works alone (rank 0 saving a checkpoint)"""
    save_interval: int = 100
    """write a training-state checkpoint (train_policy.py: and the policy) every this many steps, and always after the
    last one (OAI run.save_interval); 0 = only then"""
    keep_checkpoints: int = 2
    """training-state checkpoints kept in OUTPUT_DIR/training_state/step{N} (all that --resume needs: weights,
    optimizer, data positions, every process's RNGs), the newest; older ones are deleted once a newer one is on disk;
    0 keeps all"""
    resume: str | None = None
    """continue a killed run from a training-state checkpoint: its directory, or `auto` for the newest in
    --output_dir (none there: start afresh); the run then logs and saves what the uninterrupted run would"""
    allow_resume_changes: bool = False
    """resume even though settings that change the run (sizes, task, models, data, seeds, processes) differ from the
    checkpoint's; the differences are printed"""
    overwrite_output_dir: bool = False
    """start afresh in an --output_dir that holds another run: its training states, checkpoints/ and TensorBoard logs
    are deleted, its model is replaced when this run saves its own"""
    bf16: bool = False
    """run the transformer of the training forward passes under bfloat16 autocast (weights, optimizer, heads, logits,
    sampling and scoring stay float32): less memory, faster on GPUs with bf16; in train_policy.py the rollout's
    log-probs and values that PPO's ratio and value clipping use then come from one more forward with that arithmetic
    (the KL penalty keeps the sampler's float32 ones); off: float32 throughout, as OAI"""
    tf32: bool = False
    """run float32 matmuls on TF32 tensor cores (NVIDIA Ampere or newer: A100, H100): GEMMs ~5-7x faster, with
    relative errors up to ~1e-3 (docs/gpu.md); off: full float32, as OAI trained"""
    deterministic: bool = False
    """use torch's deterministic algorithms (CUBLAS_WORKSPACE_CONFIG=:4096:8, no cuDNN benchmarking): on the same GPU
    model and software, a killed and resumed run equals the uninterrupted one bit for bit (docs/reliability.md), with
    somewhat slower kernels; an operator without a deterministic kernel stops the run; CPU runs are deterministic
    anyway"""
    dry_run: bool = False
    """check every input (models, tokenizers, data files, a reward model or label file and its task), print the
    settings and the derived per-process sizes, and exit without training"""
    dry_run_processes: int | None = None
    """with --dry_run: derive the sizes for this many processes (e.g. 8 GPUs) instead of this launch's"""


@dataclass
class RewardRunSettings(RunSettings):
    """train_reward.py's run settings: every script's, and the two that fit a larger model in memory."""

    gradient_checkpointing: bool = False
    """recompute each transformer block's activations in the backward instead of storing them: much less activation
    memory (e.g. for gpt2-large/xl) for ~30% more compute, same updates; off: every activation is stored, as OAI"""
    fsdp: bool = False
    """shard the trained model (train_policy.py: the policy and a critic; train_reward.py: the reward model) over the
    processes with FSDP2, each transformer block a unit: every process holds 1/N of its weights, gradients and Adam
    moments, gathered once per rollout; train_policy.py shards its reference policy and reward model too
    (docs/multiprocess.md); off: every process holds everything and DDP averages the gradients, as OAI's ranks"""


@dataclass
class PolicyRunSettings(RewardRunSettings):
    """train_policy.py's run settings: train_reward.py's, and the policy run's logs, divergence report, snapshots,
    rollout engine and upload."""

    log_interval: int = 10
    """print and log a table of samples every this many updates (OAI run.log_interval)"""
    print_samples: int = 3
    """rows of the sample table (OAI prints 3)"""
    filter_warning_rate: float = 0.1
    """warn on the console, every log_interval updates, while debug/filter_pass_rate (responses passing the task's
    truncation filter; the others score the penalty) stays below this; 0: never warn"""
    divergence_updates: int = 10
    """report the run as diverged when, for this many updates in a row, objective/kl stays above --divergence_kl or
    no response passes the truncation filter (debug/filter_pass_rate 0 after it was above 0): a line naming the
    likely flags, `diverged` in OUTPUT_DIR/summary.json, and exit status 3 once everything is saved; detection only,
    the run trains on as OAI's would; 0: never"""
    divergence_kl: float | None = None
    """objective/kl (nats per episode) above which an update counts towards divergence; None: 10 x
    --rewards.adaptive_kl.target (60 nats for OAI's target 6, also with a fixed kl_coef)"""
    allow_divergence: bool = False
    """exit with status 0 even when the run diverged (it is still reported and recorded in summary.json)"""
    save_checkpoints: bool = False
    """also keep each periodic save in OUTPUT_DIR/checkpoints/update{N} (N updates done), e.g. for evaluate.py's
    gold-vs-KL curve; off: each save replaces the last"""
    compile_sampler: bool = False
    """replay each decoding step of the rollouts as one CUDA graph, captured at the first update (GPUs; on CPU the
    same step runs eagerly), the same samples from the same seed: less Python and kernel-launch time per token; off:
    eager decoding"""
    rollout_micro_batch_size: int | None = None
    """episodes per process that the rollout decodes and scores with the reference policy together (their KV cache
    and logits scale with it; benchmark/memory_estimate.py tells what fits): smaller caps the rollout's memory, with
    every episode's random numbers unchanged (with --compile_sampler pick a divisor of the process's batch: a last,
    smaller chunk has another shape, captured anew at each update); None: the process's whole batch at once, as OAI"""
    push_to_hub: bool = False
    """upload output_dir (policy, value head, tokenizer, args) to the Hugging Face hub at the end"""
    hf_repo_id: str | None = None
    """hub repository for --push_to_hub; None = {exp_name}__{task}__seed{seed} in your namespace"""


def recorded(args: Any) -> dict[str, Any]:
    """A script's settings as args.json, the tracker and the checkpoints record them: its fields, with the run group's
    at the top level under their flags' names."""
    record = dataclasses.asdict(args)
    record.update(record.pop("run", {}))
    return record


def with_run(args: S, **changes: Any) -> S:
    """`args` with some of its run settings replaced: `with_run(args, output_dir="out", resume="auto")`."""
    return dataclasses.replace(args, run=dataclasses.replace(args.run, **changes))


# ---------------------------------------------------------------- what the package reads of the scripts' Args


class AdaptiveKLFlags(Protocol):
    """train_policy.py's --rewards.adaptive_kl.*"""

    enabled: bool
    target: float
    horizon: int


class PolicyRewardFlags(Protocol):
    """train_policy.py's --rewards.*"""

    trained_model: str
    normalize_samples: int
    normalization: dict[str, float] | None
    kl_coef: float
    kl_estimator: str
    gold_model: str | None
    task_from_reward_model: bool
    allow_task_mismatch: bool

    @property
    def adaptive_kl(self) -> AdaptiveKLFlags: ...


class PpoFlags(Protocol):
    """train_policy.py's --ppo.*"""

    total_episodes: int
    batch_size: int
    nminibatches: int
    noptepochs: int
    lr: float
    vf_coef: float
    cliprange: float
    cliprange_value: float
    gamma: float
    lam: float
    whiten_rewards: bool
    gradient_accumulation_steps: int
    whiten_group_size: int | None
    value_model: str | None


class PolicyArgs(Protocol):
    """train_policy.Args"""

    seed: int
    data_seed: int
    base_model: str
    use_tensorflow_adam: bool
    weight_decay: float
    task_id: str
    task: TaskHParams
    lora: LoraHParams
    run: PolicyRunSettings

    @property
    def rewards(self) -> PolicyRewardFlags: ...

    @property
    def ppo(self) -> PpoFlags: ...


class LabelFlags(Protocol):
    """train_reward.py's --labels.*"""

    type: str
    num_train: int
    allow_task_mismatch: bool


class RewardArgs(Protocol):
    """train_reward.Args"""

    seed: int
    data_seed: int
    base_model: str
    label_dataset: str
    task: TaskHParams
    batch_size: int
    gradient_accumulation_steps: int
    lr: float
    rollout_batch_size: int
    normalize_samples: int
    debug_normalize: int
    use_tensorflow_adam: bool
    weight_decay: float
    eval_interval: int
    task_id: str
    run: RewardRunSettings

    @property
    def labels(self) -> LabelFlags: ...


class SftArgs(Protocol):
    """train_sft.Args"""

    seed: int
    base_model: str
    dataset: str
    dataset_split: str
    eval_split: str | None
    prompt_column: str
    completion_column: str
    loss_on: str
    max_length: int
    batch_size: int
    gradient_accumulation_steps: int
    lr: float
    eps: float
    weight_decay: float
    eval_interval: int
    run: RunSettings
