"""Who may talk to a GRPC party: a shared secret (HMAC) on every message, and TLS from GRPC's own
credentials.

FedML 0.9.6's GRPC parties accept a message from anyone who reaches the port, over plain TCP. With
``fedmitr_args.auth_token`` (or the environment variable ``FEDMITR_AUTH_TOKEN``, which keeps the
secret out of YAML files) every message a party sends carries an HMAC-SHA256 tag of its bytes
under that token, and a party drops, with one logged line naming the peer, any message whose tag is
missing or wrong, before a byte of it is unpickled. With ``fedmitr_args.tls_cert_file`` and
``tls_key_file`` (PEM) every party listens with ``grpc.ssl_server_credentials`` and sends over
``grpc.secure_channel``; with ``tls_ca_file`` as well, peers must present a certificate signed by
that CA (mutual TLS) and the server's certificate is checked against it.

FedML creates its server, channels and stubs inside ``GRPCCommManager``:
:func:`fedml_fedmitr.fedml_adapter.fedml_patches.fix_grpc_loop` replaces the ``grpc`` name in that
one module with :class:`GrpcFacade`, which forwards everything to grpc
and changes three calls: ``grpc.server`` (TLS port, and ``grpc.so_reuseport`` off, so a second
server on a served port fails instead of sharing it), ``grpc.insecure_channel`` (a secure channel
under TLS; the message signed). The tag does not stop a recorded message from being replayed
within the run: use TLS against eavesdroppers.

FedML-free: the patch itself lives in :mod:`.fedml_patches`.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..core.config import ConfigError
from .safe_pickle import RefusedMessage

MAGIC = b"FMTR-HMAC1:"
TAG_BYTES = 32
ENV_TOKEN = "FEDMITR_AUTH_TOKEN"
KEYS = ("auth_token", "tls_cert_file", "tls_key_file", "tls_ca_file")


@dataclass
class GrpcSecurity:
    token: Optional[bytes] = None
    cert: Optional[bytes] = None
    key: Optional[bytes] = None
    ca: Optional[bytes] = None

    @property
    def tls(self) -> bool:
        return self.cert is not None

    def sign(self, data: bytes) -> bytes:
        if self.token is None:
            return data
        return MAGIC + hmac.new(self.token, data, hashlib.sha256).digest() + data

    def verify(self, data: bytes) -> bytes:
        """The message bytes without the tag; RefusedMessage if the tag is missing or wrong."""
        signed = isinstance(data, (bytes, bytearray)) and bytes(data[:len(MAGIC)]) == MAGIC
        if self.token is None:
            if signed:
                raise RefusedMessage("it is signed with an auth_token and this party has none "
                                     "(set the same fedmitr_args.auth_token or FEDMITR_AUTH_TOKEN everywhere)")
            return data
        if not signed:
            raise RefusedMessage("it carries no authentication tag (the sender lacks fedmitr_args.auth_token)")
        tag, body = bytes(data[len(MAGIC):len(MAGIC) + TAG_BYTES]), bytes(data[len(MAGIC) + TAG_BYTES:])
        if not hmac.compare_digest(tag, hmac.new(self.token, body, hashlib.sha256).digest()):
            raise RefusedMessage("its authentication tag is wrong (another auth_token, or altered on the way)")
        return body

    def server_credentials(self):
        import grpc
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self):
        import grpc
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _read(section: Mapping[str, Any], key: str) -> Optional[bytes]:
    path = section.get(key)
    if path is None:
        return None
    if not isinstance(path, str) or not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"fedmitr_args.{key} = {path!r}: no such file (a PEM file)")
    with open(os.path.expanduser(path), "rb") as fh:
        data = fh.read()
    if b"-----BEGIN" not in data:
        raise ConfigError(f"fedmitr_args.{key} = {path!r} is not a PEM file")
    return data


def security_from(section: Optional[Mapping[str, Any]]) -> GrpcSecurity:
    """The GRPC security settings of a ``fedmitr_args`` mapping (ConfigError naming a bad key)."""
    section = dict(section or {})
    token = section.get("auth_token")
    if token is None and os.environ.get(ENV_TOKEN):
        token = os.environ[ENV_TOKEN]
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        raise ConfigError("fedmitr_args.auth_token (or FEDMITR_AUTH_TOKEN) is invalid: expected a secret string of "
                          "at least 16 characters, the same for every party")
    cert, key, ca = (_read(section, k) for k in ("tls_cert_file", "tls_key_file", "tls_ca_file"))
    if (cert is None) != (key is None):
        raise ConfigError("fedmitr_args.tls_cert_file and tls_key_file go together: give both (PEM) or neither")
    if ca is not None and cert is None:
        raise ConfigError("fedmitr_args.tls_ca_file needs tls_cert_file and tls_key_file (this party's own)")
    return GrpcSecurity(token=token.encode() if token else None, cert=cert, key=key, ca=ca)


class _SigningChannel:
    """A grpc channel whose unary calls sign ``request.message`` first."""

    def __init__(self, channel, security: GrpcSecurity):
        self._channel, self._security = channel, security

    def unary_unary(self, *args, **kwargs):
        call = self._channel.unary_unary(*args, **kwargs)
        security = self._security

        def signed(request, *a, **kw):
            if hasattr(request, "message"):
                request.message = security.sign(request.message)
            return call(request, *a, **kw)
        return signed

    def __getattr__(self, name):
        return getattr(self._channel, name)


class _Server:
    def __init__(self, server, security: GrpcSecurity):
        self._server, self._security = server, security

    def add_insecure_port(self, address):
        if self._security.tls:
            return self._server.add_secure_port(address, self._security.server_credentials())
        return self._server.add_insecure_port(address)

    def __getattr__(self, name):
        return getattr(self._server, name)


class GrpcFacade:
    """The ``grpc`` module as GRPCCommManager sees it once the GRPC fix is applied."""

    def __init__(self, grpc_module, security: GrpcSecurity):
        self._grpc, self.security = grpc_module, security

    def server(self, *args, options=None, **kwargs):
        options = [o for o in (options or []) if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 0)]
        return _Server(self._grpc.server(*args, options=options, **kwargs), self.security)

    def insecure_channel(self, target, options=None, **kwargs):
        if self.security.tls:
            channel = self._grpc.secure_channel(target, self.security.channel_credentials(), options=options, **kwargs)
        else:
            channel = self._grpc.insecure_channel(target, options=options, **kwargs)
        return _SigningChannel(channel, self.security)

    def __getattr__(self, name):
        return getattr(self._grpc, name)


_active = GrpcSecurity()


def active() -> GrpcSecurity:
    """The security settings the receive loop checks messages against."""
    return _active


def set_active(security: GrpcSecurity) -> None:
    """The settings the receive loop checks messages against from now on."""
    global _active
    _active = security
