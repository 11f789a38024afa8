"""Reading the plugin's settings out of a FedML YAML file / ``args`` namespace.

FedML flattens every YAML section into one ``args`` namespace, so the ``fedmitr_args`` section is
read from the YAML file itself (``args.yaml_config_file``) and a key that another section also
uses is refused (it would silently overwrite, or be overwritten by, that section's value).

Everything here is FedML-free and fast, so the CLI validates a config before importing FedML.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Mapping, Optional

import yaml

from ..core.config import ClientTrainConfig, ConfigError, FedMITRConfig

SECTION = "fedmitr_args"
DATASETS = ("digits", "npz", "cifar10")
PARTITIONS = ("hetero", "pathological", "homo")


def load_yaml(path) -> Dict[str, Any]:
    """The YAML file as a mapping of sections; ConfigError naming the file otherwise."""
    if not path:
        raise ConfigError("no configuration file: pass --cf CONFIG.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"configuration file {str(path)!r} does not exist")
    try:
        with open(path, "r") as stream:
            data = yaml.load(stream, Loader=_unique_key_loader(str(path)))
    except yaml.YAMLError as exc:
        raise ConfigError(f"configuration file {str(path)!r} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"configuration file {str(path)!r} must be a mapping of sections "
                          f"(common_args:, data_args:, ...), got {type(data).__name__}")
    for name, section in data.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: section {name!r} must be a mapping of keys, got {type(section).__name__}")
    return data


def _unique_key_loader(path: str):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one
    silently): a repeated ``train_args:`` section or a repeated ``epochs:`` would reset earlier values."""
    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    what = "section" if node.start_mark.column == 0 else "key"
                    raise ConfigError(f"configuration file {path!r}: {what} {key!r} appears twice (lines "
                                      f"{seen[key] + 1} and {key_node.start_mark.line + 1}); YAML would keep only "
                                      "the last one: merge them into one")
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)
    return UniqueKeyLoader


# fedmitr_args keys read by the FedML adapter, not by the core's FedMITRConfig: custom_keys (below) and
# the GRPC security settings (grpc_security.py); they never reach summary.json
ADAPTER_KEYS = ("custom_keys", "auth_token", "tls_cert_file", "tls_key_file", "tls_ca_file")


def adapter_settings(args) -> Dict[str, Any]:
    """The adapter's own ``fedmitr_args`` keys (ADAPTER_KEYS) of ``args``' YAML file or dict."""
    path = getattr(args, "yaml_config_file", "") or ""
    values = (load_yaml(path).get(SECTION) if path else getattr(args, SECTION, None)) or {}
    return {k: v for k, v in dict(values).items() if k in ADAPTER_KEYS}

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


def flatten(sections: Mapping[str, Any]) -> Dict[str, Any]:
    """FedML's flattening of the sections into one namespace (later sections win)."""
    out: Dict[str, Any] = {}
    for section in sections.values():
        out.update(section or {})
    return out


def fedmitr_section(sections: Mapping[str, Any], path: str = "") -> Dict[str, Any]:
    """The ``fedmitr_args`` mapping, after refusing keys that another section also sets."""
    own = {k: v for k, v in (sections.get(SECTION) or {}).items() if k not in ADAPTER_KEYS}
    for key in own:
        for name, section in sections.items():
            if name != SECTION and isinstance(section, dict) and key in section:
                raise ConfigError(
                    f"{SECTION}.{key} is also set in {name}.{key}{' of ' + path if path else ''}: FedML "
                    f"flattens all sections into one namespace, so the two would overwrite each other; "
                    f"remove one of them")
    check_known_keys(own, path)
    return own


def check_known_keys(values: Mapping[str, Any], path: str = "") -> None:
    """Refuse an unknown ``fedmitr_args`` key, suggesting the known key it probably misspells."""
    import difflib
    from dataclasses import fields

    known = sorted(f.name for f in fields(FedMITRConfig))
    for key in values:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"accepted keys are: {', '.join(known)}"
        raise ConfigError(f"{SECTION}: unknown key {key!r}{' in ' + path if path else ''}; {hint}")


def check_output_dir(path: Any, key: str = f"{SECTION}.output_dir", create: bool = False) -> None:
    """``output_dir`` must be a writable directory or creatable in one. With ``create`` it is created
    and a probe file written and removed there (``os.access`` says yes to root even where the kernel
    then refuses, e.g. under /proc)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key} = {path!r} is invalid: expected a folder path")
    target = os.path.abspath(os.path.expanduser(path))
    probe = target
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{key} = {path!r} is not writable: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} = {path!r} is not writable: no write permission on {probe}")
    if create:
        test = os.path.join(target, f".fedmitr_write_test_{os.getpid()}")
        try:
            os.makedirs(target, exist_ok=True)
            with open(test, "w") as fh:
                fh.write("ok")
            os.remove(test)
        except OSError as exc:
            raise ConfigError(f"{key} = {path!r} cannot be created or written: {exc.strerror or exc}") from exc


def read_fedmitr_config(args) -> FedMITRConfig:
    """:class:`FedMITRConfig` from the ``fedmitr_args`` section of ``args.yaml_config_file``.

    Programmatic use without a YAML file: a dict in ``args.fedmitr_args`` is used instead.
    """
    cached = getattr(args, "fedmitr_config", None)
    if isinstance(cached, FedMITRConfig):
        return cached
    path = getattr(args, "yaml_config_file", "") or ""
    if path:
        values = fedmitr_section(load_yaml(path), path)
    else:
        values = getattr(args, SECTION, None) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"args.{SECTION} must be a mapping, got {type(values).__name__}")
        values = {k: v for k, v in values.items() if k not in ADAPTER_KEYS}
    return FedMITRConfig.from_dict(values, where=SECTION)


def _int(args, key: str, default=None, minimum: Optional[int] = None, section: str = "train_args") -> int:
    value = getattr(args, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected an integer")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected an integer >= {minimum}")
    return value


def _float(args, key: str, default=None, section: str = "train_args", minimum: float = 0.0,
           strict: bool = False) -> float:
    value = getattr(args, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected a number")
    if (strict and not value > minimum) or value < minimum:
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected a number "
                          f"{'>' if strict else '>='} {minimum}")
    return float(value)


def _bool(args, key: str, default: bool, section: str = "train_args") -> bool:
    value = getattr(args, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected true or false")
    return value


OPTIMIZER_ALIASES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}


def client_train_config(args) -> ClientTrainConfig:
    """FedML's ``train_args`` (epochs, batch_size, learning_rate, client_optimizer, weight_decay,
    and the plugin's optional momentum, client_augment, client_flip, label_smoothing)."""
    opt = getattr(args, "client_optimizer", "adamw")
    if not isinstance(opt, str) or opt.lower() not in OPTIMIZER_ALIASES:
        raise ConfigError(f"train_args.client_optimizer = {opt!r} is invalid: expected 'adamw', 'adam' or 'sgd'")
    cfg = ClientTrainConfig(
        epochs=_int(args, "epochs", 10, 1),
        batch_size=_int(args, "batch_size", 32, 1),
        lr=_float(args, "learning_rate", 1e-3, strict=True),
        optimizer=OPTIMIZER_ALIASES[opt.lower()],
        weight_decay=_float(args, "weight_decay", 0.0),
        momentum=_float(args, "momentum", 0.9),
        augment=_bool(args, "client_augment", True),
        flip=_bool(args, "client_flip", True),
        label_smoothing=_float(args, "label_smoothing", 0.0),
    )
    if cfg.label_smoothing >= 1.0:
        raise ConfigError(f"train_args.label_smoothing = {cfg.label_smoothing!r} is invalid: expected [0, 1)")
    return cfg.validate("train_args")


def check_run_args(args) -> None:
    """Validate the FedML keys the one-shot flow relies on (raises ConfigError naming the key)."""
    _int(args, "client_num_in_total", None, 1, "train_args")
    per_round = getattr(args, "client_num_per_round", None)
    if per_round is not None:
        _int(args, "client_num_per_round", None, 1, "train_args")
    comm_round = getattr(args, "comm_round", 1)
    if comm_round not in (1, None):
        raise ConfigError(f"train_args.comm_round = {comm_round!r} is invalid: the one-shot methods of this "
                          "plugin run exactly one communication round (comm_round: 1)")
    seed = getattr(args, "random_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"common_args.random_seed = {seed!r} is invalid: expected an integer >= 0")
    if per_round is not None and per_round != args.client_num_in_total:
        raise ConfigError(f"train_args.client_num_per_round = {per_round!r} but client_num_in_total = "
                          f"{args.client_num_in_total}: a one-shot round trains and uploads every client once "
                          f"(expected client_num_per_round = {args.client_num_in_total}, or leave it out)")
    threads = getattr(args, "torch_num_threads", None)
    if threads is not None:
        _int(args, "torch_num_threads", None, 1, "common_args")


def check_data_args(args) -> None:
    """Static checks of the plugin's data keys (before anything is loaded)."""
    name = getattr(args, "dataset", None)
    if name not in DATASETS:
        raise ConfigError(f"data_args.dataset = {name!r} is invalid: the plugin's loader knows "
                          f"{', '.join(DATASETS)} (a stock FedML main.py can pass any dataset of its own)")
    method = getattr(args, "partition_method", "hetero")
    if method not in PARTITIONS:
        raise ConfigError(f"data_args.partition_method = {method!r} is invalid: expected one of "
                          f"{', '.join(PARTITIONS)}")
    if method == "hetero":
        _float(args, "partition_alpha", 0.5, "data_args", strict=True)
    if method == "pathological":
        _int(args, "classes_per_client", 2, 1, "data_args")
    _int(args, "partition_min_size", 10, 1, "data_args")
    frac = getattr(args, "test_fraction", 0.2)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
        raise ConfigError(f"data_args.test_fraction = {frac!r} is invalid: expected a number in (0, 1)")
    if name == "npz":
        path = getattr(args, "npz_path", None)
        if not path or not isinstance(path, str):
            raise ConfigError("data_args.npz_path is required for dataset: npz (an .npz archive with "
                              "x_train, y_train, x_test, y_test)")
        if not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"data_args.npz_path = {path!r}: no such file")
    if name == "cifar10":
        root = getattr(args, "data_cache_dir", None)
        if not root or not isinstance(root, str):
            raise ConfigError("data_args.data_cache_dir is required for dataset: cifar10 (the folder that "
                              "holds cifar-10-batches-py)")


def check_model_args(args) -> None:
    import timm

    from ..core import models as _models  # noqa: F401  (registers the fedmitr_vit_* presets)

    name = getattr(args, "model", None)
    if not isinstance(name, str) or not timm.is_model(name):
        raise ConfigError(f"model_args.model = {name!r} is invalid: expected a timm ViT name such as "
                          f"fedmitr_vit_micro, fedmitr_vit_tiny, vit_tiny_patch16_224")
    img = _int(args, "img_size", 16, 1, "model_args")
    if getattr(args, "patch_size", None) is not None:
        patch = _int(args, "patch_size", None, 1, "model_args")
        if img % patch:
            raise ConfigError(f"model_args.patch_size = {patch} does not divide model_args.img_size = {img}: the "
                              f"ViT would see a {img // patch}x{img // patch} grid and never the last {img % patch} "
                              "rows and columns of pixels (expected a patch size that divides img_size)")
    if getattr(args, "in_chans", None) is not None:
        _int(args, "in_chans", None, 1, "model_args")
    _bool(args, "pretrained", False, "model_args")
    path = getattr(args, "pretrained_path", None)
    if path and not os.path.isfile(os.path.expanduser(str(path))):
        raise ConfigError(f"model_args.pretrained_path = {path!r}: no such file")


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
