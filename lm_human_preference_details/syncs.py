"""Count host syncs: the reads of device values on the host, each of which stalls a GPU's queue until it drains.

    with count_host_syncs() as syncs:
        train_step()
    print(syncs.count, syncs.events)

It counts on any device, CPU included (where nothing stalls), so a CPU run measures what a GPU run would wait for:
- calls that hand a tensor's values to Python: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, and `bool()`, `int()`,
  `float()` or `index()` of a tensor;
- aten operators whose result the host must wait for, wherever they are called (inside torch or transformers too):
  `_local_scalar_dense` (what `.item()` runs), `is_nonzero`, `equal`, and those whose output shape depends on the
  values: `nonzero`, `masked_select`, `unique*`, `repeat_interleave` with a repeats tensor, boolean-mask indexing.
Not counted: work on tensors already copied to the host by one of those calls (and what is computed from them only),
host-to-device copies, and collectives (their waits are on the device: NCCL work is queued on a stream).
"""

import contextlib
import os
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
"""aten operators that always wait for device values (a scalar read or a value-dependent output shape)."""
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), __file__)


@dataclass
class HostSyncs:
    """What `count_host_syncs` counted: `count`, and each sync with the first caller outside torch."""

    count: int = 0
    events: list[str] = field(default_factory=list)
    _quiet: bool = False  # inside a counted call or a host-only one: its aten operators are not counted again
    _host: dict[int, weakref.ref] = field(default_factory=dict)  # id -> tensor whose values are on the host

    def _on_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _record(self, what: str) -> None:
        self.count += 1
        caller = next(
            (f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(_LIBRARY_DIRS)), None
        )
        self.events.append(f"{what} at {caller.filename}:{caller.lineno}" if caller else what)


def _is_sync_op(func, args) -> bool:
    """True when the aten operator `func` called with `args` reads device values on the host."""
    name = func._schema.name
    if name in SYNC_OPS:
        return True
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        return args[-1] is None if len(args) > 1 else True  # no output_size: the host reads the repeats
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _Operators(TorchDispatchMode):
    """The aten-level half: operators that wait for device values."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.syncs._quiet and _is_sync_op(func, args):
            self.syncs._record(str(func))
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    """The Python-level half: host reads, and which tensors already live on the host."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = self.syncs
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        on_host = bool(inputs) and all(syncs._on_host(x) for x in inputs)
        reads = func in HOST_READS
        if reads and not on_host:
            syncs._record(getattr(func, "__name__", str(func)))
        quiet, syncs._quiet = syncs._quiet, syncs._quiet or on_host or reads
        try:
            result = func(*args, **kwargs)
        finally:
            syncs._quiet = quiet
        if on_host or func in (torch.Tensor.cpu, torch.Tensor.numpy):
            for x in tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    syncs._host[id(x)] = weakref.ref(x)
        return result


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count the host syncs of the block (see the module docstring): `with count_host_syncs() as syncs: ...`."""
    syncs = HostSyncs()
    with _Calls(syncs), _Operators(syncs):
        yield syncs
