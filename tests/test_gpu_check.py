"""benchmark/gpu_check.py, the GPU self-check, on CPU: every row reported, its figures finite, its equality checks
passing, and a failing or overrunning step reported without stopping the others."""

import importlib.util
import json
import math
import subprocess
import sys
import time

import pytest

from tests.planted import REPO, script_env
from tests.test_gpu_paths import HOST_SYNC_BUDGET

SPEC = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmark" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_check)

PPO_STEPS = ("fp32", "tf32_compile", "bf16", "fused", "successor")


@pytest.mark.slow
def test_quick_check_on_cpu_reports_every_row_and_a_failing_step_without_stopping_the_others(tmp_path):
    start = time.time()
    out = tmp_path / "check.json"
    command = [sys.executable, str(REPO / "benchmark" / "gpu_check.py"), "--quick", "--fail", "tf32"]
    command += ["--json", str(out), "--work_dir", str(tmp_path / "work")]
    done = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # the failing step fails the check
    assert "CPU: tiny shape, these are not GPU figures" in done.stdout
    for title in gpu_check.STEP_TITLES.values():
        assert title in done.stdout, title
    report = json.loads(out.read_text())
    rows = {row["step"]: row for row in report["steps"]}
    assert [row["step"] for row in report["steps"]] == list(gpu_check.STEPS)
    assert report["device"] == "cpu" and not report["ok"]
    assert rows["tf32"]["status"] == "FAILED" and "failing on purpose (--fail tf32)" in rows["tf32"]["detail"]
    assert "Traceback" in rows["tf32"]["error"]
    failed = {name: row["detail"] for name, row in rows.items() if name != "tf32" and row["status"] != "ok"}
    assert not failed, failed  # the steps after the failing one ran and passed
    assert rows["environment"]["figures"]["sampler_works"] is True
    assert all(rows["decoding"]["figures"]["equal"].values()) and len(rows["decoding"]["figures"]["equal"]) == 6
    for name in PPO_STEPS:
        figures = rows[name]["figures"]
        for key in ("seconds_per_update", "tokens_per_s", "peak_memory_gib", "rollout_s", "optimisation_s"):
            assert math.isfinite(figures[key]) and figures[key] > 0, (name, key, figures[key])
        # OAI's elapsed/fps: 8 episodes x 24 response tokens over the update's wall seconds
        assert figures["tokens_per_s"] == pytest.approx(8 * 24 / figures["seconds_per_update"], rel=0.05)
    for name in PPO_STEPS:  # counted by HostSyncCounter on CPU: the statistics copy alone
        assert 1 <= rows[name]["figures"]["syncs_per_update"] <= HOST_SYNC_BUDGET, rows[name]["figures"]
    assert rows["sft"]["figures"]["steps"] == 2 and math.isfinite(rows["sft"]["figures"]["loss"])
    group = rows["distributed"]["figures"]  # gloo on CPU, the decoding graph's eager stand-in
    assert group["backend"] == "gloo" and group["captures_over_3_updates"] == 1
    assert (
        group["dcp_weights_equal"] and group["dcp_adam_moments_equal"] and group["ddp_max_gradient_difference"] <= 1e-6
    )
    # the profile of one update: the matrix multiplies' share of the operators' time, and the top ones as a table
    profile = rows["profile"]["figures"]
    assert 0 < profile["matmul_share"] < 1 and 0 < len(profile["top_kernels"]) <= 10
    assert sum(kernel["share"] for kernel in profile["top_kernels"]) <= 1 + 1e-9
    assert any(kernel["name"] in ("aten::mm", "aten::addmm") for kernel in profile["top_kernels"])
    assert "one PPO update, host time of each operator (CPU): matrix multiplies" in done.stdout
    resume = rows["resume"]["figures"]
    assert resume["resumed_from_update"] == 2 and resume["checkpoints"] == [2, 4]
    assert resume["max_metric_difference"] <= 1e-6 and resume["max_weight_difference"] <= 1e-6
    print(f"gpu_check --quick on CPU: {time.time() - start:.0f} s ({report['seconds']:.0f} s by its own clock)")


def job(tmp_path, steps: tuple[str, ...], deadline: float, limits: dict | None = None) -> dict:
    """A worker's job as the check hands it over."""
    plan = gpu_check.make_plan("cpu", quick=True)
    return {
        "steps": steps,
        "plan": gpu_check.dataclasses.asdict(plan),
        "work_dir": str(tmp_path),
        "results": str(tmp_path / "results.jsonl"),
        "deadline": deadline,
        "limits": limits or {name: 60 for name in steps},
        "fail": [],
    }


def reported(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]


def test_a_step_past_its_limit_is_cut_and_the_next_one_still_runs(tmp_path, monkeypatch):
    def run_step(name, plan, work_dir):
        if name == "fp32":
            time.sleep(30)  # cut after 1 s
        return {"seconds_per_update": 1.0}, f"{name} ran"

    monkeypatch.setattr(gpu_check, "run_step", run_step)
    start = time.time()
    gpu_check.worker_main(job(tmp_path, ("fp32", "bf16"), time.time() + 600, {"fp32": 1, "bf16": 60}))
    rows = reported(tmp_path)
    assert time.time() - start < 10
    assert [(row["step"], row["status"]) for row in rows] == [("fp32", "TIMED OUT"), ("bf16", "ok")]
    assert rows[0]["detail"] == "cut at its limit of 1 s" and rows[1]["detail"] == "bf16 ran"


def test_steps_without_time_left_in_the_budget_are_skipped_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_step", lambda name, plan, work_dir: ({}, "ran"))
    gpu_check.worker_main(job(tmp_path, ("environment", "resume"), time.time() + gpu_check.MIN_STEP_S - 5))
    rows = reported(tmp_path)
    assert [row["status"] for row in rows] == ["SKIPPED", "SKIPPED"]
    assert rows[0]["detail"].startswith("time budget spent")


def test_a_step_whose_process_dies_is_reported_and_the_steps_after_it_as_not_run(tmp_path, monkeypatch):
    # a stand-in worker: reports its first step, then dies as a crashing CUDA process would
    worker = tmp_path / "dying_worker.py"
    worker.write_text(
        "import json, os, sys\n"
        "job = json.loads(sys.argv[2])\n"
        "row = {'step': job['steps'][0], 'title': 't', 'status': 'ok', 'seconds': 1.0, 'figures': {}, 'detail': '',"
        " 'error': ''}\n"
        "open(job['results'], 'a').write(json.dumps(row) + '\\n')\n"
        "os._exit(3)\n"
    )
    monkeypatch.setattr(gpu_check, "__file__", str(worker))
    (tmp_path / "logs").mkdir()
    plan = gpu_check.make_plan("cpu", quick=True)
    rows = gpu_check.run_group(
        ("environment", "fp32", "resume"), plan, gpu_check.Args(), str(tmp_path), time.time() + 60
    )
    assert [(row["step"], row["status"]) for row in rows] == [
        ("environment", "ok"),
        ("fp32", "FAILED"),
        ("resume", "NOT RUN"),
    ]
    assert "its process ended (exit 3) during the step" in rows[1]["detail"]


def test_a_gpu_that_torch_cannot_use_fails_the_environment_step(tmp_path, monkeypatch):
    plan = gpu_check.make_plan("cpu", quick=True)
    figures, detail = gpu_check.environment_step(plan, str(tmp_path))
    assert figures["sampler_works"] is True and "no CUDA device" in detail
    monkeypatch.setattr(gpu_check, "nvidia_gpu_present", lambda: True)  # a CPU-only torch on a GPU machine
    with pytest.raises(gpu_check.CheckFailed, match="has an NVIDIA GPU but torch .* cannot use it"):
        gpu_check.environment_step(plan, str(tmp_path))
