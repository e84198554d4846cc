"""demo/run_demo.py: the quick pipeline end to end (world, pretraining, labels, reward model, PPO, evaluation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_run_demo_quick_raises_gold_score(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(REPO / "demo" / "run_demo.py"), "--quick", "--output_dir", str(tmp_path)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    seed_dir = tmp_path / "quick-seed1"
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
    assert [point["policy"] for point in curve][1:] == ["update4", "update8", "policy"]
    assert abs(curve[0]["kl"]["mean"]) < 1e-3 < 0.3 < curve[-1]["kl"]["mean"]
