"""FedMITR for FedML 0.9.6: one-shot federated learning of ViTs, selected by one YAML line.

``import fedml_fedmitr`` makes a stock FedML ``main.py`` accept ``federated_optimizer: FedMITR``
(or any other one-shot method of :mod:`fedml_fedmitr.core.methods`). It never imports FedML
itself, so ``import fedml_fedmitr.core`` stays FedML-free:

* if ``fedml`` is already imported (the usual ``import fedml`` then ``import fedml_fedmitr``),
  the plugin registers at once;
* otherwise a small import hook registers it right after ``fedml`` is first imported.

Registering patches only ``FedMLRunner._init_simulation_runner`` and
``FedMLRunner._init_cross_silo_runner`` (they route the plugin's names to
:class:`fedml_fedmitr.fedml_adapter.runner.FedMITRRunner` and every other name to FedML
unchanged), and makes FedML's ``fetch_config`` local-only while ``using_mlops`` is false. See
:mod:`fedml_fedmitr.fedml_adapter.registry`.

Public helpers (imported lazily): :func:`load_global_model` rebuilds the saved global model,
:func:`load_data` and :func:`create_model` are the plugin's data and model factories.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
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
    """Register the plugin with the imported FedML (idempotent). Imports fedml if needed."""
    from .fedml_adapter.registry import register as _register
    _register()


class _FedMLImportHook(importlib.abc.MetaPathFinder):
    """Calls :func:`register` once the top-level ``fedml`` package has finished importing."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "fedml":
            return None
        # let the other finders locate fedml, then wrap its loader
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _remove_hook()  # only once fedml really ran (find_spec alone may be a mere probe)
            register()

        # wrap only this module's execution; the loader object belongs to this spec alone
        loader.exec_module = exec_module
        return spec


_HOOK = None


def _remove_hook() -> None:
    global _HOOK
    if _HOOK is not None and _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    _HOOK = None


def _install() -> None:
    global _HOOK
    fedml = sys.modules.get("fedml")
    if fedml is not None and getattr(fedml, "FedMLRunner", None) is not None:
        register()
    elif fedml is None and _HOOK is None:
        _HOOK = _FedMLImportHook()
        sys.meta_path.insert(0, _HOOK)
    # (fedml half-imported: it is importing us; the hook cannot help, the runner registers later)


_install()
