"""Checks of a FedML configuration beyond single values: FedML features the one-shot methods do not
apply, keys that neither FedML nor the plugin reads (misspellings), and the GRPC address table (every
rank listed, this party's port free). FedML-free: FedML's source is scanned, never imported.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Mapping, Optional

from ..core.config import ConfigError
from .config import SECTION

# FedML features that act on uploads or training rounds; the one-shot methods here do not apply them
UNAPPLIED = {
    "enable_dp": "FedML's differential privacy (dp_args)",
    "enable_defense": "FedML's defences against poisoned updates (defense_args; see fedmitr_args.client_screening)",
    "enable_attack": "FedML's attack simulation (attack_args)",
    "enable_fhe": "FedML's homomorphic encryption (fhe_args)",
    "enable_contribution": "FedML's contribution assessment",
}


def check_unapplied(sections: Mapping[str, Any]) -> None:
    """Refuse FedML features the one-shot methods do not apply, instead of running without them."""
    for name, section in sections.items():
        for key, what in UNAPPLIED.items():
            if isinstance(section, dict) and section.get(key) not in (None, False, 0, "false", "False"):
                raise ConfigError(f"{name}.{key} = {section[key]!r}: fedml_fedmitr does not apply {what} to its "
                                  f"one-shot uploads, so the run would go without it; remove {key} or set it to false")


def custom_keys(sections: Mapping[str, Any]) -> List[str]:
    """``fedmitr_args.custom_keys``: keys of the user's own in FedML's sections (not checked for typos)."""
    keys = (sections.get(SECTION) or {}).get("custom_keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ConfigError(f"{SECTION}.custom_keys = {keys!r} is invalid: expected a list of key names")
    return keys


_KEY_PATTERN = None


def _scan_keys(root: str) -> set:
    """Names read as ``args.NAME`` / ``getattr(args, "NAME")`` in the .py files under ``root``, and the
    keys of the YAML files there."""
    import re
    global _KEY_PATTERN
    if _KEY_PATTERN is None:
        _KEY_PATTERN = re.compile(r"args\.([A-Za-z_]\w*)|(?:hasattr|getattr|setattr)\(\s*(?:self\.)?args\s*,\s*"
                                  r"[\"']([A-Za-z_]\w*)")
    names: set = set()
    yaml_key = re.compile(r"^\s*([A-Za-z_]\w*)\s*:", re.M)
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith((".py", ".yaml", ".yml")):
                try:
                    with open(os.path.join(folder, f), errors="ignore") as fh:
                        text = fh.read()
                except OSError:
                    continue
                if f.endswith(".py"):
                    names.update(a or b for a, b in _KEY_PATTERN.findall(text))
                else:
                    names.update(yaml_key.findall(text))
    return names


_known_cache: Optional[set] = None


def known_run_keys() -> set:
    """Every key FedML (the installed version, scanned without importing it) or this plugin reads from
    FedML's ``args``; None-safe when FedML is not installed (then only the plugin's)."""
    global _known_cache
    if _known_cache is None:
        import importlib.util
        names = _scan_keys(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        spec = importlib.util.find_spec("fedml")
        if spec is not None and spec.submodule_search_locations:
            names |= _scan_keys(list(spec.submodule_search_locations)[0])
        _known_cache = names
    return _known_cache


def check_run_keys(sections: Mapping[str, Any], path: str = "") -> List[str]:
    """Keys of FedML's sections that neither FedML nor the plugin reads: a near miss of a known key is
    refused with "did you mean"; any other is returned (the caller warns once). Keys listed in
    ``fedmitr_args.custom_keys`` are the user's own and pass."""
    import difflib

    own = set(custom_keys(sections))
    known = known_run_keys()
    unknown = []
    for name, section in sections.items():
        if name == SECTION or not isinstance(section, dict):
            continue
        for key in section:
            if not isinstance(key, str) or key in known or key in own:
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            if close:
                raise ConfigError(f"{name}.{key}{' in ' + path if path else ''} is not a setting FedML or "
                                  f"fedml_fedmitr reads; did you mean {close[0]!r}? (a key of your own: list it "
                                  f"in {SECTION}.custom_keys)")
            unknown.append(f"{name}.{key}")
    return unknown


def read_grpc_ipconfig(path: Any, key: str = "comm_args.grpc_ipconfig_path") -> Dict[int, Dict[str, Any]]:
    """FedML's GRPC address table (CSV: eid, rank, grpc_server_ip, grpc_server_port[, ingress_ip]) by eid."""
    import csv

    if not isinstance(path, str) or not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"{key} = {path!r}: no such file (a CSV with eid, rank, grpc_server_ip, grpc_server_port)")
    with open(os.path.expanduser(path), newline="") as fh:
        rows = list(csv.DictReader(fh))
    table: Dict[int, Dict[str, Any]] = {}
    for i, row in enumerate(rows, start=2):
        try:
            eid, port = int(row["eid"]), int(row["grpc_server_port"])
            ip = str(row["grpc_server_ip"]).strip()
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{key} = {path!r}, line {i}: expected integer eid and grpc_server_port and a "
                              "grpc_server_ip (columns eid, rank, grpc_server_ip, grpc_server_port)") from None
        if eid in table:
            raise ConfigError(f"{key} = {path!r}, line {i}: eid {eid} appears twice")
        table[eid] = {"ip": ip, "port": port}
    return table


def check_grpc_endpoint(args, rank: int) -> None:
    """Cross-silo GRPC: this party's rank must be in the address table (FedML would otherwise listen on
    every interface, 0.0.0.0), and its port must not already be served (grpc shares a port between
    servers with SO_REUSEPORT, so a second server or a second client of the same rank would go
    unnoticed and the federation would hang)."""
    import socket

    if getattr(args, "training_type", None) != "cross_silo" or getattr(args, "backend", None) != "GRPC":
        return
    key = "comm_args.grpc_ipconfig_path"
    path = getattr(args, "grpc_ipconfig_path", None)
    table = read_grpc_ipconfig(path, key)
    workers = getattr(args, "worker_num", None)
    expected = range(0, int(workers) + 1) if isinstance(workers, int) else [rank]
    missing = [r for r in expected if r not in table]
    if missing:
        raise ConfigError(f"{key} = {path!r} has no row for rank(s) {missing}: every party needs its address "
                          "there (FedML would listen on all interfaces, 0.0.0.0, and could not reach it)")
    me = table[rank]
    if me["ip"] in ("0.0.0.0", "::", ""):
        logging.getLogger("fedml_fedmitr").warning(
            "fedml_fedmitr: warning: %s gives rank %d the address %r: it listens on every interface", path, rank,
            me["ip"])
    family = socket.AF_INET6 if ":" in me["ip"] else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.bind((me["ip"], me["port"]))
    except OSError as exc:
        raise ConfigError(f"rank {rank} cannot listen on {me['ip']}:{me['port']} ({key} = {path!r}): "
                          f"{exc.strerror or exc}; another server or a client with the same rank already runs "
                          "there, or the address is not this machine's") from None
    finally:
        probe.close()


# ---- processes (the CLI's checks of how many parties there are) ----
def mpi_env_rank_size():
    """(rank, size) of this process as mpirun announces it (MPICH/Hydra or Open MPI), else (None, None)."""
    for rank_key, size_key in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if os.environ.get(size_key, "").isdigit():
            rank = os.environ.get(rank_key, "0")
            return (int(rank) if rank.isdigit() else 0), int(os.environ[size_key])
    return None, None


def section_of(sections: Mapping[str, Any], key: str, default: str) -> str:
    """``section.key`` of the YAML section that sets ``key`` (``default.key`` if none does), for messages."""
    for name, section in sections.items():
        if isinstance(section, dict) and key in section:
            return f"{name}.{key}"
    return f"{default}.{key}"


def check_processes(sections, flat) -> None:
    """Client processes must not outnumber clients; ``min_clients`` <= clients; deadlines need GRPC/MPI."""
    k = flat.client_num_in_total
    run = flat.fedmitr_settings.run
    min_clients = run.min_clients
    if min_clients > k:
        raise ConfigError(f"fedmitr_args.min_clients = {min_clients} is more than train_args.client_num_in_total = "
                          f"{k}: expected at most {k}")
    t, backend = getattr(flat, "training_type", None), getattr(flat, "backend", None)
    if t == "cross_silo":
        workers = getattr(flat, "worker_num", None)
        where = section_of(sections, "worker_num", "device_args")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"{where} = {workers!r} is invalid: expected the number of client processes (>= 1)")
        if workers > k:
            raise ConfigError(f"{where} = {workers} client processes but train_args.client_num_in_total = {k}: "
                              "every client process must train at least one client (expected worker_num <= "
                              "client_num_in_total)")
    if t == "simulation" and backend == "MPI":
        _, size = mpi_env_rank_size()
        if size is not None and size - 1 > k:
            raise ConfigError(f"mpirun started {size} processes (1 server + {size - 1} clients) but "
                              f"train_args.client_num_in_total = {k}: every client process must train at least one "
                              f"client (use mpirun -n {k + 1} or fewer, or raise client_num_in_total)")
    timeout = run.client_timeout_s
    if timeout and (t == "cross_silo" or backend == "MPI") and backend not in ("GRPC", "MPI"):
        raise ConfigError(f"fedmitr_args.client_timeout_s = {timeout!r} needs comm_args.backend GRPC or MPI "
                          f"(got {backend!r}); set it to 0 to wait for every client")
