"""train_sft.py: the pairs' tokens (EOS appended, PAD distinct and never a target), the loss over exactly the tokens
nplus N10 names, its independence of micro-batches and processes, the cosine lr, the data order, end-to-end runs of
tiny GPT-2 and Llama-like (chat template) models whose output loads as --base_model, resume, and bad input."""

import json
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import get_cosine_schedule_with_warmup

import train_reward
import train_sft
from lm_human_preference_details import checkpoint, cli, validation
from lm_human_preference_details.modeling import PolicyWithValueHead, load_causal_lm
from lm_human_preference_details.nplus import sft_data
from lm_human_preference_details.resume_check import (
    final_training_state,
    max_metric_difference,
    max_weight_difference,
    saved_files,
    scalars,
)
from lm_human_preference_details.tokenizer import load_tokenizer, tokenizer_fingerprint
from tests import archs
from tests.conftest import tiny_gpt2
from tests.planted import REPO, free_port, run_script, script_env, without_gpus
from tests.test_resume import script_command, start_and_kill
from tests.test_stop_signal import signal_after

pytestmark = pytest.mark.usefixtures("single_thread")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""a small chat template for the Llama-like stand-in (its BOS, then one line per message)"""


def write_pairs(path, n: int = 32) -> str:
    """`n` learnable prompt/completion rows as a JSONL file (the completion repeats a word of the prompt)."""
    words = ["apples", "pears", "plums", "cherries"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            row = {"prompt": f"Name the fruit: {words[i % 4]}. ", "completion": f" {words[i % 4]} it is"}
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    return write_pairs(tmp_path_factory.mktemp("sft") / "pairs.jsonl")


def flags(model_dir: str, dataset: str, output_dir, *extra: str) -> list[str]:
    """A tiny run: 4 steps of 8 pairs, lr 1e-3, a checkpoint every 2 steps."""
    return [
        *("--base_model", model_dir, "--dataset", dataset, "--batch_size", "8", "--lr", "1e-3"),
        *("--save_interval", "2", *extra, "--output_dir", str(output_dir)),
    ]


def make_args(model_dir: str, dataset: str, output_dir="unused", *extra: str) -> train_sft.Args:
    return train_sft.parse(flags(model_dir, dataset, output_dir, *extra))


def plain_pairs(*rows: tuple[str, str]) -> sft_data.Pairs:
    return sft_data.Pairs([p for p, _ in rows], [c for _, c in rows], [False] * len(rows), "test")


def tokens_and_mask(pairs: sft_data.Pairs, tokenizer, loss_on: str = "all") -> sft_data.SftData:
    """The pairs tokenized as train_sft.py tokenizes them (at most 64 tokens), with its loss mask."""
    return train_sft.with_loss_mask(sft_data.tokenize_pairs(pairs, tokenizer, 64), tokenizer.pad_token_id, loss_on)


# ---------------------------------------------------------------- tokens and the loss


def test_eos_is_appended_and_pads_are_distinct_and_never_targets(tokenizer):
    pairs = plain_pairs(("  Say hi: ", " hi there"), ("Q: 1+1=", " 2"))
    data = tokens_and_mask(pairs, tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert pad != eos
    for row, (prompt, completion) in enumerate(zip(pairs.prompts, pairs.completions)):
        ids = tokenizer.encode(prompt.strip() + completion)  # query.strip() + completion (nplus N5)
        length = int(data.lengths[row])
        assert data.tokens[row, :length].tolist() == [*ids, eos]  # EOS appended (nplus N3)
        assert (data.tokens[row, length:] == pad).all()  # right-padded with PAD
        assert data.loss_mask[row, length - 1]  # EOS is a target
    assert not data.loss_mask[data.tokens == pad].any()
    assert not data.loss_mask[:, 0].any()


def test_rows_with_nothing_to_learn_are_dropped_and_counted(tokenizer):
    long_prompt = "Stop here, and say nothing more at all, not a single word." + tokenizer.eos_token
    pairs = plain_pairs(("Q: 1+1=", " 2"), ("", ""), (long_prompt, ""))
    everything = tokens_and_mask(pairs, tokenizer, "all")
    assert everything.empty == 1 and len(everything.tokens) == 2  # EOS alone: nothing predicts it
    completion = tokens_and_mask(pairs, tokenizer, "completion")
    assert completion.empty == 2 and len(completion.tokens) == 1  # a prompt ending in EOS and no completion
    assert completion.counted.tolist() == [2]  # " 2" and EOS
    assert completion.tokens.shape[1] == completion.lengths[0] < everything.tokens.shape[1]  # padded to the kept rows


def plain_loss(model, rows: list[list[int]], first_counted: list[int]) -> tuple[torch.Tensor, int]:
    """Sum and count of the next-token cross-entropy of each unpadded row from position first_counted on, one row at a
    time through the model's own forward (no PAD anywhere)."""
    total, count = torch.zeros(()), 0
    for ids, first in zip(rows, first_counted):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        total += losses[first - 1 :].sum()
        count += len(ids) - first
    return total, count


@pytest.mark.parametrize("loss_on", ["all", "completion"])
def test_loss_is_the_plain_cross_entropy_over_exactly_the_counted_tokens(tokenizer, loss_on):
    pairs = plain_pairs(("Name the fruit:", " apples it is"), ("A long prompt with many words in it:", " no"))
    data = tokens_and_mask(pairs, tokenizer, loss_on)
    model = tiny_gpt2()
    rows = [data.tokens[i, : data.lengths[i]].tolist() for i in range(2)]
    prompt_lengths = [len(tokenizer.encode(p.strip())) for p in pairs.prompts]
    first = prompt_lengths if loss_on == "completion" else [1, 1]
    expected, count = plain_loss(model, rows, first)
    with torch.no_grad():
        got = train_sft.next_token_loss_sum(model, data.tokens, data.loss_mask, tokenizer.pad_token_id)
    assert int(data.counted.sum()) == count
    if loss_on == "completion":  # the completion's tokens and EOS, nothing of the prompt
        assert data.counted.tolist() == [len(tokenizer.encode(c)) + 1 for c in pairs.completions]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_chat_rows_render_through_the_template_with_the_generation_prompt():
    tokenizer = archs.family_tokenizer("llama")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # as load_tokenizer adds it
    messages = [{"role": "user", "content": "name a fruit"}, {"role": "assistant", "content": "plums"}]
    prompt, completion = sft_data.render_chat(messages, tokenizer, "row 0")
    assert prompt == "<|begin_of_text|><|user|>name a fruit\n<|assistant|>" and completion == "plums\n"
    pairs = sft_data.Pairs([prompt], [completion], [True], "test")
    data = tokens_and_mask(pairs, tokenizer, "completion")
    ids = data.tokens[0, : data.lengths[0]].tolist()
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[-1] == tokenizer.eos_token_id  # one BOS, EOS appended
    counted = [t for t, m in zip(ids, data.loss_mask[0].tolist()) if m]
    assert tokenizer.decode(counted) == "plums\n" + tokenizer.eos_token


def test_lr_follows_transformers_cosine_schedule_without_warm_up():
    steps = 7
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-6)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=steps)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [3e-6 * train_sft.cosine_factor(step, steps) for step in range(steps)] == pytest.approx(expected, rel=1e-12)


def test_data_order_is_torch_random_samplers_after_seeding():
    torch.manual_seed(5)
    expected = list(torch.utils.data.RandomSampler(range(37)))
    assert train_sft.data_order(37, 5).tolist() == expected


# ---------------------------------------------------------------- runs


@pytest.mark.slow
def test_run_learns_saves_a_base_model_and_logs_the_cosine_lr(tmp_path, tiny_model_dir, pairs_file):
    out = tmp_path / "sft"
    run_script("train_sft.py", *flags(tiny_model_dir, pairs_file, out, "--eval_split", pairs_file))
    logged = scalars(out)
    steps = len(logged["train/loss"])
    assert steps == 4
    assert [v for _, v in logged["train/lr"]] == pytest.approx([1e-3 * train_sft.cosine_factor(s, 4) for s in range(4)])
    (_, before), (_, after) = logged["eval/loss"]
    assert after < before - 0.2, (before, after)  # the model learns the toy pairs (10.79 -> 10.47)
    # the output is a --base_model: a causal LM, the project's tokenizer with its PAD, args.json
    model = load_causal_lm(str(out))
    PolicyWithValueHead(model)
    assert tokenizer_fingerprint(load_tokenizer(str(out))) == tokenizer_fingerprint(load_tokenizer(tiny_model_dir))
    assert json.loads((out / "args.json").read_text())["loss_on"] == "all"
    assert not torch.equal(model.lm_head.weight, load_causal_lm(tiny_model_dir).lm_head.weight)
    reward_args = train_reward.parse(["--base_model", str(out), "--output_dir", str(tmp_path / "rm")])
    validation.check_reward_args(reward_args)  # train_reward.py's --base_model checks pass


@pytest.fixture(scope="module")
def llama_chat_dir(tmp_path_factory) -> str:
    """The Llama-like stand-in with a chat template."""
    directory = archs.save_family("llama", str(tmp_path_factory.mktemp("llama-chat")))
    tokenizer = archs.family_tokenizer("llama")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_llama_chat_rows_from_a_saved_datasets_directory_train_and_load(tmp_path, llama_chat_dir):
    import datasets

    words = ["red", "blue", "green", "black"]
    rows = [
        [{"role": "user", "content": f"the colour {words[i % 4]}"}, {"role": "assistant", "content": words[i % 4]}]
        for i in range(16)
    ]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": rows})}).save_to_disk(tmp_path / "chat")
    out = tmp_path / "sft"
    result = run_script(
        "train_sft.py", *flags(llama_chat_dir, f"hf:{tmp_path / 'chat'}", out, "--loss_on", "completion")
    )
    assert "16 used" in result.stdout
    model = load_causal_lm(str(out))
    assert model.config.model_type == "llama"
    assert tokenizer_fingerprint(load_tokenizer(str(out))) == tokenizer_fingerprint(load_tokenizer(llama_chat_dir))


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    return saved_files(output_dir, ("model.safetensors",))


def test_loss_and_update_do_not_depend_on_gradient_accumulation(tmp_path, tiny_model_dir, pairs_file):
    runs = {}
    for accum in (1, 4):
        out = tmp_path / f"accum{accum}"
        runs[accum] = train_sft.main(
            make_args(tiny_model_dir, pairs_file, out, "--gradient_accumulation_steps", str(accum))
        )
    # rows of different lengths: a mean of micro-batch means would weigh them differently
    assert runs[1]["train_last"] == pytest.approx(runs[4]["train_last"], rel=1e-6)
    assert max_weight_difference(final_weights(tmp_path / "accum4"), final_weights(tmp_path / "accum1")) <= 1e-6


@pytest.mark.slow
def test_two_processes_give_the_run_of_one(tmp_path, tiny_model_dir, pairs_file):
    train_sft.main(make_args(tiny_model_dir, pairs_file, tmp_path / "one"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    command += [str(REPO / "train_sft.py"), *flags(tiny_model_dir, pairs_file, tmp_path / "two")]
    done = subprocess.run(
        command, cwd=REPO, env=without_gpus(script_env()), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-5000:]
    one, two = scalars(tmp_path / "one"), scalars(tmp_path / "two")
    assert [v for _, v in two["train/loss"]] == pytest.approx([v for _, v in one["train/loss"]], rel=1e-6)
    assert max_weight_difference(final_weights(tmp_path / "two"), final_weights(tmp_path / "one")) <= 1e-6


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_model_dir, pairs_file):
    """The output directory of an uninterrupted run of 8 steps of 4 pairs."""
    output_dir = tmp_path_factory.mktemp("sft-whole") / "run"
    train_sft.main(make_args(tiny_model_dir, pairs_file, output_dir, "--batch_size", "4"))
    return output_dir


@pytest.mark.slow
def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, tiny_model_dir, pairs_file, whole_run):
    run_flags = ("--batch_size", "4")  # 8 steps, a checkpoint every 2
    killed = tmp_path / "killed"
    command = script_command("train_sft.py", flags(tiny_model_dir, pairs_file, killed, *run_flags))
    resumed_from = start_and_kill(command, killed, kill_after=2, delay=0.0)
    assert resumed_from < 8 and not (killed / "model.safetensors").exists()
    result = run_script("train_sft.py", *flags(tiny_model_dir, pairs_file, killed, *run_flags, "--resume", "auto"))
    assert f"resuming from {checkpoint.step_dir(str(killed), resumed_from)}" in result.stdout
    assert max_metric_difference(scalars(killed), scalars(whole_run), resumed_from) <= 1e-6
    assert max_weight_difference(final_weights(killed), final_weights(whole_run)) <= 1e-6
    assert max_weight_difference(final_training_state(killed), final_training_state(whole_run)) <= 1e-6


@pytest.mark.slow
def test_sigterm_saves_stops_and_resume_auto_finishes_like_an_uninterrupted_run(
    tmp_path, tiny_model_dir, pairs_file, whole_run
):
    run_flags = ("--batch_size", "4", "--save_interval", "1", "--keep_checkpoints", "0")  # 8 steps
    stopped = tmp_path / "stopped"
    command = script_command("train_sft.py", flags(tiny_model_dir, pairs_file, stopped, *run_flags))
    code, output, _ = signal_after(command, checkpoint.step_dir(str(stopped), 1), signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    step, path = checkpoint.list_checkpoints(str(stopped))[-1]
    assert 1 <= step < 8 and not (stopped / "model.safetensors").exists()
    assert f"stopped by SIGTERM after step {step} of 8; checkpoint {path}" in output
    train_sft.main(make_args(tiny_model_dir, pairs_file, stopped, *run_flags, "--resume", "auto"))
    assert max_weight_difference(final_weights(stopped), final_weights(whole_run)) <= 1e-6


def test_used_output_dir_stops_unless_resumed_or_overwritten(tmp_path, tiny_model_dir, pairs_file):
    out = tmp_path / "run"
    train_sft.main(make_args(tiny_model_dir, pairs_file, out, "--batch_size", "16"))
    with pytest.raises(ValueError, match="already holds another run .*--resume auto.*--overwrite_output_dir"):
        train_sft.main(make_args(tiny_model_dir, pairs_file, out, "--batch_size", "16"))
    resumed = train_sft.main(make_args(tiny_model_dir, pairs_file, out, "--batch_size", "16", "--resume", "auto"))
    assert resumed["steps"] == 2 and (out / "model.safetensors").exists()  # a finished run: saved again
    train_sft.main(make_args(tiny_model_dir, pairs_file, out, "--overwrite_output_dir", "--batch_size", "32"))
    assert [step for step, _ in checkpoint.list_checkpoints(str(out))] == [1]


# ---------------------------------------------------------------- bad input


def test_dry_run_checks_the_inputs_prints_the_sizes_and_writes_nothing(tmp_path, tiny_model_dir, pairs_file, capsys):
    out = tmp_path / "dry"
    assert train_sft.main(make_args(tiny_model_dir, pairs_file, out, "--dry_run", "--dry_run_processes", "4")) == {}
    printed = capsys.readouterr().out
    assert "32 used" in printed and "8 (2 per process)" in printed and "4 (one epoch)" in printed
    assert not out.exists()


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_bad_input_stops_with_one_line_naming_the_flag(tmp_path, tiny_model_dir, pairs_file):
    def error(dataset: str, *extra: str) -> str:
        with pytest.raises((ValueError, FileNotFoundError)) as stop:
            train_sft.main(make_args(tiny_model_dir, dataset, tmp_path / "out", "--dry_run", *extra))
        assert "\n" not in str(stop.value)
        return str(stop.value)

    missing = error(str(tmp_path / "missing.jsonl"))
    assert "--dataset" in missing and "does not exist" in missing
    other = error(write_jsonl(tmp_path / "other.jsonl", [{"question": "q", "answer": "a"}] * 8))
    assert "--prompt_column" in other and "question" in other
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}] * 8)
    assert "--base_model" in error(chat) and "no chat template" in error(chat)
    too_long = error(pairs_file, "--max_length", "4")
    assert "no usable pair" in too_long and "--max_length 4" in too_long
    assert "--dataset_split 'test' picks a split of an hf: --dataset" in error(pairs_file, "--dataset_split", "test")
    assert "--batch_size 8 does not split over 3 processes" in error(pairs_file, "--dry_run_processes", "3")
    assert "--gradient_accumulation_steps 3" in error(pairs_file, "--gradient_accumulation_steps", "3")
    assert "--batch_size 64 is more than the 32 usable pairs" in error(pairs_file, "--batch_size", "64")


def test_hf_dataset_column_or_split_that_does_not_exist_lists_those_that_do(tmp_path, tiny_model_dir):
    import datasets

    table = datasets.Dataset.from_dict({"question": ["q"] * 8, "completion": ["a"] * 8})
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "d")
    dataset = f"hf:{tmp_path / 'd'}"
    with pytest.raises(
        ValueError, match=r"--prompt_column 'prompt' is not a column .*its columns: question, completion"
    ):
        train_sft.main(make_args(tiny_model_dir, dataset, tmp_path / "out", "--dry_run"))
    with pytest.raises(ValueError, match=r"--eval_split 'validation' is not a split of --dataset .*its splits: train"):
        args = ("--prompt_column", "question", "--eval_split", "validation", "--dry_run")
        train_sft.main(make_args(tiny_model_dir, dataset, tmp_path / "out", *args))


def test_command_line_error_is_one_line(tmp_path, tiny_model_dir, capsys):
    argv = flags(tiny_model_dir, str(tmp_path / "none.jsonl"), tmp_path / "out")
    with pytest.raises(SystemExit) as stop:
        cli.run(train_sft.main, train_sft.parse, argv)
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --dataset '{tmp_path / 'none.jsonl'}' does not exist; pass a .jsonl file or hf:NAME_OR_DIR."
    )
