"""Lets Debian's torch 1.13 import torch.distributed._shard on Python 3.11.

torch 1.13's sharded_tensor/metadata.py declares
`tensor_properties: TensorProperties = field(default=TensorProperties())`.
Python 3.11 rejects an unhashable dataclass default with
`ValueError: mutable default ... use default_factory`. This module, found on
PYTHONPATH at interpreter start (or imported explicitly), wraps
dataclasses._get_field so that such a default in a torch class becomes a
default_factory returning a deep copy of the same value. Pickles and
checkpoint bytes are unchanged: every instance still starts equal to the
original default.

Afterwards it chain-loads the distribution's own sitecustomize, which this
one shadows on sys.path.
"""
import copy
import dataclasses
import importlib.util
import os
import sys


def _install():
    original = dataclasses._get_field
    if getattr(original, "_ckptfs_patched", False):
        return

    def _get_field(cls, a_name, a_type, *args, **kwargs):
        try:
            return original(cls, a_name, a_type, *args, **kwargs)
        except ValueError as e:
            if "mutable default" not in str(e) or not cls.__module__.startswith("torch"):
                raise
        default = cls.__dict__.get(a_name, dataclasses.MISSING)
        if isinstance(default, dataclasses.Field):
            value = default.default
            default.default = dataclasses.MISSING
            default.default_factory = lambda v=value: copy.deepcopy(v)
        else:
            setattr(cls, a_name,
                    dataclasses.field(default_factory=lambda v=default: copy.deepcopy(v)))
        return original(cls, a_name, a_type, *args, **kwargs)

    _get_field._ckptfs_patched = True
    dataclasses._get_field = _get_field


def _chain_system_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for d in sys.path:
        if not d or os.path.abspath(d) == here:
            continue
        candidate = os.path.join(d, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_system_sitecustomize", candidate)
            try:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            except Exception:
                pass
            return


_install()
if __name__ == "sitecustomize":
    _chain_system_sitecustomize()
