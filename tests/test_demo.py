"""demo/run_demo.py: the quick pipeline end to end (world, pretraining, labels, reward model, PPO, evaluation), and
the successor recipe's (--recipe nplus: SFT, best-of-2 labels, reward model, PPO with EOS and a critic, evaluation) on
the same world and base model; the stages of --reward SPEC and of --recipe nplus.

The two quick runs are the suite's slowest tests (about 4 minutes each beside other tests on 2 cores), marked
`e2e_slow`: `make test` skips them and `make test-e2e-slow` (which CI runs after `make test`) runs them at the same
time, each in its file (this one and test_demo_nplus.py) on its pytest-xdist worker, on a world and a pretrained model
built once for both."""

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """One --output_dir for the quick runs of both recipes, holding the world and the pretrained model that run_demo.py
    builds (its own stages, its settings): both runs find them and skip those stages, as a user's second run does. The
    pytest-xdist workers of one session share it (their base directories have this session's as parent): the first to
    get here builds it while the other waits, then each runs its recipe."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    root = (shared / "demo").resolve()
    with open(shared / "demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # run_demo.py sets it for its stages
            run_demo = load_run_demo(monkeypatch)
            assert run_demo.NPLUS_QUICK.pretrain == run_demo.QUICK.pretrain  # one base model for both
            run_demo.prepare_base(root, run_demo.QUICK.pretrain, root / "logs", {})
    return root


def run_demo_quick(root: Path, *flags: str) -> subprocess.CompletedProcess:
    """`python demo/run_demo.py --quick FLAGS --output_dir ROOT` as a user runs it; its output when it fails."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(REPO / "demo" / "run_demo.py"), "--quick", *flags, "--output_dir", str(root)]
    run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


@pytest.mark.slow
@pytest.mark.e2e_slow
def test_run_demo_quick_raises_gold_score(demo_root):
    run = run_demo_quick(demo_root)
    seed_dir = demo_root / "quick-seed1"
    assert (seed_dir / "curves.png").stat().st_size > 10_000
    results = json.loads((seed_dir / "results.json").read_text())
    assert results["mode"] == "quick"
    assert results["gold"]["margin"] >= results["guaranteed_margin"] >= 0.2, results["gold"]
    accuracy = results["reward_model"]
    assert accuracy["accuracy_after"] > max(0.5, accuracy["accuracy_before"]), accuracy
    assert "trained policy" in run.stdout and "gold score" in run.stdout
    # evaluate.py's table and the gold-vs-KL curve over the policy's checkpoints (every 4 of its 12 updates)
    evaluation = seed_dir / "evaluation"
    assert "| metric | base | trained | win rate (trained > base) |" in (evaluation / "results.md").read_text()
    assert (evaluation / "gold_vs_kl.png").stat().st_size > 10_000
    curve = json.loads((evaluation / "results.json").read_text())["curve"]
    assert [point["policy"] for point in curve][1:] == ["update4", "update8", "final"]
    assert abs(curve[0]["kl"]["mean"]) < 1e-3 < 0.3 < curve[-1]["kl"]["mean"]


def fake_evaluation(gold_base: float, gold_trained: float) -> dict:
    """The part of evaluate.py's results.json that run_demo.py reads."""
    metrics = {
        "gold_score": {"base": {"mean": gold_base, "stderr": 0.01}, "trained": {"mean": gold_trained, "stderr": 0.02}},
        **{name: {"base": {"mean": 0.0}, "trained": {"mean": 0.5}} for name in ("score", "filter_pass_rate", "kl")},
    }
    example = {
        "query": " q",
        "base": {"response": " a", "gold_score": -0.1},
        "trained": {"response": " b", "gold_score": 0.6},
    }
    return {
        "metrics": metrics,
        "queries": {"num": 128},
        "win_rate": {"gold_score": 0.8, "score": 0.9},
        "examples": [example],
    }


def load_run_demo(monkeypatch):
    """demo/run_demo.py as a module, its directory importable as when it runs."""
    monkeypatch.syspath_prepend(str(REPO / "demo"))
    spec = importlib.util.spec_from_file_location("run_demo_under_test", REPO / "demo" / "run_demo.py")
    run_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_demo)
    return run_demo


def test_every_stage_runs_with_the_pinned_thread_count_whatever_the_callers(monkeypatch):
    # the thread count changes the floats' rounding, so the published figures hold only with the count they came from
    run_demo = load_run_demo(monkeypatch)
    for callers in ("1", "7"):
        monkeypatch.setenv("OMP_NUM_THREADS", callers)
        monkeypatch.setenv("MKL_NUM_THREADS", callers)
        stage = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
            env=run_demo.child_env(), capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        assert stage.stdout.strip() == str(run_demo.DEMO_THREADS) == "2"


def test_run_demo_reward_flag_trains_straight_against_that_reward(tmp_path, monkeypatch):
    # the stages are recorded, not run: world and base model count as present; no labels or reward model, then the
    # evaluation of the policy (with the reward of its args.json) against VADER
    run_demo = load_run_demo(monkeypatch)
    stages = []

    def record_stage(name, script, flags, log_dir):
        log_dir.mkdir(parents=True, exist_ok=True)
        stages.append((name, script.name, [str(flag) for flag in flags]))
        if name == "evaluation":
            output_dir = Path(flags[flags.index("--output_dir") + 1])
            output_dir.mkdir(parents=True)
            (output_dir / "results.json").write_text(json.dumps(fake_evaluation(-0.05, 0.7)))
        return 1.0

    curve = [(step, 0.1 * step) for step in range(12)]
    monkeypatch.setattr(run_demo, "run_stage", record_stage)
    monkeypatch.setattr(run_demo, "same_json", lambda *_: True)
    monkeypatch.setattr(
        run_demo,
        "read_scalars",
        lambda _: dict.fromkeys(("objective/score", "objective/gold_score", "objective/kl"), curve),
    )
    monkeypatch.chdir(
        tmp_path
    )  # a python: FILE is relative to the caller's directory, the stages run in the repository
    args = run_demo.Args(output_dir=str(tmp_path / "demo"), quick=True, reward="python:mine.py:score")
    results = run_demo.main(args)
    assert [(name, script) for name, script, _ in stages] == [
        ("policy", "train_policy.py"),
        ("evaluation", "evaluate.py"),
    ]
    flags = stages[0][2]
    value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    assert value["--rewards.trained_model"] == f"python:{tmp_path / 'mine.py'}:score"
    assert value["--rewards.normalize_samples"] == "256" and value["--rewards.gold_model"] == "vader"
    assert value["--ppo.total_episodes"] == str(64 * 12) and value["--ppo.lr"] == "0.0003"  # the quick settings
    assert value["--ppo.whiten_group_size"] == "0"  # the batch of 64 whitened as one group, not 8 groups of 8
    # evaluate.py reads the reward (the absolute path above), its normalization and the gold judge from the policy's
    # args.json: no --reward_model or --gold overrides them; the queries are the world's held-out texts
    run_dir = tmp_path / "demo" / "quick-seed1-score"
    flags = stages[1][2]
    value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    assert "--reward_model" not in value and "--gold" not in value
    assert value["--policy"] == str(run_dir / "policy") and value["--output_dir"] == str(run_dir / "evaluation")
    assert value["--task.query_dataset"] == str(tmp_path / "demo" / "world" / "heldout.txt")
    assert value["--num_queries"] == "128"
    written = json.loads((run_dir / "results.json").read_text())
    assert written == results and results["score"] == {"first": 0.0, "last5": pytest.approx(0.9)}
    assert results["gold"]["base"] == -0.05 and results["gold"]["margin"] == pytest.approx(0.75)
    assert results["win_rate"]["gold_score"] == 0.8 and results["samples"][0]["trained"] == "b"


def test_run_demo_nplus_runs_each_stage_with_the_successor_recipes_flags(tmp_path, monkeypatch):
    # the stages are recorded, not run: world and base model count as present
    run_demo = load_run_demo(monkeypatch)
    stages = []

    def record_stage(name, script, flags, log_dir):
        log_dir.mkdir(parents=True, exist_ok=True)
        stages.append((name, script.name, [str(flag) for flag in flags]))
        output = {"reward": "--output_dir", "evaluation": "--output_dir"}.get(name)
        if output:
            output_dir = Path(flags[flags.index(output) + 1])
            output_dir.mkdir(parents=True)
            if name == "evaluation":
                (output_dir / "results.json").write_text(json.dumps(fake_evaluation(-0.05, 0.7)))
            else:
                meta = {"eval_before": {"accuracy": 0.5, "rows": 64}, "eval_after": {"accuracy": 0.8, "rows": 64}}
                (output_dir / "reward_model.json").write_text(json.dumps(meta))
        return 1.0

    curve = [(step, 0.1 * step) for step in range(12)]
    monkeypatch.setattr(run_demo, "run_stage", record_stage)
    monkeypatch.setattr(run_demo, "same_json", lambda *_: True)
    monkeypatch.setattr(
        run_demo,
        "read_scalars",
        lambda _: dict.fromkeys(("objective/score", "objective/gold_score", "objective/kl"), curve),
    )
    results = run_demo.main(run_demo.Args(output_dir=str(tmp_path), quick=True, recipe="nplus", seed=2))
    assert [(name, script) for name, script, _ in stages] == [
        ("sft_data", "sft_data.py"),
        ("sft", "train_sft.py"),
        ("labels", "label_generation.py"),
        ("reward", "train_reward.py"),
        ("policy", "train_policy.py"),
        ("evaluation", "evaluate.py"),
    ]
    run_dir, world_dir = tmp_path / "nplus-quick-seed2", tmp_path / "world"
    flags = {name: flags for name, _, flags in stages}

    def values(stage: str) -> dict[str, str]:
        return {f: flags[stage][i + 1] for i, f in enumerate(flags[stage][:-1]) if f.startswith("--")}

    sft, labels, reward, policy = values("sft"), values("labels"), values("reward"), values("policy")
    assert (sft["--base_model"], sft["--dataset"]) == (str(tmp_path / "base_model"), str(world_dir / "sft.jsonl"))
    assert flags["labels"][0] == "generate" and labels["--base_model"] == str(run_dir / "sft")
    assert (labels["--labeler"], labels["--num_labels"]) == ("vader", "2")  # best of 2, VADER the labeler
    assert (reward["--base_model"], reward["--labels.type"]) == (str(run_dir / "sft"), "best_of_2")
    assert policy["--base_model"] == str(run_dir / "sft") and policy["--rewards.trained_model"] == str(
        run_dir / "reward"
    )
    assert (policy["--ppo.value_model"], policy["--rewards.kl_estimator"], policy["--rewards.gold_model"]) == (
        "reward",
        "k1",
        "vader",
    )
    assert "--rewards.adaptive_kl.no_enabled" in flags["policy"] and policy["--seed"] == "2"
    for stage in ("labels", "reward", "policy"):  # one task: the world's prompts, responses that end at EOS
        assert "--task.end_at_eos" in flags[stage]
        assert values(stage)["--task.query_dataset"] == str(world_dir / "prompts.jsonl")
    assert values("evaluation")["--task.query_dataset"] == str(world_dir / "heldout_prompts.jsonl")
    written = json.loads((run_dir / "results.json").read_text())
    assert written == results and results["gold"]["margin"] == pytest.approx(0.75)
    assert results["reward_model"]["accuracy_after"] == 0.8 and results["recipe"] == "nplus"
