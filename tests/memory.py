"""A CPU proxy of `torch.cuda.max_memory_allocated`: the peak bytes of tensors that a block allocates and holds."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocation(TorchDispatchMode):
    """Within the block, `peak` is the most bytes held at once by the tensors its operations allocated (new storage,
    counted until the last tensor or view of it is freed); in-place results and views of existing tensors count 0."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = 0, 0
        self.held: dict[int, int] = {}  # storage address -> bytes, for storages allocated in the block and alive

    def _freed(self, address: int) -> None:
        self.live -= self.held.pop(address, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in inputs or address in self.held or storage.nbytes() == 0:
                continue
            self.held[address] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            base = tensor if tensor._base is None else tensor._base  # views keep their base alive
            weakref.finalize(base, self._freed, address)
        return out
