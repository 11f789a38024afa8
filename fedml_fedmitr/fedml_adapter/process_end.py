"""Ending a process on purpose without losing its last lines: flush, then ``os._exit`` or ``MPI.Abort``.

Used by the CLI (a failed cross-silo party, a failed MPI rank) and by the server manager (an MPI
job whose client process never uploaded). FedML-free; ``mpi4py`` is imported only when aborting.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Optional

# mpirun forwards each rank's output through a pipe, and MPI.Abort kills every rank at once: on a
# busy machine the line printed just before Abort was lost (seen in CI). This gives it time.
FORWARD_PAUSE_S = 1.0


def flush_output() -> None:
    """Flush the plugin's and the root logger's handlers, then the process's real stdout and stderr."""
    for handler in logging.getLogger("fedml_fedmitr").handlers + logging.root.handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def exit_process(code: int) -> None:
    """Flush, then end this process at once (backend threads such as a GRPC server cannot hold it)."""
    flush_output()
    os._exit(code)


def abort_mpi_job(code: int, comm: Optional[Any] = None) -> None:
    """Flush, give mpirun a moment to forward the output, then ``Abort(code)`` on ``comm``
    (``MPI.COMM_WORLD`` when None): every rank of the job ends."""
    flush_output()
    time.sleep(FORWARD_PAUSE_S)
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    comm.Abort(code)
