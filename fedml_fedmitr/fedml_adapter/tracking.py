"""The server's metrics through FedML's own tracking calls, the way FedML's algorithms log theirs.

FedML's FedAvg logs ``wandb.log({...})`` when ``tracking_args.enable_wandb`` is true and
``fedml.mlops.log({...})`` always; ``mlops.log`` sends nothing unless the run is bound to FedML's
platform (``using_mlops``, or ``enable_tracking`` with ``mlops_project_name`` / ``mlops_api_key`` in a
simulation). :func:`fedml_sink` gives the server's report callbacks the same two calls for every
metric it records (inversion loss and kept tokens every 10 steps, distillation losses and accuracy
per epoch, and at the end the summary: accuracies, per-class accuracy, timings), next to
``summary.json``, ``metrics_history.json`` and TensorBoard. With both switches off there is no
sink, and with wandb off nothing is sent anywhere.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from ..core.config import ConfigError

log = logging.getLogger("fedml_fedmitr")

STEP_KEY = "fedmitr_step"


def tracking_on(args) -> bool:
    return bool(getattr(args, "enable_wandb", False) or getattr(args, "enable_tracking", False))


def check_tracking_args(args) -> None:
    """``enable_tracking`` in a simulation binds the run to FedML's platform, which needs its project
    and key: say so before FedML starts (FedML would raise a bare Exception from fedml.init)."""
    for key in ("enable_wandb", "enable_tracking"):
        value = getattr(args, key, False)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"tracking_args.{key} = {value!r} is invalid: expected true or false")
    if getattr(args, "enable_tracking", False) and getattr(args, "training_type", None) == "simulation":
        missing = [k for k in ("mlops_project_name", "mlops_api_key") if not getattr(args, k, None)]
        if missing:
            raise ConfigError(f"tracking_args.enable_tracking = true sends a simulation's metrics to FedML's platform, "
                              f"which needs {' and '.join(missing)}; set enable_tracking: false (metrics stay in "
                              "summary.json, metrics_history.json and TensorBoard) or enable_wandb: true for wandb")
    if getattr(args, "enable_wandb", False) and not getattr(args, "wandb_project", None):
        raise ConfigError("tracking_args.enable_wandb = true needs tracking_args.wandb_project (FedML's wandb.init "
                          "reads it)")


def fedml_sink(args) -> Optional[Callable[[str, float, int], None]]:
    """A ``sink(name, value, step)`` for :class:`~fedml_fedmitr.core.report.ReportCallbacks`, or None
    when tracking is off or FedML was not initialised in this process (``server_only``)."""
    if not tracking_on(args):
        return None
    from fedml.core.mlops import MLOpsStore

    if MLOpsStore.mlops_args is None:   # no fedml.init here: mlops.log would run one
        log.warning("server: tracking_args ask for tracking, but FedML is not initialised in this process: the "
                    "metrics stay in summary.json, metrics_history.json and TensorBoard")
        return None
    from fedml import mlops

    use_wandb = bool(getattr(args, "enable_wandb", False))

    def sink(name: str, value: float, step: int) -> None:
        record = {name: value, STEP_KEY: step}
        if use_wandb:
            import wandb
            wandb.log(record)
        mlops.log(record)

    return sink
