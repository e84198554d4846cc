"""Damaged checkpoints: a truncated, altered or non-finite file names itself and the newest intact checkpoint;
--resume auto moves it aside (never deletes it) and continues from that one; what an interrupted save left is tidied."""

import json
import os
import shutil

import pytest
import torch

import train_policy
from lm_human_preference_details import checkpoint, resumable
from tests.test_resume import finished_run, max_weight_difference, policy_world  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("single_thread")


def copy_run(finished_run, tmp_path, name: str = "run") -> tuple[str, list[str]]:  # noqa: F811
    """A copy of the 2-update run (checkpoints step1 and step2) as a kill after its last checkpoint left it, before its
    summary.json (a finished run is kept as it is: its checkpoints are never resumed); -> its directory and flags."""
    output_dir, flags = finished_run
    run_dir = tmp_path / name
    shutil.copytree(output_dir, run_dir)
    (run_dir / resumable.SUMMARY_FILE).unlink()
    return str(run_dir), [*flags[:-2], "--output_dir", str(run_dir)]


def truncate(path: str) -> None:
    """Cut a file to half its bytes, as a disk that filled up or a copy that stopped midway."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def forget_digests(step: str) -> None:
    """Make `step` look like a checkpoint written before checkpoint.json recorded its files' digests."""
    meta_path = os.path.join(step, checkpoint.META_FILE)
    meta = json.loads(open(meta_path).read())
    del meta["files"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def final_weights(run_dir: str) -> dict[str, torch.Tensor]:
    """Weights and Adam moments of a run's newest checkpoint."""
    state = torch.load(os.path.join(checkpoint.latest_checkpoint(run_dir), "state.pt"), weights_only=True)
    tensors = dict(state["policy"])
    for index, moments in state["optimizer"]["state"].items():
        tensors.update({f"adam.{index}.{k}": v for k, v in moments.items() if isinstance(v, torch.Tensor)})
    return tensors


@pytest.mark.parametrize(
    "name, digests",
    [
        ("state.pt", True),
        ("state.pt", False),
        ("rng_rank0.pt", True),
        ("rng_rank0.pt", False),
        ("checkpoint.json", True),
    ],
)
def test_a_truncated_checkpoint_file_names_itself_and_resume_auto_takes_the_previous_one(
    finished_run,  # noqa: F811
    tmp_path,
    capsys,
    name,
    digests,
):
    run_dir, flags = copy_run(finished_run, tmp_path)
    step1, step2 = checkpoint.step_dir(run_dir, 1), checkpoint.step_dir(run_dir, 2)
    if not digests:
        forget_digests(step2)
    truncate(os.path.join(step2, name))
    damaged_bytes = open(os.path.join(step2, name), "rb").read()
    # --resume PATH: one line naming the checkpoint, the file and the intact one before it; nothing moved
    with pytest.raises(ValueError) as stop:
        train_policy.main(train_policy.parse([*flags, "--resume", step2]))
    message = str(stop.value)
    assert message.startswith(f"checkpoint '{step2}' is damaged ({name}: "), message
    assert f"the newest intact checkpoint before it is '{step1}': pass --resume {step1}, or --resume auto" in message
    assert "\n" not in message and os.path.isdir(step2)
    # --resume auto: says so in one line, moves the damaged checkpoint aside (kept whole) and continues from step1
    history = train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    out = capsys.readouterr().out
    assert f"warning: checkpoint '{step2}' is damaged ({name}: " in out
    assert "moved it aside to 'step2.damaged'" in out and f"resuming from {step1} after 1 of 2" in out
    assert len(history) == 1 and history[0]["elapsed/updates"] == 2
    assert open(os.path.join(f"{step2}.damaged", name), "rb").read() == damaged_bytes
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [1, 2]  # step2 written again, whole
    assert checkpoint.find_damage(step2) is None
    if name == "state.pt" and digests:
        # the same run as one resumed from step1 directly
        direct_dir, direct_flags = copy_run(finished_run, tmp_path, "direct")
        train_policy.main(train_policy.parse([*direct_flags, "--resume", checkpoint.step_dir(direct_dir, 1)]))
        assert max_weight_difference(final_weights(run_dir), final_weights(direct_dir)) == 0


def test_a_flipped_bit_in_a_checkpoint_is_found_by_its_digest(finished_run, tmp_path, capsys):  # noqa: F811
    run_dir, flags = copy_run(finished_run, tmp_path)
    state = os.path.join(checkpoint.step_dir(run_dir, 2), "state.pt")
    with open(state, "r+b") as f:  # a bit in the middle of the tensor data: torch.load reads it without complaint
        f.seek(os.path.getsize(state) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    assert torch.load(state, weights_only=True)["policy"]
    history = train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    out = capsys.readouterr().out
    assert "(state.pt: its bytes differ from those saved (SHA-256 mismatch" in out and "step2.damaged" in out
    assert len(history) == 1 and history[0]["elapsed/updates"] == 2


@pytest.mark.parametrize("digests", [True, False])
def test_non_finite_weights_in_a_checkpoint_are_blamed_on_the_file_not_the_learning_rate(
    finished_run,  # noqa: F811
    tmp_path,
    digests,
):
    # a bit flipped in memory before the save: the file is whole and its digest matches, but a weight is NaN
    run_dir, flags = copy_run(finished_run, tmp_path)
    step1 = checkpoint.step_dir(run_dir, 1)
    state_path = os.path.join(step1, "state.pt")
    state = torch.load(state_path, weights_only=True)
    name = next(iter(state["policy"]))
    state["policy"][name].view(-1)[3] = float("nan")
    torch.save(state, state_path)
    meta_path = os.path.join(step1, checkpoint.META_FILE)
    meta = json.loads(open(meta_path).read())
    meta.pop("files", None)  # without digests: a checkpoint written before checkpoint.json recorded them
    if digests:
        meta["files"] = checkpoint.file_digests(step1)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError) as stop:
        train_policy.main(train_policy.parse([*flags, "--resume", step1]))
    message = str(stop.value)
    assert message.startswith(f"checkpoint '{step1}' is damaged (state.pt: non-finite (NaN or infinite) values in ")
    assert f"policy.{name}" in message and "lr" not in message
    assert "no checkpoint before it is intact: pass --resume auto" in message


def test_a_stale_partial_save_is_removed_at_the_next_start_and_said(finished_run, tmp_path, capsys):  # noqa: F811
    run_dir, flags = copy_run(finished_run, tmp_path)
    root = checkpoint.state_dir(run_dir)
    # a run stopped at once (a second Ctrl-C) while it wrote checkpoint 3, and a replace of step2 cut after its copy
    partial = os.path.join(root, ".step3.partial")
    os.makedirs(partial)
    with open(os.path.join(partial, "state.pt"), "wb") as f:
        f.write(b"\0" * 2_000_000)
    shutil.copytree(checkpoint.step_dir(run_dir, 2), os.path.join(root, ".step2.old"))
    train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    out = capsys.readouterr().out
    size = sum(os.path.getsize(e.path) for e in os.scandir(checkpoint.step_dir(run_dir, 2))) + 2_000_000
    line = f"{root}: removed .step2.old, .step3.partial ({size / 1e6:.1f} MB), left by a run stopped while it saved"
    assert line in out
    assert sorted(os.listdir(root)) == ["step1", "step2"]


def test_resume_auto_with_every_checkpoint_damaged_stops_and_keeps_them(finished_run, tmp_path):  # noqa: F811
    run_dir, flags = copy_run(finished_run, tmp_path)
    for step in (1, 2):
        truncate(os.path.join(checkpoint.step_dir(run_dir, step), "state.pt"))
    with pytest.raises(ValueError, match=r"--resume auto: every checkpoint in .* is damaged \(step2: state.pt: "):
        train_policy.main(train_policy.parse([*flags, "--resume", "auto"]))
    assert sorted(os.listdir(checkpoint.state_dir(run_dir))) == ["step1.damaged", "step2.damaged"]


def test_the_pipeline_continues_a_reward_stage_whose_last_checkpoint_is_damaged(tmp_path):
    import train_both
    import train_reward

    out = tmp_path / "reward_model"
    step = checkpoint.step_dir(str(out), 6)
    os.makedirs(step)
    (out / train_both.REWARD_CONFIG_FILE).write_text("{}")
    with open(os.path.join(step, checkpoint.META_FILE), "w") as f:
        f.write('{"step": 6, "settings": {"se')  # cut short
    # not finished: the reward stage runs with --resume auto, which moves the checkpoint aside
    assert train_both.reward_model_finished(train_reward.parse(["--output_dir", str(out)])) is False
