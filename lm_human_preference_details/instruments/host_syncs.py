"""Count host syncs: reads of device values on the host, and copies from host memory that wait for the device,
each of which stalls a GPU's queue until it drains.

The counter works on any device, CPU included (where nothing stalls), so a CPU test can guard the GPU code path.
What counts as one sync:

- a call that hands a tensor's values to Python: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, and `bool()`,
  `int()`, `float()` or `index()` of a tensor (e.g. `if tensor:`);
- an operator whose result the host must wait for, wherever it is called from (inside torch or transformers too):
  `_local_scalar_dense` (what `.item()` runs), `is_nonzero`, `equal`, and the operators whose output shape depends on
  the values: `nonzero`, `masked_select`, `unique*`, `repeat_interleave` with a repeats tensor, and indexing with a
  boolean mask;
- a host-to-device copy (`.to(device)`, `.cuda()`, `copy_`, an indexed assignment) of a tensor in pageable host
  memory, or any blocking one: on CUDA it waits for every kernel queued before it (torch copies through a staging
  buffer and synchronizes the stream), so one in the middle of queued work stalls the GPU. A copy from pinned memory
  with `non_blocking=True` (`devices.to_device`) does not wait.

How the copies are told apart: with a GPU, from the tensors' devices and `is_pinned()`. On a CPU run, where host and
device are one, the counter follows which tensors are host memory: those made by a factory without a `device`
argument (`torch.tensor`, `torch.from_numpy`, `torch.zeros(...)`, ...), `.cpu()` copies, and what is computed from
them alone; a `.to(device)` of such a tensor counts, unless `non_blocking=True` (the project passes it only where
`devices.to_device` pins the memory on CUDA). What this CPU proxy cannot see: a factory given `device="cpu"` and one
given the run's device look alike, so `torch.tensor(data, device=device)` (a copy on CUDA) counts on GPU runs only; a
`non_blocking=True` copy from pageable memory counts on GPU runs only; tensors made before the counted block are taken
for device tensors. On a GPU, `torch.cuda.set_sync_debug_mode("warn")` sees every synchronizing call.

Not counted: anything done with tensors that already came to the host through one of the reads above (the values of
a `.cpu()` copy, its slices and what is computed from them), and `.to("cpu")`: a copy to the host, named so by the
project (the run's device is a `torch.device`; on a CPU run `.to(device)` cannot otherwise be told from it).
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

DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
"""Factories that copy their data to the `device` they are given."""


def _copy_to_device(func, args, kwargs) -> tuple[object, torch.device, bool, torch.Tensor | None] | None:
    """(source, target device, non_blocking, destination tensor or None) when `func(*args, **kwargs)` copies data to
    a device; None otherwise."""
    if func is torch.Tensor.to:
        if "cpu" in (args[1] if len(args) > 1 else None, kwargs.get("device")):
            return None  # `.to("cpu")`: a copy to the host (the run's device is a torch.device)
        to_kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # `_parse_to` takes `.to`'s other arguments
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **to_kwargs)
        return None if device is None else (args[0], device, non_blocking, None)
    if func is torch.Tensor.cuda:
        index = args[1] if len(args) > 1 else kwargs.get("device")
        device = torch.device("cuda" if index is None else f"cuda:{index}" if isinstance(index, int) else index)
        return args[0], device, bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)), None
    if func is torch.Tensor.copy_:
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return args[1], args[0].device, non_blocking, args[0]
    if func is torch.Tensor.__setitem__ and isinstance(args[2], torch.Tensor):
        return args[2], args[0].device, False, args[0]
    if func in DATA_FACTORIES and kwargs.get("device") is not None:
        return args[0] if args else kwargs.get("data"), torch.device(kwargs["device"]), False, None
    return None


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
        copy = _copy_to_device(func, args, kwargs)
        if copy is not None and counter._copy_waits(*copy):
            counter._record(f"{getattr(func, '__name__', str(func))} (a host-to-device copy that waits)")
        suppressed, counter._suppressed = counter._suppressed, counter._suppressed or on_host or reads
        try:
            result = func(*args, **kwargs)
        finally:
            counter._suppressed = suppressed
        if on_host or func in (torch.Tensor.cpu, torch.Tensor.numpy):
            for x in tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    counter._host[id(x)] = weakref.ref(x)
        counter._follow_host_memory(func, inputs, kwargs, copy, result)
        return result


class HostSyncCounter:
    """`with HostSyncCounter() as syncs: ...` counts the host syncs of the block: `syncs.count`, `syncs.events`."""

    def __init__(self):
        self.count = 0
        self.events: list[str] = []
        self._suppressed = False
        self._host: dict[int, weakref.ref] = {}  # id -> tensor whose values are on the host
        self._pageable: dict[int, weakref.ref] = {}  # id -> tensor in host memory (CPU runs; see the module docstring)
        self._modes = (_Operators(self), _Calls(self))

    def _is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _is_pageable(self, tensor: torch.Tensor) -> bool:
        ref = self._pageable.get(id(tensor))
        return ref is not None and ref() is tensor

    def _copy_waits(self, source, device: torch.device, non_blocking: bool, destination) -> bool:
        """Whether copying `source` (a tensor, or Python data) to `device` waits for the device's queued work."""
        if device.type == "meta":
            return False  # no data (transformers builds models there)
        if not isinstance(source, torch.Tensor):
            return device.type != "cpu"  # Python data: staged in pageable memory
        if source.numel() == 0 or (destination is not None and destination.numel() == 0):
            return False  # no elements: `copy_` returns before it copies (an empty tensor is not pinned, either)
        if source.device.type != "cpu":
            return False  # on the device already, or a device-to-host copy (counted as a read when it is `.cpu()`)
        if device.type != "cpu":
            return not (non_blocking and source.is_pinned())
        # a CPU run: a copy of host memory to the device, which is not itself host memory
        on_device = destination is None or not self._is_pageable(destination)
        return self._is_pageable(source) and on_device and not non_blocking

    def _follow_host_memory(self, func, inputs: list, kwargs: dict, copy, result) -> None:
        """Mark the host-memory tensors among `result`: what factories without a device make, `.cpu()` copies, and
        what is computed from host-memory tensors alone; unmark what a copy put on a device."""
        outputs = [x for x in tree_leaves(result) if isinstance(x, torch.Tensor)]
        if copy is not None and copy[3] is None:
            on_host = copy[1].type == "cpu" and isinstance(copy[0], torch.Tensor) and copy[0].device.type != "cpu"
        elif func is torch.Tensor.cpu:
            on_host = True
        elif kwargs.get("device") is not None:
            on_host = torch.device(kwargs["device"]).type == "cpu" and any(x.device.type != "cpu" for x in inputs)
        else:
            on_host = all(self._is_pageable(x) for x in inputs) and torch.get_default_device().type == "cpu"
        for x in outputs:
            if on_host:
                self._pageable[id(x)] = weakref.ref(x)
            else:
                self._pageable.pop(id(x), None)

    def _record(self, what: str) -> None:
        self.count += 1
        frame = next((f for f in reversed(traceback.extract_stack()) if not f.filename.startswith(_TORCH_DIR)), None)
        self.events.append(f"{what} at {frame.filename}:{frame.lineno}" if frame else what)

    def _from_numpy(self, array) -> torch.Tensor:
        """`torch.from_numpy`, which no torch function mode sees, marking its result as host memory."""
        tensor = self._real_from_numpy(array)
        self._pageable[id(tensor)] = weakref.ref(tensor)
        return tensor

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        self._real_from_numpy, torch.from_numpy = torch.from_numpy, self._from_numpy
        return self

    def __exit__(self, *exc) -> None:
        torch.from_numpy = self._real_from_numpy
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
