"""train_policy.py's feature settings together: a covering array of pairs (tests/pairwise.py) over --fsdp,
--compile_sampler, LoRA, a critic, --task.end_at_eos, --bf16, --gradient_checkpointing, --rollout_micro_batch_size,
--deterministic, the KL estimator, reward whitening, two processes and a kill with --resume auto: every row completes
(and, when killed, resumes to the uninterrupted run's logs and weights), every pair of values occurs in a row, and the
pairs train_policy.py refuses are exactly those docs/reliability.md lists under "Features together", each refused in
one line before anything is trained.

On CPU --compile_sampler replays the decoding step through the eager stand-in (`decoding_graph.EagerStepGraph`): the
static buffers and the warm-up, capture and replay sequence run, but no CUDA graph is captured, so a graph reading a
weight at a stale address (e.g. after --fsdp gathers the policy again) would go unseen here.
"""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_policy
from lm_human_preference_details import checkpoint, cli, devices, resumable
from lm_human_preference_details.resume_check import max_metric_difference, max_weight_difference, scalars
from tests.conftest import write_queries
from tests.pairwise import all_pairs, covering_rows, pair, row_pairs
from tests.planted import REPO, free_port
from tests.test_multiprocess import run_all

pytestmark = pytest.mark.usefixtures("single_thread")

FACTORS = {
    "processes": (1, 2),
    "fsdp": (False, True),
    "compile_sampler": (False, True),
    "lora": (0, 2),
    "critic": (None, "policy"),
    "end_at_eos": (False, True),
    "bf16": (False, True),
    "gradient_checkpointing": (False, True),
    "rollout_micro_batch_size": (None, 4),
    "deterministic": (False, True),
    "kl_estimator": ("k1", "k3"),
    "whiten_rewards": (True, False),
    "kill_resume": (False, True),
}
"""each feature's values, the default first"""
FLAGS = {
    ("fsdp", True): ["--fsdp"],
    ("compile_sampler", True): ["--compile_sampler"],
    ("lora", 2): ["--lora.rank", "2"],
    ("critic", "policy"): ["--ppo.value_model", "policy"],
    ("end_at_eos", True): ["--task.end_at_eos"],
    ("bf16", True): ["--bf16"],
    ("gradient_checkpointing", True): ["--gradient_checkpointing"],
    ("rollout_micro_batch_size", 4): ["--rollout_micro_batch_size", "4"],
    ("deterministic", True): ["--deterministic"],
    ("kl_estimator", "k3"): ["--rewards.kl_estimator", "k3"],
    ("whiten_rewards", False): ["--ppo.no_whiten_rewards"],
}
"""the flags of each value that is not the default (processes and kill_resume are how the run is started)"""
DOC_NAMES = {
    ("processes", 2): "2 processes",
    ("fsdp", True): "--fsdp",
    ("compile_sampler", True): "--compile_sampler",
    ("lora", 2): "--lora.rank N",
    ("critic", "policy"): "--ppo.value_model SOURCE",
    ("end_at_eos", True): "--task.end_at_eos",
    ("bf16", True): "--bf16",
    ("gradient_checkpointing", True): "--gradient_checkpointing",
    ("rollout_micro_batch_size", 4): "--rollout_micro_batch_size N",
    ("deterministic", True): "--deterministic",
    ("kl_estimator", "k3"): "--rewards.kl_estimator k3",
    ("whiten_rewards", False): "--ppo.no_whiten_rewards",
    ("kill_resume", True): "--resume auto",
}
"""how docs/reliability.md's "Features together" table names a value"""
UPDATES = 2
"""updates of every run: a killed run is killed after the first one's checkpoint"""
COMMON = [
    *("--task.query_length", "16", "--task.response_length", "8", "--task.start_text", "None"),
    *("--task.end_text", "None", "--task.truncate_token", "None", "--task.truncate_after", "0"),
    *("--ppo.total_episodes", str(16 * UPDATES), "--ppo.batch_size", "16", "--ppo.lr", "1e-3"),
    *("--ppo.noptepochs", "2", "--ppo.whiten_group_size", "0", "--save_interval", "1", "--keep_checkpoints", "0"),
    *("--log_interval", "100", "--print_samples", "1"),
]
"""2 updates of 16 episodes (8 per process on 2, whitened as one group), a checkpoint after each"""
REWARD = "def score(queries, responses):\n    return [len(r) / 10 - r.count('e') for r in responses]\n"
LAUNCHER = """
import json, sys
sys.path.insert(0, {repo!r})
import torch
import train_policy
from lm_human_preference_details import cli
from tests.test_features_together import killed_after_first_checkpoint

torch.set_num_threads(1)
for output_dir, flags, killed in json.loads(sys.argv[1]):
    if killed:
        killed_after_first_checkpoint()
    cli.run(train_policy.main, train_policy.parse, [*flags, "--output_dir", output_dir])
"""
"""several runs one after another in one launch of 2 processes; a killed one ends the launch"""


def documented_refusals() -> dict[frozenset[str], str]:
    """The pairs of docs/reliability.md's "Features together" table that train_policy.py refuses: {names: reason}."""
    text = (REPO / "docs" / "reliability.md").read_text()
    section = text.split("## Features together", 1)[1].split("\n## ", 1)[0]
    refused = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            refused[frozenset(cell.strip("`") for cell in cells[:2])] = cells[2]
    return refused


def refused_pairs() -> set:
    """The documented refusals as pairs of FACTORS' values."""
    by_name = {name: value for value, name in DOC_NAMES.items()}
    return {pair(*(by_name[name] for name in sorted(names)), list(FACTORS)) for names in documented_refusals()}


ROWS = covering_rows(FACTORS, refused_pairs())


def row_flags(row: dict) -> list[str]:
    return [flag for value in row.items() for flag in FLAGS.get(value, [])]


def row_id(row: dict) -> str:
    names = [DOC_NAMES[value].split()[0].lstrip("-") for value in row.items() if value in DOC_NAMES]
    return "-".join(names) or "defaults"


@pytest.fixture(autouse=True)
def determinism_restored():
    """torch's deterministic-algorithms setting as it was before the test (--deterministic sets it process-wide)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(enabled)


os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", devices.CUBLAS_DETERMINISTIC[0])


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir):
    """Queries, a programmatic reward and the launcher of several 2-process runs; -> the flags every run shares."""
    root = tmp_path_factory.mktemp("together")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    launcher = root / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO)))
    flags = ["--base_model", tiny_model_dir, "--task.query_dataset", write_queries(root / "queries.txt"), *COMMON]
    return {"root": root, "launcher": launcher, "flags": [*flags, "--rewards.trained_model", f"python:{reward}:score"]}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *args]  # fmt: skip


def launch(world: dict, runs: list[tuple[Path, list[str], bool]], log_dir: Path) -> int:
    """The `runs` (output directory, flags, killed) one after another in one launch of 2 gloo processes; -> its exit
    code (nonzero when its last run was killed)."""
    listed = [(str(out), [*world["flags"], *flags], killed) for out, flags, killed in runs]
    codes, outputs, _ = run_all([torchrun(str(world["launcher"]), json.dumps(listed))], 600, log_dir)
    assert codes == [0] or runs[-1][2], outputs[0][-6000:]
    return codes[0]


def saved_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the run saved outside its training states: the policy, value head, adapters, critic."""
    tensors = {}
    for path in sorted(output_dir.rglob("*.safetensors")):
        name = path.relative_to(output_dir)
        if name.parts[0] != "training_state":
            tensors.update({f"{name}:{k}": v for k, v in load_file(path).items()})
    return tensors


@pytest.fixture(scope="module")
def two_process_runs(world):
    """The rows of 2 processes, each run once whole; each killed row run again, killed after its first checkpoint,
    then resumed. A kill ends its launch, so the launches chain: the whole runs and the first killed run, that one's
    resume and the next killed run, ...; -> {row index: (whole, killed or None, the step it resumed from)}."""
    rows = {i: row for i, row in enumerate(ROWS) if row["processes"] == 2}
    out = world["root"] / "two"
    launches = [[(out / f"row{i}", row_flags(row), False) for i, row in rows.items()]]
    for i, row in rows.items():
        if row["kill_resume"]:
            launches[-1].append((out / f"row{i}-killed", row_flags(row), True))
            launches.append([(out / f"row{i}-killed", [*row_flags(row), "--resume", "auto"], False)])
    resumed_from = {}
    for runs in launches:
        if launch(world, runs, world["root"]) != 0:
            killed = runs[-1][0]
            resumed_from[killed] = checkpoint.list_checkpoints(str(killed))[-1][0]
    results = {}
    for i, row in rows.items():
        killed = out / f"row{i}-killed" if row["kill_resume"] else None
        results[i] = (out / f"row{i}", killed, resumed_from.get(killed))
    return results


def killed_after_first_checkpoint() -> None:
    """From now on a run of this process is SIGKILLed as soon as its first checkpoint is on disk, as
    `resume_check.start_and_kill` kills a script (here without starting Python again)."""
    step_done = resumable.CheckpointedLoop.step_done

    def step_done_then_killed(loop: resumable.CheckpointedLoop, steps: int, stopping: bool) -> None:
        step_done(loop, steps, stopping)
        while not os.path.isdir(checkpoint.step_dir(str(loop.output_dir), 1)):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    resumable.CheckpointedLoop.step_done = step_done_then_killed


def run_killed(flags: list[str], output_dir: Path) -> int:
    """The run of `flags` in a forked copy of this process, killed after its first checkpoint; -> the newest
    checkpoint's step."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            killed_after_first_checkpoint()
            train_policy.main(train_policy.parse(flags))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    return checkpoint.list_checkpoints(str(output_dir))[-1][0]


def assert_resumed_equals_whole(whole: Path, killed: Path, resumed_from: int) -> None:
    """The killed run, resumed, logged and saved what the uninterrupted one did (to 1e-6, as tests/test_resume.py)."""
    assert resumed_from == 1  # between the two checkpoints
    metric_diff = max_metric_difference(scalars(killed), scalars(whole), resumed_from)
    weights = [saved_weights(killed), saved_weights(whole)]
    weight_diff = max_weight_difference(*weights)
    print(f"{killed.name} resumed after {resumed_from}: max |metric diff| {metric_diff:.3g}, weights {weight_diff:.3g}")
    assert metric_diff <= 1e-6 and weights[1] and weight_diff <= 1e-6


def assert_completed(whole: Path) -> None:
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["updates"] == {"first": 0, "last": UPDATES - 1, "of": UPDATES} and summary["diverged"] is None
    assert [step for step, _ in scalars(whole)["objective/score"]] == list(range(UPDATES))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ROWS)), ids=[row_id(row) for row in ROWS])
def test_row_completes_and_resumes_exactly(index, world, tmp_path, request):
    row = ROWS[index]
    if row["processes"] == 2:
        whole, killed, resumed_from = request.getfixturevalue("two_process_runs")[index]
    else:
        whole = tmp_path / "whole"
        train_policy.main(train_policy.parse([*world["flags"], *row_flags(row), "--output_dir", str(whole)]))
        killed, resumed_from = None, None
        if row["kill_resume"]:
            killed = tmp_path / "killed"
            flags = [*world["flags"], *row_flags(row), "--output_dir", str(killed)]
            resumed_from = run_killed(flags, killed)
            train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    assert_completed(whole)
    if killed is not None:
        assert_resumed_equals_whole(whole, killed, resumed_from)


@pytest.mark.parametrize("names", sorted(documented_refusals(), key=sorted), ids=lambda names: "+".join(sorted(names)))
def test_a_documented_pair_is_refused_in_one_line_before_training(names, world, tmp_path, capsys):
    by_name = {name: value for value, name in DOC_NAMES.items()}
    row = {factor: values[0] for factor, values in FACTORS.items()} | dict(by_name[name] for name in names)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        cli.run(train_policy.main, train_policy.parse, [*world["flags"], *row_flags(row), "--output_dir", str(out)])
    errors = capsys.readouterr().err.strip().splitlines()
    # the one line, then the --debug hint
    assert stop.value.code == 2 and errors[0].startswith("error: ") and len(errors) == 2
    for name in names:
        assert name.split()[0] in errors[0]
    assert not out.exists()  # refused before the output directory was claimed: nothing trained, nothing written


def test_the_rows_cover_every_pair_but_the_documented_refusals():
    refused = refused_pairs()
    assert len(refused) == len(documented_refusals())  # every documented pair names values of FACTORS
    held = set().union(*(row_pairs(row, list(FACTORS)) for row in ROWS))
    assert not held & refused  # no row holds a refused pair
    assert held == set(all_pairs(FACTORS)) - refused
    assert len(ROWS) <= 12  # a covering array of pairs, not every combination


def test_the_generator_covers_pairs_deterministically_and_avoids_refused_ones():
    factors = {"a": (0, 1, 2), "b": (0, 1), "c": ("x", "y"), "d": (0, 1)}
    refused = {(("a", 2), ("c", "y")), (("b", 1), ("d", 1))}
    rows = covering_rows(factors, refused)
    assert rows == covering_rows(factors, refused)
    held = set().union(*(row_pairs(row, list(factors)) for row in rows))
    assert held == set(all_pairs(factors)) - refused
    assert len(rows) < 3 * 2 * 2 * 2  # fewer than every combination
    with pytest.raises(ValueError, match="unknown"):
        covering_rows(factors, {(("a", 3), ("b", 0))})


def test_documented_refusal_reasons_are_sentences():
    for names, reason in documented_refusals().items():
        assert re.search(r"\w", reason) and len(names) == 2
