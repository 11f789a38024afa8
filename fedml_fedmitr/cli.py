"""``python -m fedml_fedmitr --cf CONFIG [--rank R --role server|client --run_id ID]``.

Does what FedML's own ``main.py`` does (``fedml.init`` -> device -> data -> model ->
``FedMLRunner(...).run()``) for the plugin's one-shot methods, with the plugin's data and model
factories. One entry point for every mode: ``backend: sp``; ``mpirun -n K+1 python -m
fedml_fedmitr --cf ...`` with ``backend: MPI``; and each party of a cross-silo run
(``--rank 0 --role server``, ``--rank i --role client``).

The configuration is validated before FedML is imported: an unknown ``federated_optimizer``, an
unknown or bad ``fedmitr_args`` key, a bad ``train_args`` / ``data_args`` / ``model_args`` value, a
missing or unreadable dataset file, ``class_num`` that disagrees with the data, a partition that
leaves a client without samples, more client processes than clients, an unwritable ``output_dir``.
Later user errors (see :mod:`fedml_fedmitr.fedml_adapter.errors`: an upload of another
architecture or with NaN/Inf, clients missing after ``client_timeout_s``, ...) are treated alike.

Exit status: 0 on success; 2 on a user error, printed as one line ``fedml_fedmitr: error: ...`` on
stderr without a stack trace (the server, rank 0, also writes it to ``<output_dir>/error.json``);
1 on any other failure, with its traceback. In an MPI run a failing rank aborts the whole job with
that status, so no rank waits forever.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

from .fedml_adapter.run_checks import mpi_env_rank_size, section_of

EXIT_CONFIG = 2  # a user error
EXIT_FAILURE = 1
ERROR_NAME = "error.json"


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
    from .fedml_adapter.config import load_yaml

    return validate_sections(load_yaml(path), path)


def validate_sections(sections, path: str):
    """:func:`validate` of already loaded YAML sections (``path`` names the file in messages)."""
    from .core.config import ConfigError
    from .core.methods import get_method, method_names
    from .fedml_adapter.config import (
        ADAPTER_KEYS,
        check_data_args,
        check_mixed_clients,
        check_model_args,
        check_run_args,
        flatten,
        settings_from,
    )
    from .fedml_adapter.run_checks import check_processes, check_run_keys, check_unapplied
    from .fedml_adapter.tracking import check_tracking_args

    flat = SimpleNamespace(**flatten(sections))
    name = getattr(flat, "federated_optimizer", None)
    names = method_names()
    if name not in names:
        raise ConfigError(f"train_args.federated_optimizer = {name!r} is not a one-shot method of "
                          f"fedml_fedmitr: expected one of {', '.join(names)} (FedML's own optimizers run "
                          "with FedML's own main.py)")
    # the plugin's settings, read and validated once here and handed down (flat.fedmitr_settings)
    settings = flat.fedmitr_settings = settings_from(sections, flat, path)
    check_unapplied(sections)
    from .fedml_adapter.grpc_security import security_from
    security_from(settings.adapter)   # the token and the certificate files, up front
    log = logging.getLogger("fedml_fedmitr")
    unknown = check_run_keys(sections, path)
    if unknown:
        log.warning("fedml_fedmitr: warning: %s in %s: not a setting FedML or fedml_fedmitr reads, no effect (list "
                    "it in fedmitr_args.custom_keys if it is your own)", ", ".join(unknown), path)
    unused = get_method(name).unused_keys([k for k in settings.given if k not in ADAPTER_KEYS])
    if unused:
        log.warning("fedml_fedmitr: warning: fedmitr_args %s in %s: not read by %s, no effect (settings of "
                    "another method)", ", ".join(unused), path, name)
    check_run_args(flat)
    check_tracking_args(flat)
    check_data_args(flat)
    check_model_args(flat)
    check_mixed_clients(flat, settings, get_method(name))
    t = getattr(flat, "training_type", None)
    if t not in ("simulation", "cross_silo"):
        raise ConfigError(f"common_args.training_type = {t!r} is invalid: expected simulation or cross_silo")
    backend = getattr(flat, "backend", None)
    if t == "simulation" and backend not in ("sp", "MPI"):
        raise ConfigError(f"comm_args.backend = {backend!r} is invalid for a simulation: expected sp or MPI")
    if getattr(flat, "using_mlops", False) not in (False, None) and not isinstance(flat.using_mlops, bool):
        raise ConfigError(f"common_args.using_mlops = {flat.using_mlops!r} is invalid: expected true or false")
    check_processes(sections, flat)
    return sections, flat


def preflight(sections, flat) -> str:
    """The checks of :func:`validate` that look at files: the dataset's files, arrays, ``class_num`` and
    partition (:func:`fedml_fedmitr.data.preflight`), and a writable ``output_dir`` (returned, resolved).
    Still FedML-free."""
    from .data import preflight as data_preflight
    from .fedml_adapter.config import check_output_dir

    data_preflight(flat, class_num_key=section_of(sections, "class_num", "data_args"))
    out_dir = flat.fedmitr_settings.method.output_dir
    check_output_dir(out_dir, create=True)
    check_gpu(sections, flat)
    return out_dir


def check_gpu(sections, flat) -> None:
    """``using_gpu: true`` on a machine where torch sees no CUDA device is refused (FedML would run on
    the CPU with one INFO line)."""
    from .core.config import ConfigError

    if getattr(flat, "using_gpu", False) is True:
        import torch
        if not torch.cuda.is_available():
            raise ConfigError(f"{section_of(sections, 'using_gpu', 'common_args')} = true but torch sees no CUDA "
                              "device on this machine; set using_gpu: false to run on the CPU")


def _set_threads(flat) -> None:
    n = getattr(flat, "torch_num_threads", None)
    if n is None and os.environ.get("FEDMITR_TORCH_THREADS"):
        n = int(os.environ["FEDMITR_TORCH_THREADS"])
    if n:
        import torch
        torch.set_num_threads(int(n))


def run(cmd) -> int:
    cmd.release_lock = None
    try:
        return _run(cmd)
    finally:
        if cmd.release_lock is not None:
            cmd.release_lock()


def _run(cmd) -> int:
    import signal

    from .fedml_adapter.errors import USER_ERRORS

    env_rank, _ = mpi_env_rank_size()
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:   # not the main thread (an embedding program): its own handling stays
        pass
    try:
        from .fedml_adapter.fedml_patches import check_fedml_version
        check_fedml_version()
        sections, flat = validate(cmd.yaml_config_file)
        locked_dir = preflight(sections, flat)
        from .fedml_adapter.run_checks import check_grpc_endpoint
        check_grpc_endpoint(flat, cmd.rank)
        if (cmd.rank if env_rank is None else env_rank) == 0:   # the server holds output_dir for the whole run
            from .fedml_adapter.state import lock_output_dir, release_output_dir
            lock_output_dir(locked_dir)
            cmd.release_lock = lambda: release_output_dir(locked_dir)   # noqa: E731
    except (KeyboardInterrupt, Terminated) as exc:
        return report_interrupt(exc, None, 0)
    except USER_ERRORS as exc:
        # under mpirun every rank finds the same error: one of them says it
        return report_user_error(exc, quiet=env_rank not in (None, 0))
    _set_threads(flat)

    import fedml
    from fedml.arguments import Arguments

    from .fedml_adapter.fedml_patches import offline_fetch_config_installed

    if cmd.role is None:
        cmd.role = "server" if cmd.rank == 0 else "client"
    cmd.using_mlops = False
    args = Arguments(cmd)  # loads the YAML like FedML's load_arguments, from our parsed command line
    if not hasattr(args, "log_file_dir"):
        # FedML's log set-up creates ./logs in the working directory unless told otherwise
        args.log_file_dir = os.path.join(os.path.expanduser("~"), ".fedml", "fedml_fedmitr", "logs")
    backend = getattr(args, "backend", None)
    mpi = backend == "MPI"
    distributed = mpi or getattr(args, "training_type", None) == "cross_silo"
    settings = flat.fedmitr_settings
    out_dir = settings.method.output_dir
    rank = cmd.rank if env_rank is None else env_rank
    if rank == 0:
        _clear_error(out_dir)
    try:
        with offline_fetch_config_installed():   # no call to FedML's cloud while using_mlops is false
            args = fedml.init(args, check_env=bool(getattr(args, "using_mlops", False)))
        rank = int(getattr(args, "rank", rank) or 0)
        for key in ("gpu_mapping_file", "gpu_mapping_key"):  # FedML's MPI device lookup reads both
            if not hasattr(args, key):
                setattr(args, key, None)
        device = fedml.device.get_device(args)
        from .data import load_data
        from .fedml_adapter.model import create_model

        dataset, output_dim = load_data(args)
        model = create_model(args, output_dim)
        from .fedml_adapter.runner import FedMITRRunner
        FedMITRRunner(args, device, dataset, model, settings=settings).run()
    except USER_ERRORS as exc:
        code = report_user_error(exc, out_dir=out_dir, rank=rank)
        _abort_mpi(mpi, code)
        _exit_now(distributed, code)
        return code
    except (KeyboardInterrupt, Terminated) as exc:
        code = report_interrupt(exc, out_dir, rank)
        _abort_mpi(mpi, code)
        _exit_now(distributed, code)
        return code
    except Exception as exc:
        logging.getLogger("fedml_fedmitr").exception("fedml_fedmitr: run failed")
        import traceback
        traceback.print_exc(file=sys.__stderr__)
        write_error(out_dir, rank, exc, EXIT_FAILURE)
        _abort_mpi(mpi, EXIT_FAILURE)
        _exit_now(distributed, EXIT_FAILURE)
        return EXIT_FAILURE
    return 0


def report_user_error(exc: BaseException, out_dir: Optional[str] = None, rank: int = 0, quiet: bool = False) -> int:
    """Print a user error as one line on stderr (no stack trace); record it in error.json."""
    from .fedml_adapter.errors import one_line

    if not quiet:
        _raw_write(sys.__stderr__, f"fedml_fedmitr: error: {one_line(exc)}\n")
    log_to_files(logging.ERROR, f"fedml_fedmitr: error: {one_line(exc)}")
    if out_dir is not None:
        write_error(out_dir, rank, exc, EXIT_CONFIG)
    return EXIT_CONFIG


def log_to_files(level: int, message: str) -> None:
    """A line for FedML's log files only: its console handlers would print again what stderr has."""
    plog = logging.getLogger("fedml_fedmitr")
    record = plog.makeRecord(plog.name, level, __file__, 0, message, None, None)
    for logger in (plog, logging.root):
        for handler in logger.handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)


class Terminated(Exception):
    """SIGTERM reached the process."""


def _on_sigterm(signum, frame):
    raise Terminated()


def report_interrupt(exc: BaseException, out_dir: Optional[str], rank: int) -> int:
    """Ctrl-C (exit 130) or SIGTERM (exit 143): one line saying what is kept, no traceback."""
    code = 143 if isinstance(exc, Terminated) else 130
    what = "terminated (SIGTERM)" if code == 143 else "interrupted (Ctrl-C)"
    kept = (f"; finished work is kept under {os.path.join(out_dir, 'state')} (rerun with fedmitr_args.resume: "
            "true to continue)") if out_dir and int(rank or 0) == 0 else ""
    _raw_write(sys.__stderr__, f"fedml_fedmitr: {what}{kept}\n")
    log_to_files(logging.WARNING, f"fedml_fedmitr: {what}")
    return code


def error_path(out_dir: str, rank: int) -> str:
    """The server (rank 0) writes ``<output_dir>/error.json``, client process r ``clients/error_rank<r>.json``."""
    if int(rank or 0) == 0:
        return os.path.join(os.path.expanduser(out_dir), ERROR_NAME)
    return os.path.join(os.path.expanduser(out_dir), "clients", f"error_rank{int(rank)}.json")


def write_error(out_dir: Optional[str], rank: int, exc: BaseException, code: int) -> None:
    from .fedml_adapter.errors import one_line

    if not out_dir:
        return
    record = {"error": one_line(exc), "type": type(exc).__name__, "exit_status": code, "rank": int(rank or 0),
              "user_error": code == EXIT_CONFIG, "time": time.time()}
    details = getattr(exc, "details", None)   # a UserError's dict; gRPC errors have a details() method
    if isinstance(details, dict):
        record.update(details)
    path = error_path(out_dir, rank)
    try:
        from .core.checkpoint import write_text
        write_text(path, json.dumps(record, indent=2, default=str))
    except OSError:
        pass


def _clear_error(out_dir: Optional[str]) -> None:
    if out_dir:
        try:
            os.remove(error_path(out_dir, 0))
        except OSError:
            pass


def _raw_write(stream, text: str) -> None:
    if stream is None:
        return
    try:
        type(stream).write(stream, text)  # the class's write, not FedML's replacement
        stream.flush()
    except Exception:
        pass


def _exit_now(distributed: bool, code: int) -> None:
    """A failed cross-silo party may still hold backend threads (a GRPC server): end the process."""
    if not distributed:
        return
    from .fedml_adapter.process_end import exit_process

    exit_process(code)


def _abort_mpi(mpi: bool, code: int) -> None:
    """A failed rank of an MPI job: end the whole job (the other ranks would wait for it forever)."""
    if not mpi:
        return
    try:
        from mpi4py import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            from .fedml_adapter.process_end import abort_mpi_job

            abort_mpi_job(code, MPI.COMM_WORLD)
    except Exception:
        pass


def main(argv: Optional[List[str]] = None) -> int:
    cmd = _parser().parse_args(argv)
    return run(cmd)


if __name__ == "__main__":
    sys.exit(main())
