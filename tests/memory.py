"""A CPU proxy of `torch.cuda.max_memory_allocated`: the peak bytes of tensors that a block allocates and holds."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakAllocation(TorchDispatchMode):
    """Within the block, `peak` is the most bytes held at once by the storages its operations allocated, each counted
    until it is freed (a C++ weak reference tells); in-place results and views of existing tensors count 0.

    `held`: tensors allocated before the block that count from its start until they are freed.
    """

    def __init__(self, held: list[torch.Tensor] = ()):
        super().__init__()
        self.live, self.peak = 0, 0
        self.storages: dict[int, tuple[int, int]] = {}  # storage address -> (weak reference, bytes) while alive
        for tensor in held:
            self._count(tensor.untyped_storage())

    def _count(self, storage: torch.UntypedStorage) -> None:
        self.storages[storage.data_ptr()] = (storage._weak_ref(), storage.nbytes())
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)

    def _drop_freed(self) -> None:
        for address, (ref, nbytes) in list(self.storages.items()):
            if torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self.storages[address]
                self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._drop_freed()
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in inputs and storage.data_ptr() not in self.storages and storage.nbytes():
                    self._count(storage)
        return out
