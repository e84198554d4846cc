"""train_both.py: one command trains the reward model and then the policy on the offline demo world, with the task
settings given once; killed during the policy stage, the same command keeps the finished reward model, resumes the
policy and ends with the outputs of an uninterrupted run. With --sft_dataset a supervised stage comes first, kept when
finished."""

import dataclasses
import json

import pytest

import train_both
from demo import sft_data
from demo import world as demo_world
from lm_human_preference_details import checkpoint, files
from lm_human_preference_details.settings import recorded, with_run
from tests.planted import file_digests, run_script, write_policy_planted_labels
from tests.test_resume import (
    max_metric_difference,
    max_weight_difference,
    saved_files,
    scalars,
    script_command,
    start_and_kill,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pipeline_world(tmp_path_factory, tokenizer, tiny_model_dir):
    """The demo world's query file and 40 best-of-4 labels on the tiny model's samples of its queries."""
    root = tmp_path_factory.mktemp("pipeline")
    files = demo_world.main(demo_world.Args(output_dir=str(root / "world"), num_pretrain=1, num_heldout=1))
    marker = tokenizer.encode(" happy")[0]
    labels = root / "labels.json"
    write_policy_planted_labels(labels, tiny_model_dir, tokenizer, files["queries"], 40, 16, 8, marker)
    return {"queries": files["queries"], "labels": str(labels)}


def pipeline_flags(model_dir: str, world: dict, output_dir) -> list[str]:
    """A tiny pipeline: shared task flags, 4 reward steps (8 labels held out), 4 policy updates."""
    return [
        *("--base_model", model_dir, "--task.query_dataset", world["queries"], "--task.query_length", "16"),
        *("--task.response_length", "8", "--task.truncate_token", "None", "--save_interval", "1"),
        *("--label_dataset", world["labels"], "--labels.num_train", "32", "--batch_size", "8", "--lr", "1e-3"),
        *("--rollout_batch_size", "16", "--normalize_samples", "16"),
        *("--ppo.total_episodes", "32", "--ppo.batch_size", "8", "--ppo.lr", "1e-3", "--ppo.noptepochs", "2"),
        *("--log_interval", "100", "--print_samples", "1", "--policy_stage.seed", "3"),
        *("--output_dir", str(output_dir)),
    ]


def test_route_flags_sends_shared_flags_to_both_and_others_to_their_stage():
    own, reward, policy = train_both.route_flags(
        ["--task", "tldr", "--seed=4", "--lr", "1e-4", "--ppo.lr", "2e-6", "--reward_stage.seed", "5", "--dry_run"]
    )
    assert own == {"dry_run": []}
    assert reward == ["--task", "tldr", "--seed", "4", "--lr", "1e-4", "--seed", "5"]
    assert policy == ["--task", "tldr", "--seed", "4", "--ppo.lr", "2e-6"]
    with pytest.raises(ValueError, match="--ppo.lrr is a flag of neither"):
        train_both.route_flags(["--ppo.lrr", "1"])
    # the line a stopped run ends with says "the same command and --resume auto": the pipeline takes it
    assert train_both.route_flags(["--resume", "auto"])[0] == {"resume": ["auto"]}
    with pytest.raises(ValueError, match="always resumes"):
        train_both.parse(["--resume", "models/x/training_state/step3"])


def test_sft_stage_takes_the_flags_all_stages_take_and_gives_its_model_to_the_others(tmp_path):
    flags = ["--sft_dataset", "sft.jsonl", "--base_model", "gpt2", "--seed", "4", "--lr", "1e-4"]
    flags += ["--sft_stage.lr", "1e-5", "--sft_stage.batch_size", "8", "--output_dir", str(tmp_path)]
    own, reward, policy, sft = train_both.route_stage_flags(flags)
    assert own == {"sft_dataset": ["sft.jsonl"], "output_dir": [str(tmp_path)]}
    assert sft == ["--base_model", "gpt2", "--seed", "4", "--lr", "1e-5", "--batch_size", "8"]  # not the reward's --lr
    assert reward == ["--base_model", "gpt2", "--seed", "4", "--lr", "1e-4"]
    assert policy == ["--base_model", "gpt2", "--seed", "4"]
    pipeline = train_both.parse(flags)
    sft_dir = str(tmp_path / "sft")
    assert (pipeline.sft.dataset, pipeline.sft.base_model, pipeline.sft.run.output_dir) == (
        "sft.jsonl",
        "gpt2",
        sft_dir,
    )
    assert (pipeline.sft.lr, pipeline.sft.batch_size, pipeline.sft.seed) == (1e-5, 8, 4)
    assert pipeline.reward.base_model == pipeline.policy.base_model == sft_dir and pipeline.reward.lr == 1e-4
    assert pipeline.commands[0].startswith("train_sft.py ") and len(pipeline.commands) == 3
    # without --sft_dataset: no SFT stage, the base model as given; an SFT flag then says what it lacks
    plain = train_both.parse([*flags[2:8], "--output_dir", str(tmp_path)])
    assert plain.sft is None and plain.reward.base_model == "gpt2" and len(plain.commands) == 2
    with pytest.raises(ValueError, match="--sft_stage.lr is a flag of the SFT stage, which runs only with --sft_dat"):
        train_both.parse(["--sft_stage.lr", "1e-5"])


def test_sft_stage_counts_as_finished_only_with_a_whole_args_json_of_these_settings(tmp_path):
    sft = train_both.parse(["--sft_dataset", "sft.jsonl", "--output_dir", str(tmp_path)]).sft
    args_json = tmp_path / "sft" / "args.json"
    args_json.parent.mkdir()
    assert not train_both.sft_finished(sft)  # nothing saved yet
    args_json.write_text(json.dumps(recorded(sft)), encoding="utf-8")
    assert train_both.sft_finished(sft)
    assert train_both.sft_finished(with_run(sft, save_interval=7))  # does not change what is trained
    assert not train_both.sft_finished(dataclasses.replace(sft, lr=1e-5))
    (tmp_path / "sft" / files.SAVING_MARKER).touch()  # its files being replaced
    assert not train_both.sft_finished(sft)
    (tmp_path / "sft" / files.SAVING_MARKER).unlink()
    args_json.write_text(args_json.read_text()[:40], encoding="utf-8")  # cut short
    assert not train_both.sft_finished(sft)


@pytest.mark.slow
def test_pipeline_runs_on_the_demo_world_and_resumes_after_a_kill(tmp_path, tiny_model_dir, pipeline_world, capsys):
    whole = tmp_path / "whole"
    pipeline = train_both.parse(pipeline_flags(tiny_model_dir, pipeline_world, whole))
    assert pipeline.policy.task == pipeline.reward.task and pipeline.policy.seed == 3 and pipeline.reward.seed == 1
    assert pipeline.commands[1].endswith(f"--rewards.trained_model {whole / 'reward_model'}")
    train_both.main(pipeline)
    reward_meta = json.loads((whole / "reward_model" / "reward_model.json").read_text())
    assert reward_meta["task"]["response_length"] == 8 and reward_meta["num_train"] == 32
    assert checkpoint.list_checkpoints(str(whole / "policy"))[-1][0] == 4
    # the same command again: a finished pipeline is reported and kept, every file (policy/summary.json too)
    finished = file_digests(whole)
    capsys.readouterr()
    train_both.main(train_both.parse(pipeline_flags(tiny_model_dir, pipeline_world, whole)))
    assert "policy training already finished: kept as it is" in capsys.readouterr().out
    assert file_digests(whole) == finished
    # another seed is another run: no --allow_resume_changes relabels the finished one
    other_seed = [*pipeline_flags(tiny_model_dir, pipeline_world, whole), "--seed", "2", "--allow_resume_changes"]
    with pytest.raises(ValueError, match="finished its 4 steps with other settings: seed: checkpoint 1, now 2") as stop:
        train_both.main(train_both.parse(other_seed))
    assert "another --output_dir" in str(stop.value)
    assert file_digests(whole) == finished

    # SIGKILL during the policy stage (its first checkpoint on disk), then the same command
    killed = tmp_path / "killed"
    killed.mkdir()
    flags = pipeline_flags(tiny_model_dir, pipeline_world, killed)
    start_and_kill(script_command("train_both.py", flags), killed / "policy", kill_after=1, delay=0.0)
    reward_files = {p.name: p.stat().st_mtime_ns for p in (killed / "reward_model").iterdir() if p.is_file()}
    capsys.readouterr()
    train_both.main(train_both.parse(flags))  # the same command again
    out = capsys.readouterr().out
    assert f"reward model: {killed / 'reward_model'} is finished with these settings; kept" in out
    assert "resuming from" in out and "pipeline done" in out
    assert {p.name: p.stat().st_mtime_ns for p in (killed / "reward_model").iterdir() if p.is_file()} == reward_files
    model = ("model.safetensors",)
    assert (
        max_weight_difference(saved_files(killed / "reward_model", model), saved_files(whole / "reward_model", model))
        == 0
    )
    names = ("model.safetensors", "value_head.safetensors")
    assert max_weight_difference(saved_files(killed / "policy", names), saved_files(whole / "policy", names)) <= 1e-6
    assert max_metric_difference(scalars(killed / "policy"), scalars(whole / "policy"), 0) <= 1e-6


@pytest.mark.slow
def test_pipeline_with_sft_keeps_a_finished_sft_model_and_resumes_after_a_kill(
    tmp_path, tiny_model_dir, pipeline_world
):
    # the supervised rows: a first sentence of the world and the next one; 16 rows, 2 steps of 8
    passages = open(pipeline_world["queries"], encoding="utf-8").read().splitlines()
    sft_rows = tmp_path / "sft.jsonl"
    sft_rows.write_text("".join(json.dumps(sft_data.sft_row(p)) + "\n" for p in passages[:16]), encoding="utf-8")
    sft_flags = ["--sft_dataset", str(sft_rows), "--sft_stage.lr", "1e-3", "--sft_stage.batch_size", "8"]
    whole = tmp_path / "whole"
    pipeline = train_both.parse([*pipeline_flags(tiny_model_dir, pipeline_world, whole), *sft_flags])
    train_both.main(pipeline)
    sft_args = json.loads((whole / "sft" / "args.json").read_text())
    assert (sft_args["base_model"], sft_args["dataset"]) == (tiny_model_dir, str(sft_rows))
    for stage in ("reward_model", "policy"):  # both start from the SFT model
        assert json.loads((whole / stage / "args.json").read_text())["base_model"] == str(whole / "sft")
    assert max_weight_difference(*(saved_files(d, ("model.safetensors",)) for d in (whole / "sft", tiny_model_dir))) > 0

    # SIGKILL in the reward stage (its first checkpoint on disk), then the same command: the SFT model is kept
    killed = tmp_path / "killed"
    killed.mkdir()
    flags = [*pipeline_flags(tiny_model_dir, pipeline_world, killed), *sft_flags]
    start_and_kill(script_command("train_both.py", flags), killed / "reward_model", kill_after=1, delay=0.0)
    sft_files = {p.name: p.stat().st_mtime_ns for p in (killed / "sft").iterdir() if p.is_file()}
    result = run_script("train_both.py", *flags)
    assert f"SFT model: {killed / 'sft'} is finished with these settings; kept" in result.stdout
    assert "resuming from" in result.stdout and "pipeline done" in result.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (killed / "sft").iterdir() if p.is_file()} == sft_files
    for stage, names in (("sft", ("model.safetensors",)), ("reward_model", ("model.safetensors",))):
        assert max_weight_difference(saved_files(killed / stage, names), saved_files(whole / stage, names)) == 0
    names = ("model.safetensors", "value_head.safetensors")
    assert max_weight_difference(saved_files(killed / "policy", names), saved_files(whole / "policy", names)) <= 1e-6
    assert max_metric_difference(scalars(killed / "policy"), scalars(whole / "policy"), 0) <= 1e-6
