"""lm_human_preference_details/tracking.py: TensorBoard scalars, a resumed run's points, wandb offline, nothing
written by a process other than the main one."""

import os
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lm_human_preference_details import tracking
from lm_human_preference_details.tracking import Tracker


def read_tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series in the TensorBoard event files under tb_dir."""
    accumulator = EventAccumulator(str(tb_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tracker_writes_tensorboard_scalars(tmp_path):
    tracker = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True)
    tracker.log({"objective/score": 0.25, "ppo/loss/total": torch.tensor(1.5)}, step=3)
    tracker.log({"objective/score": 0.5}, step=4)
    tracker.log_table("samples", ["query", "response"], [["a", "b"]], step=4)
    tracker.close()
    scalars = read_tb_scalars(tmp_path / "tb")
    assert scalars["objective/score"] == [(3, 0.25), (4, 0.5)]
    assert scalars["ppo/loss/total"] == [(3, 1.5)]
    assert not (tmp_path / "wandb").exists()


def test_resumed_tracker_points_replace_the_killed_runs_even_within_the_same_second(tmp_path):
    killed = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True)
    for step in (0, 1):
        killed.log({"objective/score": float(step)}, step=step)
    killed.close()
    # the killed run's file as another host would have named it in this very second: it sorts after this host's
    (old,) = os.listdir(tmp_path / "tb")
    now = int(time.time())
    os.rename(tmp_path / "tb" / old, tmp_path / "tb" / f"events.out.tfevents.{now:010d}.zzzz.1.0")
    resumed = Tracker(str(tmp_path), False, "project", None, "run", {"seed": 1}, is_main=True, purge_step=1)
    for step in (1, 2):
        resumed.log({"objective/score": 10.0 + step}, step=step)
    resumed.close()
    assert sorted(os.listdir(tmp_path / "tb"))[0].startswith(f"events.out.tfevents.{now:010d}.zzzz")
    assert read_tb_scalars(tmp_path / "tb")["objective/score"] == [(0, 0.0), (1, 11.0), (2, 12.0)]


def test_tracker_wandb_offline_creates_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    out = tmp_path / "out"
    tracker = Tracker(str(out), True, "project", None, "my-run", {"seed": 1, "lr": 1e-5}, is_main=True)
    assert tracker.run.offline
    assert tracker.run.name == "my-run"
    assert tracker.run.config["lr"] == 1e-5
    tracker.log({"objective/score": 0.25}, step=1)
    tracker.log_table("samples", ["query", "response"], [["a", "b"]], step=1)
    tracker.close()
    run_dirs = list((out / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1
    assert list(run_dirs[0].glob("run-*.wandb"))
    assert list(run_dirs[0].glob("files/media/table/samples_*.table.json"))
    assert read_tb_scalars(out / "tb")["objective/score"] == [(1, 0.25)]


def test_tracker_non_main_process_writes_nothing(tmp_path, monkeypatch):
    def fail_init(*args, **kwargs):
        raise AssertionError("wandb.init must not run on a non-main process")

    monkeypatch.setattr(tracking.wandb, "init", fail_init)
    out = tmp_path / "out"
    tracker = Tracker(str(out), True, "project", None, "run", {"seed": 1}, is_main=False)
    tracker.log({"objective/score": 0.25}, step=1)
    tracker.log_table("samples", ["query"], [["a"]], step=1)
    tracker.close()
    assert not out.exists()
