"""FedMITR for FedML 0.9.6: one-shot federated learning of ViTs, selected by one YAML line.

``import fedml_fedmitr`` makes a stock FedML ``main.py`` accept ``federated_optimizer: FedMITR``
(or any other one-shot method of :mod:`fedml_fedmitr.core.methods`). It never imports FedML
itself, so ``import fedml_fedmitr.core`` stays FedML-free (and fast): if ``fedml`` is already
imported (``import fedml`` then ``import fedml_fedmitr``, the order of FedML's own examples), the
import calls :func:`register` at once; a program that imports the plugin first calls
``fedml_fedmitr.register()`` after ``import fedml``.

:func:`register` patches only ``FedMLRunner._init_simulation_runner`` and
``_init_cross_silo_runner`` (the plugin's names go to
:class:`fedml_fedmitr.fedml_adapter.runner.FedMITRRunner`, every other name to FedML unchanged) and
gives FedML's ``fetch_config`` an offline path for the plugin's runs while ``using_mlops`` is false.
Every patch is in :mod:`fedml_fedmitr.fedml_adapter.fedml_patches`. The plugin's own CLI
(``python -m fedml_fedmitr``) needs none of this: it builds its runner directly.

Public helpers (imported lazily): :func:`load_global_model` rebuilds the saved global model,
:func:`load_data` and :func:`create_model` are the plugin's data and model factories.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_global_model": ("fedml_fedmitr.core.models", "load_global_model"),
    "save_global_model": ("fedml_fedmitr.core.models", "save_global_model"),
    "load_data": ("fedml_fedmitr.data", "load_data"),
    "create_model": ("fedml_fedmitr.fedml_adapter.model", "create_model"),
    "FedMITRRunner": ("fedml_fedmitr.fedml_adapter.runner", "FedMITRRunner"),
    "FedMITRClientTrainer": ("fedml_fedmitr.fedml_adapter.trainer", "FedMITRClientTrainer"),
    "FedMITRServerAggregator": ("fedml_fedmitr.fedml_adapter.aggregator", "FedMITRServerAggregator"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'fedml_fedmitr' has no attribute {name!r}")


def register() -> None:
    """Register the plugin with FedML's ``FedMLRunner`` (idempotent). Imports fedml if needed."""
    from .fedml_adapter.fedml_patches import register as _register
    _register()


def _register_if_fedml_is_imported() -> None:
    fedml = sys.modules.get("fedml")
    if fedml is not None and getattr(fedml, "FedMLRunner", None) is not None:
        register()
    # fedml not imported yet: nothing to patch (see the module docstring)


_register_if_fedml_is_imported()
