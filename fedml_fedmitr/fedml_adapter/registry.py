"""Make a stock ``FedMLRunner`` accept the plugin's ``federated_optimizer`` names.

FedML 0.9.6 has no optimizer registry: ``FedMLRunner.__init__`` calls
``_init_simulation_runner`` or ``_init_cross_silo_runner``, which dispatch on the name deep
inside FedML. :func:`register` wraps exactly those two methods: for a name in
:func:`fedml_fedmitr.core.methods.method_names` they return a
:class:`~fedml_fedmitr.fedml_adapter.runner.FedMITRRunner` (which runs the whole one-shot flow
itself); for any other name they call FedML's original method unchanged. It also installs the
offline ``fetch_config`` (:mod:`.offline`). Nothing else inside FedML is patched at import time.
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("fedml_fedmitr")

_REGISTERED = False


def is_plugin_method(name) -> bool:
    from ..core.methods import method_names
    return isinstance(name, str) and name in method_names()


def _wrap(original, mode: str):
    @functools.wraps(original)
    def init_runner(self, args, device, dataset, model, client_trainer=None, server_aggregator=None):
        if is_plugin_method(getattr(args, "federated_optimizer", None)):
            from .runner import FedMITRRunner
            return FedMITRRunner(args, device, dataset, model, client_trainer=client_trainer,
                                 server_aggregator=server_aggregator)
        return original(self, args, device, dataset, model, client_trainer, server_aggregator)

    init_runner.__fedmitr_original__ = original
    init_runner.__fedmitr_mode__ = mode
    return init_runner


def register() -> None:
    """Patch ``FedMLRunner._init_simulation_runner`` / ``_init_cross_silo_runner`` (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    check_fedml_version()
    from fedml.runner import FedMLRunner

    from .offline import install_offline_fetch_config

    for attr, mode in (("_init_simulation_runner", "simulation"), ("_init_cross_silo_runner", "cross_silo")):
        current = getattr(FedMLRunner, attr)
        if getattr(current, "__fedmitr_original__", None) is None:
            setattr(FedMLRunner, attr, _wrap(current, mode))
    install_offline_fetch_config()
    _REGISTERED = True
    log.debug("fedml_fedmitr registered with FedMLRunner")


def unregister() -> None:
    """Undo :func:`register` (for tests)."""
    global _REGISTERED
    from fedml.runner import FedMLRunner

    from .offline import uninstall_offline_fetch_config

    for attr in ("_init_simulation_runner", "_init_cross_silo_runner"):
        current = getattr(FedMLRunner, attr)
        original = getattr(current, "__fedmitr_original__", None)
        if original is not None:
            setattr(FedMLRunner, attr, original)
    uninstall_offline_fetch_config()
    _REGISTERED = False


SUPPORTED_FEDML = ("0.9.6",)


def installed_fedml_version():
    """FedML's version from its package metadata (FedML is not imported); None if not installed."""
    from importlib import metadata
    try:
        return metadata.version("fedml")
    except metadata.PackageNotFoundError:
        return None


def check_fedml_version() -> None:
    """The plugin patches FedML 0.9.6's internals (runner dispatch, receive loops, fetch_config): with
    another version it stops with one line instead of patching code it does not know."""
    from .errors import UserError
    found = installed_fedml_version()
    if found not in SUPPORTED_FEDML:
        raise UserError(f"fedml_fedmitr supports FedML {', '.join(SUPPORTED_FEDML)}, found "
                        f"{found or 'no FedML'}: pip install fedml=={SUPPORTED_FEDML[-1]}")
