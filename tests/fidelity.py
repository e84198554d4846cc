"""Helpers of the fidelity tests: run a script's `main` in-process as one rank of a pretended 2-process job, record
the tensors each step produces, and re-derive expected values independently (NumPy, plain Hugging Face forwards).

The recorders wrap the project's public functions and classes; they never change what those return.
"""

import contextlib
import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lm_human_preference_details import checkpoint, distributed
from tests.conftest import cpu_accelerator

# ---------------------------------------------------------------- a pretended second process


class FakeWorld:
    """An Accelerator that says it is rank `rank` of `world` processes; collectives combine this process's tensor
    with `other(tensor)`, the tensor a pretended other rank holds. Everything else is a real single-process
    Accelerator."""

    def __init__(self, rank: int, world: int = 2, other=None):
        self._real = cpu_accelerator()
        self.process_index = self.local_process_index = rank
        self.num_processes = world
        self.is_main_process = self.is_local_main_process = rank == 0
        self._other = other or (lambda t: t.clone())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @property
    def device(self) -> torch.device:
        return self._real.device

    def _ranks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The tensor of every rank, in rank order."""
        others = [self._other(tensor) for _ in range(self.num_processes - 1)]
        return [*others[: self.process_index], tensor, *others[self.process_index :]]

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._ranks(tensor))

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        total = torch.stack(self._ranks(tensor)).sum(0)
        return total * scale / (self.num_processes if reduction == "mean" else 1)

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        pass


def shift_nonzero(tensor: torch.Tensor) -> torch.Tensor:
    """The other rank's statistics in the policy runs: every non-zero entry + 1 (zero counters stay zero)."""
    return torch.where(tensor == 0, tensor, tensor + 1)


def reduced_mean(local: float) -> float:
    """What a mean over this rank and a `shift_nonzero` rank gives."""
    return local if local == 0 else local + 0.5


# ---------------------------------------------------------------- recording


def detach(value: Any) -> Any:
    """A detached CPU copy of tensors (in tuples, lists and dicts); parameters and other values as they are."""
    if isinstance(value, torch.nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(detach(v) for v in value)
    if isinstance(value, dict):
        return {k: detach(v) for k, v in value.items()}
    return value


@dataclass
class Event:
    kind: str
    inputs: Any = None
    output: Any = None


class Recorder:
    """An ordered log of the calls of the wrapped functions."""

    def __init__(self):
        self.events: list[Event] = []

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def index(self, event: Event) -> int:
        return next(i for i, e in enumerate(self.events) if e is event)

    def wrap(self, kind: str, fn, extra=None, output=None, call: bool = True):
        """fn, with each call logged under `kind`: its arguments by name (tensors copied, modules kept) plus
        extra(arguments) taken before the call, and output(result, arguments) after it (default: a copy)."""
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            event = Event(kind, {**detach(arguments), **(extra(arguments) if extra else {})})
            self.events.append(event)
            if not call:
                return None
            result = fn(*args, **kwargs)
            event.output = output(result, arguments) if output else detach(result)
            return result

        return wrapper


def patch_everywhere(monkeypatch, name: str, make, modules) -> None:
    """Replace `name` by make(original) in every module of `modules` that has it (scripts may import it by name)."""
    patched = False
    for module in modules:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, make(getattr(module, name)))
            patched = True
    assert patched, f"none of {[m.__name__ for m in modules]} has {name}"


def recorded_data_parallel(recorder: Recorder) -> tuple:
    """`distributed.data_parallel` and `distributed.averaging_gradients` of the pretended ranks: the module itself is
    the data-parallel module (no process group to build DDP on); a micro-batch through it that averages (an optimizer
    step's last) is logged as `allreduce_gradients` with the module's parameters once its backward is done, where
    DDP's all-reduces of the last buckets finish, before the step. A module that did not come from `data_parallel`
    averages nothing, as a module outside DDP."""
    wrapped = set()

    def data_parallel(module: torch.nn.Module, accelerator, fsdp: bool = False) -> torch.nn.Module:
        wrapped.add(id(module))
        return module

    @contextlib.contextmanager
    def averaging_gradients(trained: torch.nn.Module, average: bool):
        yield
        if average and id(trained) in wrapped:
            recorder.events.append(Event("allreduce_gradients", {"params": list(trained.parameters())}))

    return data_parallel, averaging_gradients


def patch_collectives(monkeypatch, recorder: Recorder, modules) -> None:
    """Weight broadcasts and gradient all-reduces become recorded no-ops (the pretended ranks hold equal weights and
    equal gradients, so the real collectives would not change them; `recorded_data_parallel`); the run name skips its
    broadcast."""
    patch_everywhere(
        monkeypatch, "broadcast_parameters", lambda fn: recorder.wrap("broadcast_parameters", fn, call=False), modules
    )
    data_parallel, averaging_gradients = recorded_data_parallel(recorder)
    patch_everywhere(monkeypatch, "data_parallel", lambda fn: data_parallel, modules)
    patch_everywhere(monkeypatch, "averaging_gradients", lambda fn: averaging_gradients, modules)
    patch_everywhere(monkeypatch, "run_name", lambda fn: lambda accelerator, *parts: "fidelity-run", modules)


def fake_world(monkeypatch, modules, rank: int, other=None) -> None:
    """Scripts in `modules` get a FakeWorld accelerator; the pretended other process writes no checkpoint files, so it
    hands over no digests of them."""
    patch_everywhere(
        monkeypatch, "make_accelerator", lambda fn: lambda *_: FakeWorld(rank, 2, other), [distributed, *modules]
    )
    monkeypatch.setattr(checkpoint, "_handed_digests", lambda directory, rank: {})


def state_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of a module's state dict."""
    return {k: v.detach().cpu().clone() for k, v in copy.copy(module.state_dict()).items()}


# ---------------------------------------------------------------- a small world


WORDS = [" the", " a", " and", " of", " to", " in", " was", " he", " she", " it", " on", " with", " happy", " sad"]
VOCAB_SIZE = 16_000
"""the first GPT-2 ids: they cover WORDS, the corpus below and the task affixes, and sampling over them is fast"""


def write_corpus(path) -> str:
    """80 distinct passages of 4 to 13 tokens: 12-token queries are truncated or right-padded."""
    path.write_text("\n".join(f"Story {i}:" + " the cat walked" * (i % 4) + " home." for i in range(80)) + "\n")
    return str(path)


def word_sampler_dir(path, tokenizer) -> str:
    """A tiny GPT-2 over the first VOCAB_SIZE ids that samples (about uniformly) only WORDS; with the tokenizer."""
    from tests.conftest import tiny_gpt2

    model = tiny_gpt2(0, vocab_size=VOCAB_SIZE)
    words = [tokenizer.encode(word)[0] for word in WORDS]
    with torch.no_grad():
        # hidden dim 0 is a constant 10 after ln_f; the tied embedding's dim 0 is +1 for WORDS, -1 otherwise
        model.transformer.ln_f.weight[0] = 0.0
        model.transformer.ln_f.bias[0] = 10.0
        model.transformer.wte.weight[:, 0] = -1.0
        model.transformer.wte.weight[words, 0] = 1.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- independent re-derivations


def np_whiten(x: np.ndarray, shift_mean: bool = True) -> np.ndarray:
    """OAI's whiten over all entries: population variance, eps 1e-8, mean added back unless shift_mean."""
    x = x.astype(np.float64)
    mean, var = x.mean(), x.var()
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out if shift_mean else out + mean


def np_gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """GAE with the episode ending after the last token: advantages and returns = advantages + values."""
    rewards, values = rewards.astype(np.float64), values.astype(np.float64)
    advantages = np.zeros_like(rewards)
    last = np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    return advantages, advantages + values


def np_truncate(responses: np.ndarray, token: int, after: int, pad: int) -> np.ndarray:
    """Tokens after the first `token` at index >= after become PAD (row by row, plain loops)."""
    out = responses.copy()
    for row in out:
        hits = [t for t in range(after, len(row)) if row[t] == token]
        if hits:
            row[hits[0] + 1 :] = pad
    return out


def np_passes(responses: np.ndarray, token: int, after: int) -> np.ndarray:
    """True where `token` occurs at some index >= after."""
    return np.array([token in row[after:].tolist() for row in responses])


def hf_response_outputs(lm, tokens: torch.Tensor, context_length: int, pad: int, temperature: float):
    """Plain Hugging Face forward of a GPT-2 LM with OAI's pads (masked keys, exclusive-cumsum positions): the
    tempered log-softmax (B, L, V) and the final hidden states (B, L, D) at the positions predicting the response.
    The positions used here must hold real tokens (true when the context ends with a real token)."""
    mask = tokens != pad
    positions = torch.cumsum(mask.long(), 1) - mask.long()
    with torch.no_grad():
        out = lm.transformer(input_ids=tokens.masked_fill(~mask, 0), attention_mask=mask.long(), position_ids=positions)
        hidden = out.last_hidden_state[:, context_length - 1 : -1]
        logits = lm.lm_head(hidden).double() / temperature
    assert bool(mask[:, context_length - 1 : -1].all()), "choose contexts that end with a real token"
    return torch.log_softmax(logits, -1), hidden.double()
