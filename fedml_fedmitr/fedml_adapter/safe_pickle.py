"""Deserialise FedML messages without running anyone's code.

FedML 0.9.6's GRPC receive loop calls ``pickle.loads`` on every message that reaches the port,
before it knows who sent it: a crafted message runs any command as the server's (or a client's)
user. :func:`safe_loads` admits only what FedML's messages and the plugin's payloads hold:
FedML's ``Message``, builtin containers and scalars, ``OrderedDict``, torch tensors and their
storages, numpy arrays and scalars. Any other global in the pickle is refused with
:class:`RefusedMessage` before it is called.

A pickled torch storage carries its bytes as a nested ``torch.save`` archive that torch reads
back with ``torch.load(weights_only=False)`` (``torch.storage._load_from_bytes``): that nested
archive is read here with ``weights_only=True``, so it cannot carry code either.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Dict, Tuple


class RefusedMessage(ValueError):
    """A message whose pickle names something other than the admitted types, or is malformed."""


def _storage_from_bytes(data: bytes):
    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


def _admitted() -> Dict[Tuple[str, str], Callable[..., Any]]:
    import builtins
    import collections

    import numpy
    import torch
    import torch._utils
    from fedml.core.distributed.communication.message import Message

    table: Dict[Tuple[str, str], Callable[..., Any]] = {
        ("fedml.core.distributed.communication.message", "Message"): Message,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("torch", "Size"): torch.Size,
        ("numpy", "ndarray"): numpy.ndarray,
        ("numpy", "dtype"): numpy.dtype,
    }
    for name in ("set", "frozenset", "bytearray", "complex", "slice", "range"):
        table[("builtins", name)] = getattr(builtins, name)
    multiarray = numpy.core.multiarray
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(module, "_reconstruct")] = multiarray._reconstruct
        table[(module, "scalar")] = multiarray.scalar
    return table


class _Unpickler(pickle.Unpickler):
    admitted: Dict[Tuple[str, str], Callable[..., Any]] = {}

    def find_class(self, module: str, name: str):
        found = self.admitted.get((module, name))
        if found is None:
            raise RefusedMessage(f"it names {module}.{name}, which a FedML message never holds")
        return found


def safe_loads(data: bytes) -> Any:
    """``pickle.loads`` restricted to the types of FedML messages; RefusedMessage otherwise."""
    if not isinstance(data, (bytes, bytearray)):
        raise RefusedMessage(f"expected the bytes of a pickled message, got {type(data).__name__}")
    if not _Unpickler.admitted:
        _Unpickler.admitted = _admitted()
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except RefusedMessage:
        raise
    except Exception as exc:  # truncated or malformed pickles raise many types
        raise RefusedMessage(f"it is not a readable message ({type(exc).__name__}: {exc})") from exc
