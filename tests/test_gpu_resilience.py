"""The GPU path's resilience across modules, checked on CPU: a process that cannot see the checkpoint process 0 resumes
from stops them all; --tf32 and --deterministic in every script that trains or samples. checkpoint.py's own part (each
process's GPU RNG state, process 0's resume decision, the saves in the background) is in tests/test_checkpoint.py."""

import os
import re
import time

import pytest
import torch

import evaluate
import label_generation
import train_policy
import train_reward
from lm_human_preference_details import devices, settings
from tests.planted import REPO, fake_checkpoint, free_port, write_query_file
from tests.test_multiprocess import run_all, torchrun

# ---------------------------------------------------------------- resume: process 0 decides, every process follows


SPLIT_OUTPUT_LAUNCHER = """
import os, sys
sys.path.insert(0, {repo!r})
from lm_human_preference_details import cli
import train_policy

# the same --output_dir path names another directory on each process, as on nodes whose --output_dir is a local disk
os.chdir(os.path.join(sys.argv[1], "node" + os.environ["RANK"]))
cli.run(train_policy.main, train_policy.parse, [*sys.argv[2:], "--output_dir", "out"])
"""


@pytest.mark.slow
def test_a_process_that_cannot_see_the_checkpoint_stops_every_process(tmp_path, tiny_model_dir):
    fake_checkpoint(tmp_path / "node0" / "out", 2, 2)  # only process 0 sees a checkpoint
    os.makedirs(tmp_path / "node1")
    launcher = tmp_path / "launch.py"
    launcher.write_text(SPLIT_OUTPUT_LAUNCHER.format(repo=str(REPO)))
    flags = ["--base_model", tiny_model_dir, "--task.query_dataset", str(write_query_file(tmp_path / "q.txt", 20))]
    flags += ["--rewards.trained_model", str(tmp_path / "reward"), "--resume", "auto"]
    start = time.time()
    codes, outputs, ended = run_all(torchrun(1, free_port(), launcher, str(tmp_path), *flags), 120, tmp_path)
    text = outputs[0]
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert codes != [0], text[-3000:]
    # every process raises the line at once; torchrun ends the others when the first one exits, maybe before they
    # print theirs: at least one, and no other error
    assert 1 <= len(errors) <= 2, text[-3000:]
    for line in errors:
        assert "process 1 of 2 cannot see checkpoint 'out/training_state/step2'" in line
        assert "--output_dir must be on a filesystem that every node sees" in line
    assert f'File "{REPO}' not in text and "resuming from" not in text  # no traceback of the project (torchrun's own)
    assert ended - start < 90  # no process waited for another until --dist_timeout (30 min)
    print(f"every process exited {ended - start:.1f} s after the start")


# ---------------------------------------------------------------- --tf32


@pytest.fixture
def float32_precision():
    """Restores torch's TF32 settings after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def test_use_tf32_sets_tf32_and_its_default_leaves_torch_as_it_was(float32_precision):
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    assert devices.use_tf32(False).startswith("off")
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    assert devices.use_tf32(True).startswith("on")
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("tf32", "tf32")


def dry_run_flags(script: str, tmp_path, model_dir: str) -> tuple[object, list[str]]:
    """A script module and the flags of a dry run of it that touches nothing."""
    out = ["--output_dir", str(tmp_path / "out")]
    if script == "evaluate":
        return evaluate, ["--policy", model_dir, "--reward_model", model_dir, *out, "--dry_run"]
    if script == "label_generation":
        return label_generation, [
            "generate",
            "--base_model",
            model_dir,
            "--output",
            str(tmp_path / "l.json"),
            "--dry_run",
        ]
    if script == "train_policy":  # a dry run checks its inputs: a reward with none to check
        return train_policy, [*out, "--rewards.trained_model", "vader", "--dry_run"]
    return train_reward, [*out, "--dry_run"]


@pytest.mark.parametrize("script", ["train_policy", "train_reward", "label_generation", "evaluate"])
def test_every_script_that_trains_or_samples_takes_tf32_and_shows_it(
    script, tmp_path, tiny_model_dir, capsys, float32_precision
):
    module, flags = dry_run_flags(script, tmp_path, tiny_model_dir)
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    module.main(module.parse(flags))
    assert re.search(r"TF32\s+│ off \(full float32, as OAI\)", capsys.readouterr().out)
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # the default leaves torch as it is
    module.main(module.parse([*flags, "--tf32"]))
    assert re.search(r"TF32\s+│ on \(matmuls in TF32", capsys.readouterr().out)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


@pytest.fixture
def legacy_tf32():
    """Restores torch's TF32 settings, the legacy flag included, after the test."""
    saved = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    generic = torch.backends.fp32_precision
    yield
    torch.set_float32_matmul_precision("highest")  # the legacy setting back off, so both APIs agree again
    torch.backends.fp32_precision = generic
    torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = saved


def accelerate_dynamo_tf32() -> None:
    """What accelerate's AcceleratorState does on a GPU for a config with a dynamo_backend and no mixed precision
    (accelerate/state.py; skipped on CPU, so done here)."""
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.parametrize(
    "set_tf32",
    [
        accelerate_dynamo_tf32,
        lambda: torch.set_float32_matmul_precision("high"),
        lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    ],
    ids=["accelerate-dynamo", "matmul-precision-high", "generic-precision"],
)
def test_tf32_turned_on_outside_the_flag_stops_the_run_and_the_flag_shows_what_torch_does(
    set_tf32, tmp_path, tiny_model_dir, capsys, legacy_tf32
):
    module, flags = dry_run_flags("train_reward", tmp_path, tiny_model_dir)
    set_tf32()
    with pytest.raises(ValueError, match=r"run in TF32 .* although --tf32 is not given.*dynamo_backend"):
        module.main(module.parse(flags))
    assert "off (full float32" not in capsys.readouterr().out  # never said
    module.main(module.parse([*flags, "--tf32"]))
    assert re.search(r"TF32\s+│ on \(matmuls in TF32", capsys.readouterr().out)


# ---------------------------------------------------------------- --deterministic


@pytest.mark.parametrize("script", ["train_policy", "train_reward", "label_generation", "evaluate"])
def test_deterministic_turns_on_torchs_deterministic_algorithms_and_shows_it(
    script, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    module, flags = dry_run_flags(script, tmp_path, tiny_model_dir)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # a setting under which cuBLAS is not deterministic
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    module.main(module.parse(flags))
    assert re.search(r"deterministic\s+│ off", capsys.readouterr().out)
    assert not torch.are_deterministic_algorithms_enabled()  # the default leaves torch as it is
    try:
        args = module.parse([*flags, "--deterministic"])
        module.main(args)
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
    assert re.search(r"deterministic\s+│ on \(deterministic GPU kernels", capsys.readouterr().out)
    assert settings.recorded(args)["deterministic"] is True  # in args.json and the training checkpoints' settings
