"""Offline FedML: no network call during ``fedml.init`` while ``using_mlops`` is false.

FedML 0.9.6's ``fedml.core.mlops.init`` always calls ``fetch_config(args, version)``, which POSTs
to FedML's cloud (no timeout, 5 tries: about 2.7 s where DNS fails fast, much longer where the
network drops packets) even with ``using_mlops: false``. It also sets a few local ``args``
attributes that later code reads (``current_running_dir``, ``os_name``, ``version``,
``log_file_dir``, ``device_id``, ``config_version``, ``cloud_region``).

:func:`install_offline_fetch_config` replaces the module attribute
``fedml.core.mlops.fetch_config`` (``init`` looks it up as a module global at call time) with
:func:`offline_fetch_config`: when ``args.using_mlops`` is true it calls FedML's original;
otherwise it sets the same local attributes and returns without touching the network.
"""
from __future__ import annotations

import logging
import platform

log = logging.getLogger("fedml_fedmitr")

_ORIGINAL = None


def offline_fetch_config(args, version="release"):
    if getattr(args, "using_mlops", False):
        return _ORIGINAL(args, version)
    from fedml.computing.scheduler.master.server_constants import ServerConstants
    from fedml.computing.scheduler.scheduler_core.account_manager import FedMLAccountManager
    from fedml.computing.scheduler.slave.client_constants import ClientConstants

    setattr(args, "current_running_dir", ClientConstants.get_fedml_home_dir())
    sys_name = platform.system()
    setattr(args, "os_name", "MacOS" if sys_name == "Darwin" else sys_name)
    setattr(args, "version", version)
    if int(getattr(args, "rank", 0) or 0) == 0:
        setattr(args, "log_file_dir", ServerConstants.get_log_file_dir())
        setattr(args, "device_id", FedMLAccountManager.get_device_id(ServerConstants.get_data_dir()))
    else:
        setattr(args, "log_file_dir", ClientConstants.get_log_file_dir())
        setattr(args, "device_id", FedMLAccountManager.get_device_id(ClientConstants.get_data_dir()))
    setattr(args, "config_version", version)
    setattr(args, "cloud_region", "")
    log.debug("fedml_fedmitr: using_mlops is false, skipped FedML's cloud fetch_config")
    return False


def install_offline_fetch_config() -> None:
    global _ORIGINAL
    import fedml.core.mlops as mlops

    if getattr(mlops.fetch_config, "__fedmitr_offline__", False):
        return
    _ORIGINAL = mlops.fetch_config
    offline_fetch_config.__fedmitr_offline__ = True
    mlops.fetch_config = offline_fetch_config


def uninstall_offline_fetch_config() -> None:
    import fedml.core.mlops as mlops

    if _ORIGINAL is not None and getattr(mlops.fetch_config, "__fedmitr_offline__", False):
        mlops.fetch_config = _ORIGINAL
