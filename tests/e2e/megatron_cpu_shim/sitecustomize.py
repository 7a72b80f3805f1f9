"""Answers, for the CPU, the few torch.cuda calls inside Megatron-LM's megatron/core
dist_checkpointing (a test shim, not an edit to Megatron): synchronize, set_device,
current_device and device_count; tensors asked for on "cuda" are made on the CPU and
Tensor.cuda() returns the tensor itself. torch.cuda.is_available() stays False, so Megatron
takes its no-Transformer-Engine paths. On PYTHONPATH, it applies to every process started
from the test, Megatron's spawned persistent checkpoint worker included.

Only active with CKPTFS_MEGATRON_CPU_SHIM=1, so that an unrelated python3 with this
directory on its path is left alone.
"""
import os

if os.environ.get("CKPTFS_MEGATRON_CPU_SHIM") == "1":
    import functools

    import torch

    def _cpu(dev):
        if dev is None:
            return None
        if isinstance(dev, int):
            return torch.device("cpu")
        d = torch.device(dev)
        return torch.device("cpu") if d.type == "cuda" else d

    def _on_cpu(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return fn(*args, **kwargs)
        return wrapper

    for _name in ("tensor", "empty", "empty_like", "zeros", "zeros_like", "ones", "ones_like",
                  "full", "full_like", "arange", "as_tensor"):
        setattr(torch, _name, _on_cpu(getattr(torch, _name)))

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.device_count = lambda: 1
    torch.Tensor.cuda = lambda self, *a, **k: self
