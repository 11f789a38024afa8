"""The plugin's user errors: what a user can fix (a config key, a file, a client), as opposed to bugs.

Every one of them carries a message that names the key, file or client and what was expected.
``python -m fedml_fedmitr`` (and ``python -m fedml_fedmitr.server_only``) print such an error as
one line ``fedml_fedmitr: error: <message>`` on stderr, without a stack trace, and exit with
status 2. Anything else is a bug or an environment failure: it exits 1 with its traceback.

* :class:`~fedml_fedmitr.core.config.ConfigError` (a ``ValueError``): a bad configuration value;
  :class:`~fedml_fedmitr.data.DataError` (a ``ConfigError``): a dataset file or array.
* :class:`~fedml_fedmitr.core.models.ModelError` (a ``ValueError``): a model or weights that do not
  fit (another architecture, NaN/Inf in an upload).
* :class:`~fedml_fedmitr.core.checkpoint.CheckpointError` (a ``ValueError``): a saved checkpoint that
  cannot be read (truncated, corrupt, not weights-only), named.
* :class:`UserError` and its subclasses, raised by the FedML adapter:
  :class:`ClientFailure` (clients missing after ``client_timeout_s``, an empty client),
  :class:`ServerStopped` (a client told by the server that the run failed),
  :class:`StateError` (saved server state that does not belong to this run).

This module is FedML-free.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..core.checkpoint import CheckpointError
from ..core.config import ConfigError
from ..core.models import ModelError

EXIT_USER_ERROR = 2


class UserError(Exception):
    """An error the user can fix; ``details`` goes into ``error.json``."""

    def __init__(self, message: str, details: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.details = dict(details or {})


class ClientFailure(UserError):
    """Clients did not deliver (missing after the timeout, fewer than ``min_clients``, empty)."""


class ServerStopped(UserError):
    """A client learnt from the server that the run failed there (the message says why)."""


class StateError(UserError):
    """Saved server state (uploads, checkpoints) that cannot be resumed with these settings."""


USER_ERRORS = (ConfigError, ModelError, UserError, CheckpointError)


def is_user_error(exc: BaseException) -> bool:
    return isinstance(exc, USER_ERRORS)


def one_line(exc: BaseException) -> str:
    """The error message on one line (a multi-line message is joined with ' | ')."""
    text = str(exc).strip() or type(exc).__name__
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())
