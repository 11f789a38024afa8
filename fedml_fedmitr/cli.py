"""``python -m fedml_fedmitr --cf CONFIG [--rank R --role server|client --run_id ID]``.

Does what FedML's own ``main.py`` does (``fedml.init`` -> device -> data -> model ->
``FedMLRunner(...).run()``) for the plugin's one-shot methods, with the plugin's data and model
factories. One entry point for every mode: ``backend: sp``; ``mpirun -n K+1 python -m
fedml_fedmitr --cf ...`` with ``backend: MPI``; and each party of a cross-silo run
(``--rank 0 --role server``, ``--rank i --role client``).

The configuration is validated before FedML is imported: an unknown ``federated_optimizer``, an
unknown or bad ``fedmitr_args`` key, a bad ``train_args`` / ``data_args`` / ``model_args`` value
exits with status 2 and one line naming the key. Any other failure exits 1 (in an MPI run the
whole job is aborted so no rank waits forever).

Exit status: 0 on success.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

EXIT_CONFIG = 2
EXIT_FAILURE = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedml_fedmitr",
                                description="Run a FedML job with a one-shot method of fedml_fedmitr "
                                            "(federated_optimizer: FedMITR, ...)")
    p.add_argument("--cf", "--yaml_config_file", dest="yaml_config_file", required=True,
                   help="FedML YAML configuration file")
    p.add_argument("--rank", type=int, default=0, help="cross-silo: 0 for the server, 1..N for clients")
    p.add_argument("--role", choices=("server", "client"), default=None,
                   help="cross-silo role (default: server for rank 0, client otherwise)")
    p.add_argument("--run_id", type=str, default="0")
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--run_device_id", type=str, default="0")
    return p


def validate(path: str):
    """Read and validate the YAML file without importing FedML. Returns (sections, namespace)."""
    from .core.config import ConfigError
    from .core.methods import method_names
    from .fedml_adapter.config import (check_data_args, check_model_args, check_run_args,
                                       client_train_config, fedmitr_section, flatten, load_yaml)
    from .core.config import FedMITRConfig

    sections = load_yaml(path)
    flat = SimpleNamespace(**flatten(sections))
    name = getattr(flat, "federated_optimizer", None)
    names = method_names()
    if name not in names:
        raise ConfigError(f"train_args.federated_optimizer = {name!r} is not a one-shot method of "
                          f"fedml_fedmitr: expected one of {', '.join(names)} (FedML's own optimizers run "
                          "with FedML's own main.py)")
    FedMITRConfig.from_dict(fedmitr_section(sections, path), where="fedmitr_args")
    client_train_config(flat)
    check_run_args(flat)
    check_data_args(flat)
    check_model_args(flat)
    t = getattr(flat, "training_type", None)
    if t not in ("simulation", "cross_silo"):
        raise ConfigError(f"common_args.training_type = {t!r} is invalid: expected simulation or cross_silo")
    backend = getattr(flat, "backend", None)
    if t == "simulation" and backend not in ("sp", "MPI"):
        raise ConfigError(f"comm_args.backend = {backend!r} is invalid for a simulation: expected sp or MPI")
    if getattr(flat, "using_mlops", False) not in (False, None) and not isinstance(flat.using_mlops, bool):
        raise ConfigError(f"common_args.using_mlops = {flat.using_mlops!r} is invalid: expected true or false")
    return sections, flat


def _set_threads(flat) -> None:
    n = getattr(flat, "torch_num_threads", None)
    if n is None and os.environ.get("FEDMITR_TORCH_THREADS"):
        n = int(os.environ["FEDMITR_TORCH_THREADS"])
    if n:
        import torch
        torch.set_num_threads(int(n))


def run(cmd) -> int:
    from .core.config import ConfigError

    try:
        _, flat = validate(cmd.yaml_config_file)
    except ConfigError as exc:
        sys.stderr.write(f"fedml_fedmitr: configuration error: {exc}\n")
        return EXIT_CONFIG
    _set_threads(flat)

    import fedml
    from fedml.arguments import Arguments
    from .fedml_adapter.registry import register

    register()  # runner routing + offline fetch_config (only while using_mlops is false)
    if cmd.role is None:
        cmd.role = "server" if cmd.rank == 0 else "client"
    cmd.using_mlops = False
    args = Arguments(cmd)  # loads the YAML like FedML's load_arguments, from our parsed command line
    if not hasattr(args, "log_file_dir"):
        # FedML's log set-up creates ./logs in the working directory unless told otherwise
        args.log_file_dir = os.path.join(os.path.expanduser("~"), ".fedml", "fedml_fedmitr", "logs")
    mpi = getattr(args, "backend", None) == "MPI"
    try:
        args = fedml.init(args, check_env=bool(getattr(args, "using_mlops", False)))
        for key in ("gpu_mapping_file", "gpu_mapping_key"):  # FedML's MPI device lookup reads both
            if not hasattr(args, key):
                setattr(args, key, None)
        device = fedml.device.get_device(args)
        from .data import load_data
        from .fedml_adapter.model import create_model

        dataset, output_dim = load_data(args)
        model = create_model(args, output_dim)
        fedml.FedMLRunner(args, device, dataset, model).run()
    except ConfigError as exc:  # includes DataError; ModelError is a ValueError
        sys.stderr.write(f"fedml_fedmitr: configuration error: {exc}\n")
        _abort_mpi(mpi, EXIT_CONFIG)
        return EXIT_CONFIG
    except Exception:
        logging.getLogger("fedml_fedmitr").exception("fedml_fedmitr: run failed")
        import traceback
        traceback.print_exc(file=sys.__stderr__)
        _abort_mpi(mpi, EXIT_FAILURE)
        return EXIT_FAILURE
    return 0


def _abort_mpi(mpi: bool, code: int) -> None:
    if not mpi:
        return
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            sys.__stderr__.flush()
            MPI.COMM_WORLD.Abort(code)
    except Exception:
        pass


def main(argv: Optional[List[str]] = None) -> int:
    cmd = _parser().parse_args(argv)
    return run(cmd)


if __name__ == "__main__":
    sys.exit(main())
