"""Count host syncs: reads of device values on the host, each of which stalls a GPU's queue until it drains.

The counter works on any device, CPU included (where nothing stalls), so a CPU test can guard the GPU code path.
What counts as one sync:

- a call that hands a tensor's values to Python: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, and `bool()`,
  `int()`, `float()` or `index()` of a tensor (e.g. `if tensor:`);
- an operator whose result the host must wait for, wherever it is called from (inside torch or transformers too):
  `_local_scalar_dense` (what `.item()` runs), `is_nonzero`, `equal`, and the operators whose output shape depends on
  the values: `nonzero`, `masked_select`, `unique*`, `repeat_interleave` with a repeats tensor, and indexing with a
  boolean mask.

Not counted: anything done with tensors that already came to the host through one of the calls above (the values of
a `.cpu()` copy, its slices and what is computed from them), host-to-device copies (`.to(device)` of host data does
not wait for queued kernels), and `.to("cpu")` (on a CPU run it cannot be told apart from `.to(device)`; the
project copies device values to the host with `.cpu()` only).
"""

import os
import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TORCH_DIR = (os.path.dirname(torch.__file__), __file__)

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
"""Tensor methods that hand device values to Python."""

SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::unique_dim_consecutive",
}
"""Operators that always wait for device values (a scalar read or a value-dependent output shape)."""


def _is_sync_op(func, args, kwargs) -> bool:
    """True when the aten operator `func` called with `args`, `kwargs` reads device values on the host."""
    name = func._schema.name
    if name in SYNC_OPS:
        return True
    if name == "aten::repeat_interleave":  # repeats given as a tensor: the output length is their sum
        return func._overloadname == "Tensor" and kwargs.get("output_size") is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1]
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    return False


class _Operators(TorchDispatchMode):
    """The aten-level half of `HostSyncCounter`."""

    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter._suppressed and _is_sync_op(func, args, kwargs):
            self.counter._record(str(func))
        return func(*args, **kwargs)


class _Calls(TorchFunctionMode):
    """The Python-level half of `HostSyncCounter`: host reads, and which tensors already live on the host."""

    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on_host = bool(inputs) and all(counter._is_host(x) for x in inputs)
        reads = func in HOST_READS
        if reads and not on_host:
            counter._record(getattr(func, "__name__", str(func)))
        suppressed, counter._suppressed = counter._suppressed, counter._suppressed or on_host or reads
        try:
            result = func(*args, **kwargs)
        finally:
            counter._suppressed = suppressed
        if on_host or func in (torch.Tensor.cpu, torch.Tensor.numpy):
            for x in tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    counter._host[id(x)] = weakref.ref(x)
        return result


class HostSyncCounter:
    """`with HostSyncCounter() as syncs: ...` counts the host syncs of the block: `syncs.count`, `syncs.events`."""

    def __init__(self):
        self.count = 0
        self.events: list[str] = []
        self._suppressed = False
        self._host: dict[int, weakref.ref] = {}  # id -> tensor whose values are on the host
        self._modes = (_Operators(self), _Calls(self))

    def _is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _record(self, what: str) -> None:
        self.count += 1
        frame = next((f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(_TORCH_DIR)), None)
        self.events.append(f"{what} at {frame.filename}:{frame.lineno}" if frame else what)

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
