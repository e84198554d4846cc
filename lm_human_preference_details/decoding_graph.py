"""The decoding step of `sample(..., compile=True)`, captured once per shape as a CUDA graph and replayed.

The captured step is a function of static buffers only. Per sampling call the host copies the episode's key mask and
the first sampled token, position and cache slot into them; per step it copies the step's B uniforms in, replays the
graph and copies B tokens, log-probs and values out (24 bytes per episode). Inside the graph the token, position
and slot advance for the next step, and the policy's weights and the KV cache (a StaticCache written one slot per step)
are read and written where they live: the graph holds their addresses and nothing copies them.

torch.compile's `cudagraphs` backend, which this replaces, treats none of the compiled function's inputs as static:
since torch 2.5 the module's weights are inputs of the graph, so every replay first copied all weights and the whole
KV cache into the graph's own input buffers, and its functionalized cache update rewrote the whole cache out of place
and copied it back (docs/gpu.md, "Fast decoding"). The step captured here runs the eager kernels as they are, so the
samples stay those of eager decoding, bit for bit.

A graph stays valid while the shapes and the tensors it reads stay where they are: `DecodingGraphs.get` keys each
policy's graph on the batch, the cache length, the constants baked into the step (PAD id, temperature, autocast) and
the address, dtype and shape of every parameter and buffer. Adam's in-place updates keep the addresses (the graph then
reads the new weights), as does a resume's `load_state_dict` (it copies into them); a load that assigns new tensors
or a `.to()` onto another device or dtype makes a new capture.

Devices without CUDA graphs (CPU) run the same buffers and the same sequence of warm-up, capture and replay, with
`EagerStepGraph` standing in for the CUDA graph: its replay runs the step eagerly.
"""

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn as nn

WARM_UP_STEPS = 3
"""eager steps on the capture stream before the capture: torch's CUDA graph recipe warms up a few iterations on a side
stream so that lazy initialisations (cuBLAS handles and workspaces, the allocator's blocks) happen outside the capture;
they are real decoding steps, so the warm-up costs no extra work"""

StepFunction = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""(token (B, 1), position (B, 1), slot (1,), key mask (B, K), uniform (B, 1)) -> next token, log-prob, value (B,)"""


class StepGraph(Protocol):
    """What `DecodingGraph` needs of a graph: eager steps before the capture, one capture, replays."""

    def eager(self) -> contextlib.AbstractContextManager: ...

    def capture(self, step: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """A `torch.cuda.CUDAGraph`, warmed up and captured on its own side stream and replayed on the current stream."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device=device)
        self.graph = torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the block on the capture stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        current.wait_stream(self.stream)

    def capture(self, step: Callable[[], None]) -> None:
        """Record `step`'s kernels (nothing runs). `thread_local`: CUDA calls of other threads do not break it."""
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
            step()

    def replay(self) -> None:
        self.graph.replay()


class EagerStepGraph:
    """The stand-in on devices without CUDA graphs: `replay` runs the captured step eagerly, on the same buffers."""

    def __init__(self, device: torch.device):
        self.step: Callable[[], None] | None = None

    def eager(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def capture(self, step: Callable[[], None]) -> None:
        self.step = step

    def replay(self) -> None:
        self.step()


def new_step_graph(device: torch.device) -> StepGraph:
    """A CUDA graph on CUDA devices, elsewhere the eager stand-in (tests replace this function to record captures)."""
    return CudaStepGraph(device) if device.type == "cuda" else EagerStepGraph(device)


class DecodingGraph:
    """One policy's decoding step at one shape: its KV cache, the step's static buffers and its graph.

    `start` once per sampling call, then `step` once per decoding step: the first WARM_UP_STEPS steps of the graph's
    life run eagerly (on the capture stream), the next one captures the step and replays it, every later one replays.
    """

    def __init__(self, step: StepFunction, cache, batch_size: int, key_length: int, device: torch.device):
        self.cache = cache
        self._step = step
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.key_mask = torch.zeros(batch_size, key_length, dtype=torch.bool, device=device)
        self.uniform = torch.zeros(batch_size, 1, dtype=torch.float64, device=device)
        self.logprob = torch.zeros(batch_size, dtype=torch.float32, device=device)
        self.value = torch.zeros(batch_size, dtype=torch.float32, device=device)
        self.graph = new_step_graph(device)
        self.eager_steps = 0
        self.captured = False

    def start(self, key_mask: torch.Tensor, token: torch.Tensor, position: torch.Tensor, slot: int) -> None:
        """A sampling call's state after its prefill: key mask (B, K), first token (B,), its position (B, 1), slot."""
        self.key_mask.copy_(key_mask)
        self.token.copy_(token[:, None])
        self.position.copy_(position)
        self.slot.fill_(slot)

    def step(self, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoding step with this step's uniforms (B, 1): the token, log-prob and value (B,), as views of the
        static buffers that the next step overwrites (copy them out)."""
        self.uniform.copy_(uniform)
        if self.captured:
            self.graph.replay()
        elif self.eager_steps < WARM_UP_STEPS:
            with self.graph.eager():
                self._advance()
            self.eager_steps += 1
        else:
            self.graph.capture(self._advance)
            self.captured = True
            self.graph.replay()
        return self.token[:, 0], self.logprob, self.value

    def _advance(self) -> None:
        """The captured step: reads and writes the static buffers and the cache only."""
        token, logprob, value = self._step(self.token, self.position, self.slot, self.key_mask, self.uniform)
        self.token.copy_(token[:, None])
        self.logprob.copy_(logprob)
        self.value.copy_(value)
        self.position.add_(1)
        self.slot.add_(1)


def storage_key(module: nn.Module) -> tuple:
    """Address, dtype and shape of each of `module`'s parameters and buffers: what a captured graph reads."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors)


class DecodingGraphs:
    """The DecodingGraph of each policy, one at a time: a new key frees the old graph and its cache.

    Kept beside the policy (a weak reference to it) rather than on it, so copies of the module (the checkpoint's host
    copy, the reference policy) do not carry a cache and a graph along.
    """

    def __init__(self):
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, policy: nn.Module, key: tuple, make: Callable[[], DecodingGraph]) -> DecodingGraph:
        """The policy's graph for `key` (shapes and baked-in constants; `storage_key` is added here), made if new."""
        key = (*key, storage_key(policy))
        entry = self._graphs.get(policy)
        if entry is None or entry[0] != key:
            self._graphs.pop(policy, None)  # free the old cache and graph before allocating new ones
            entry = self._graphs[policy] = (key, make())
        return entry[1]


GRAPHS = DecodingGraphs()
"""the process's decoding graphs, by policy"""
