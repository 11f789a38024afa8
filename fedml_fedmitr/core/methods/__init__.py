"""Server methods by ``federated_optimizer`` name (FedMITR and the one-shot baselines)."""
from __future__ import annotations

from typing import Dict, Type

from .base import Callbacks, ClientUpload, ServerContext, ServerMethod, ServerResult

METHODS: Dict[str, Type[ServerMethod]] = {}


def register_method(cls: Type[ServerMethod]) -> Type[ServerMethod]:
    """Class decorator: make ``cls`` selectable by ``federated_optimizer: <cls.name>``."""
    METHODS[cls.name] = cls
    return cls


def get_method(name: str) -> Type[ServerMethod]:
    _load_builtin()
    if name not in METHODS:
        raise KeyError(f"federated_optimizer = {name!r} is not a one-shot method of this plugin: "
                       f"expected one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def method_names():
    _load_builtin()
    return sorted(METHODS)


def _load_builtin() -> None:
    from . import fedavg, fedmitr  # noqa: F401  (register themselves)
    try:
        from . import baselines, fedftg  # noqa: F401
    except ImportError:  # baselines module not present yet
        pass


__all__ = ["Callbacks", "ClientUpload", "ServerContext", "ServerMethod", "ServerResult",
           "METHODS", "register_method", "get_method", "method_names"]
