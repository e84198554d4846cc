"""Small offline worlds for end-to-end tests: a query corpus and label files with a planted preference."""

import dataclasses
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from lm_human_preference_details import checkpoint, output_claim
from lm_human_preference_details.labels import OAI_PAD_TOKEN
from lm_human_preference_details.tasks import TASKS, TaskHParams

REPO = Path(__file__).resolve().parents[1]
SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "her sister", "the teacher", "a bird", "our neighbour"]
VERBS = ["walked to", "looked at", "talked about", "thought about", "found", "painted", "visited", "remembered"]
OBJECTS = ["the house", "a river", "the garden", "an apple", "the city", "a small boat", "the station", "the forest"]
ENDINGS = ["in the morning", "after dinner", "with a smile", "for a while", "before the rain", "at night"]


def books_task(**fields) -> TaskHParams:
    """OAI's books task (the sentiment preset, its truncation text resolved for GPT-2: 13), some fields replaced."""
    return dataclasses.replace(TASKS["sentiment"], **{"truncate_token": 13, **fields})


def write_query_file(path: Path, n: int = 300, seed: int = 0) -> Path:
    """A .txt corpus, one short passage of two sentences per line."""
    rng = random.Random(seed)

    def sentence() -> str:
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."

    path.write_text("\n".join(f"{sentence().capitalize()} {sentence().capitalize()}" for _ in range(n)) + "\n")
    return path


def script_env() -> dict[str, str]:
    """The environment of a user's fresh shell, offline: without the wandb service an in-process run of the tests
    started (WANDB_SERVICE), which would outlive a killed script and keep its wandb run open."""
    env = {key: value for key, value in os.environ.items() if key != "WANDB_SERVICE"}
    env.update(WANDB_MODE="offline", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def without_gpus(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with every GPU hidden (CUDA_VISIBLE_DEVICES=""), for a test that starts several processes: the tests
    compare CPU (gloo) runs, which on a machine with fewer GPUs than processes would otherwise share a GPU (NCCL:
    "Duplicate GPU detected") or build their models on the CPU under an NCCL group."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(
    script: str, *flags: str, timeout: int = 600, cwd: Path = REPO, check: bool = True
) -> subprocess.CompletedProcess:
    """Run one of the project's scripts as a user would; raise with its output when it fails (`check`)."""
    result = subprocess.run(
        [sys.executable, str(REPO / script), *flags],
        cwd=cwd,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def lock_record(output_dir) -> dict | None:
    """What the lock file of `output_dir` says about its holder (None while it says nothing)."""
    try:
        return json.loads(open(os.path.join(output_dir, output_claim.LOCK_FILE)).read())
    except (OSError, ValueError):
        return None


def fake_checkpoint(output_dir, step: int, world_size: int) -> str:
    """A checkpoint directory with the files `load_training_state` reads (no weights: only the decision is tested)."""
    import torch

    path = checkpoint.step_dir(str(output_dir), step)
    os.makedirs(path)
    with open(os.path.join(path, checkpoint.META_FILE), "w") as f:
        json.dump({"step": step, "world_size": world_size, "settings": {}, "run_name": "r", "wandb_id": None}, f)
    torch.save({}, os.path.join(path, checkpoint.SHARED_FILE))
    for rank in range(world_size):
        torch.save({}, os.path.join(path, checkpoint.RANK_FILE.format(rank=rank)))
    return path


def write_policy_planted_labels(
    path: Path,
    model_dir: str,
    tokenizer,
    corpus: Path,
    n_rows: int,
    query_length: int,
    response_length: int,
    marker: int,
    seed: int = 0,
    **task_fields,
) -> Path:
    """Like OAI's offline labels: 4 samples of the base policy per query; the best one gets `marker` planted in it."""
    import torch

    from lm_human_preference_details.data import QueryStream, load_texts
    from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm, sample

    task = books_task(
        query_dataset=str(corpus), query_length=query_length, response_length=response_length, **task_fields
    )
    queries = QueryStream(load_texts(str(corpus)), tokenizer, task, 0, 1, data_seed=seed).next_batch(n_rows)
    policy = PolicyWithValueHead(load_causal_lm(model_dir))
    generator = torch.Generator().manual_seed(seed)
    samples, _, _ = sample(
        policy, queries.repeat_interleave(4, 0), response_length, task.temperature, tokenizer.pad_token_id, generator
    )
    samples = samples.view(n_rows, 4, response_length)
    samples[samples == marker] = tokenizer.eos_token_id
    best = torch.randint(0, 4, (n_rows,), generator=generator)
    position = torch.randint(0, response_length, (n_rows,), generator=generator)
    samples[torch.arange(n_rows), best, position] = marker
    queries[queries == tokenizer.pad_token_id] = OAI_PAD_TOKEN
    rows = [
        {"query": q, **{f"sample{i}": s[i] for i in range(4)}, "best": b}
        for q, s, b in zip(queries.tolist(), samples.tolist(), best.tolist())
    ]
    path.write_text(json.dumps(rows))
    return path


def file_digests(directory: Path) -> dict[str, str]:
    """Every file below `directory` (relative path -> SHA-256 of its bytes): what a run left, to compare byte for
    byte."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(directory).rglob("*"))
        if path.is_file()
    }
