"""A device for CPU machines whose every transfer is a real copy, recorded: what tests of code that moves tensors to
a GPU and back use where CUDA is absent (a move to `torch.device("cpu")` is a no-op, so a test on it holds by
construction).

Under `RecordingDevice()` (a torch function mode), `t.to(dev.device)` copies `t` and marks the copy as on the
device; `t.device` of a marked tensor answers the device, so libraries take their device branch (bitsandbytes
quantizes "on the device"); tensors a function computes from marked ones, or makes with `device=dev.device`, are
marked; `.to("cpu")` of a marked tensor copies it back unmarked. One call mixing marked tensors with unmarked ones
(of at least one dimension) is refused, as CUDA refuses it. Marks follow storage (views and `.data` share it).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_DEVICE = torch._C.TensorBase.__dict__["device"]
_DATA = torch._C.TensorBase.__dict__["data"]


class RecordingDevice(TorchFunctionMode):
    def __init__(self, name: str = "privateuseone"):
        super().__init__()
        self.device = torch.device(name, 0)
        self.on_device: dict[int, torch.Tensor] = {}  # storage address -> a tensor on it, kept alive so that its
        #                                               memory is not reused by an unmarked tensor meanwhile
        self.to_device: list[tuple] = []  # shapes moved to the device, in order
        self.to_cpu: list[tuple] = []  # shapes moved back

    def marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type != "meta" and \
            t.untyped_storage().data_ptr() in self.on_device

    def _mark(self, t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            self.on_device[t.untyped_storage().data_ptr()] = t
        return t

    def _copy(self, t, dtype):
        return t.detach().clone() if dtype in (None, t.dtype) else t.detach().to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:  # `t.device`
            return self.device if self.marked(args[0]) else func(*args, **kwargs)
        if owner is _DATA and func.__name__ == "__set__":  # `t.data = x`: t is where x is, as on CUDA
            out = func(*args, **kwargs)
            if self.marked(args[1]):
                self._mark(args[0])
            return out
        if func is torch.Tensor.to:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                        if k != "copy"})
            source = args[0]
            if device is not None and device.type == self.device.type:
                if self.marked(source):
                    return source if dtype in (None, source.dtype) else self._mark(self._copy(source, dtype))
                self.to_device.append(tuple(source.shape))
                return self._mark(self._copy(source, dtype))
            if device is not None and device.type == "cpu" and self.marked(source):
                self.to_cpu.append(tuple(source.shape))
                return self._copy(source, dtype)
        device = kwargs.get("device")
        if isinstance(device, (str, torch.device)) and torch.device(device).type == self.device.type:
            return tree_map(self._mark, func(*args, **{**kwargs, "device": "cpu"}))  # made on the device
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        marked = [t for t in tensors if self.marked(t)]
        if marked and any(not self.marked(t) and t.dim() > 0 for t in tensors):
            raise RuntimeError(f"{getattr(func, '__qualname__', func)}: tensors on {self.device} and on the CPU in "
                               "one call")
        out = func(*args, **kwargs)
        if marked:
            tree_map(self._mark, out)
        return out
