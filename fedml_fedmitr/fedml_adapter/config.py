"""Reading the plugin's settings out of a FedML YAML file / ``args`` namespace.

FedML flattens every YAML section into one ``args`` namespace, so the ``fedmitr_args`` section is
read from the YAML file itself (``args.yaml_config_file``) and a key that another section also
uses is refused (it would silently overwrite, or be overwritten by, that section's value).

Everything here is FedML-free and fast, so the CLI validates a config before importing FedML.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import yaml

from ..core.config import ClientTrainConfig, ConfigError, FedMITRConfig

SECTION = "fedmitr_args"
DATASETS = ("digits", "npz", "cifar10", "cifar100", "imagefolder")
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
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


# fedmitr_args keys read by the FedML adapter, not by the core's FedMITRConfig: custom_keys
# (run_checks.py), the GRPC security settings (grpc_security.py; never written to summary.json) and
# FedML run control (RunControl)
RUN_CONTROL_KEYS = ("client_timeout_s", "min_clients", "server_lost_s")
SECURITY_KEYS = ("auth_token", "tls_cert_file", "tls_key_file", "tls_ca_file")
ADAPTER_KEYS = ("custom_keys",) + SECURITY_KEYS + RUN_CONTROL_KEYS


@dataclass(frozen=True)
class RunControl:
    """How the FedML run waits for its parties (``fedmitr_args`` keys the core never sees)."""

    client_timeout_s: float = 0.0       # 0: wait for every client forever (FedML's behaviour)
    min_clients: int = 1                # fewest uploads the server proceeds with (after a timeout or refusals)
    server_lost_s: float = 300.0        # a GRPC client ends (exit 2) once the server's port refused this long; 0: never

    @classmethod
    def from_section(cls, values: Mapping[str, Any], where: str = SECTION) -> "RunControl":
        given = {}
        for key in RUN_CONTROL_KEYS:
            if key not in values:
                continue
            v = values[key]
            if key == "min_clients":
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigError(f"{where}.{key} = {v!r} is invalid: expected an integer")
                if v < 1:
                    raise ConfigError(f"{where}.{key} = {v!r} is invalid: expected an integer >= 1")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{where}.{key} = {v!r} is invalid: expected a finite number >= 0")
            given[key] = v
        return cls(**given)


@dataclass(frozen=True)
class PluginSettings:
    """Everything the plugin reads from the YAML, read and validated once at the boundary
    (:func:`read_settings`, or the CLI's validation) and handed down: the core gets ``method``."""

    method: FedMITRConfig               # fedmitr_args for the server method (the core)
    run: RunControl                     # fedmitr_args for FedML's run control
    client: ClientTrainConfig           # train_args: local training
    adapter: Dict[str, Any] = field(default_factory=dict)   # custom_keys and the security settings, as given
    given: Tuple[str, ...] = ()         # the fedmitr_args keys the YAML sets


def settings_from(sections: Optional[Mapping[str, Any]], args, path: str = "") -> PluginSettings:
    """:class:`PluginSettings` from the YAML ``sections`` (or, without a file, ``args.fedmitr_args``)
    and the flattened ``args`` namespace for ``train_args``."""
    if sections is not None:
        raw = dict(sections.get(SECTION) or {})
        own = fedmitr_section(sections, path)
    else:
        raw = getattr(args, SECTION, None) or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"args.{SECTION} must be a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        own = {k: v for k, v in raw.items() if k not in ADAPTER_KEYS}
        check_known_keys(own, path)
    core = {k: v for k, v in own.items() if k not in RUN_CONTROL_KEYS}
    settings = PluginSettings(method=FedMITRConfig.from_dict(core, where=SECTION),
                              run=RunControl.from_section(raw),
                              client=client_train_config(args),
                              adapter={k: v for k, v in raw.items() if k in ("custom_keys",) + SECURITY_KEYS},
                              given=tuple(raw))
    check_feature_prior(settings, args)
    return settings


def check_feature_prior(settings: PluginSettings, args) -> None:
    """A simulation whose clients withhold their feature statistics (``train_args.client_feature_stats:
    false``) cannot run a method that matches them (``fedmitr_args.feature_weight > 0``), nor can one whose
    clients do not send them per class (``train_args.client_class_feature_stats``, off by default) run the
    class-conditional prior (``fedmitr_args.feature_prior: per_class``): refused before any client
    trains. A cross-silo party's file describes only its own side; there the server names the clients
    that sent none when synthesis starts (``Ensemble.checked_feature_stats``)."""
    from ..core.methods import get_method, method_names

    method, client = settings.method, settings.client
    if method.feature_weight <= 0 or getattr(args, "training_type", "simulation") == "cross_silo":
        return
    name = getattr(args, "federated_optimizer", None)
    if name not in method_names() or "feature_weight" not in get_method(name).used_keys():
        return
    if not client.feature_stats and method.feature_prior == "global":
        raise ConfigError(f"train_args.client_feature_stats = false withholds the clients' feature statistics, "
                          f"but {SECTION}.feature_weight = {method.feature_weight} makes {name} match "
                          f"them: set feature_weight: 0 (inversion without the feature prior) or "
                          f"client_feature_stats: true")
    if not client.class_feature_stats and method.feature_prior == "per_class":
        raise ConfigError(f"{SECTION}.feature_prior = 'per_class' makes {name} match the clients' per-class "
                          f"feature statistics, but train_args.client_class_feature_stats is not true, so "
                          f"the clients do not send them: set client_class_feature_stats: true, or "
                          f"feature_prior: global")


def read_settings(args) -> PluginSettings:
    """The run's :class:`PluginSettings`: those the CLI validated (``args.fedmitr_settings``), else read
    once from ``args.yaml_config_file`` (a stock ``main.py``) and kept on ``args``."""
    cached = getattr(args, "fedmitr_settings", None)
    if isinstance(cached, PluginSettings):
        return cached
    path = getattr(args, "yaml_config_file", "") or ""
    settings = settings_from(load_yaml(path) if path else None, args, path)
    try:
        args.fedmitr_settings = settings
    except AttributeError:
        pass
    return settings


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

    known = sorted([f.name for f in fields(FedMITRConfig)] + list(ADAPTER_KEYS))
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
    """The core's :class:`FedMITRConfig` of the run (``args.fedmitr_config`` if set, else from
    :func:`read_settings`)."""
    cached = getattr(args, "fedmitr_config", None)
    if isinstance(cached, FedMITRConfig):
        return cached
    return read_settings(args).method


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


def _one_of(args, key: str, options, default, section: str = "data_args"):
    value = getattr(args, key, default)
    if value not in options:
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected one of {', '.join(options)}")
    return value


def _bool(args, key: str, default: bool, section: str = "train_args") -> bool:
    value = getattr(args, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected true or false")
    return value


OPTIMIZER_ALIASES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}


def client_train_config(args) -> ClientTrainConfig:
    """FedML's ``train_args`` (epochs, batch_size, learning_rate, client_optimizer, weight_decay,
    and the plugin's optional momentum, client_augment, client_flip, label_smoothing,
    client_feature_stats, client_class_feature_stats)."""
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
        feature_stats=_bool(args, "client_feature_stats", True),
        class_feature_stats=_bool(args, "client_class_feature_stats", False),
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
    method = _one_of(args, "partition_method", PARTITIONS, "hetero")
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
    holds = {"cifar10": "holds cifar-10-batches-py", "cifar100": "holds cifar-100-python",
             "imagefolder": "holds train/<class>/* and test/<class>/* (or val/) image files"}
    if name in holds:
        root = getattr(args, "data_cache_dir", None)
        if not root or not isinstance(root, str):
            raise ConfigError(f"data_args.data_cache_dir is required for dataset: {name} (the folder that "
                              f"{holds[name]})")
    _one_of(args, "interpolation", INTERPOLATIONS, "bilinear")
    for key in ("input_mean", "input_std"):
        value = getattr(args, key, None)
        if value is not None and (not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            raise ConfigError(f"data_args.{key} = {value!r} is invalid: expected a list of numbers, one per channel")
    std = getattr(args, "input_std", None)
    if std is not None and any(v <= 0 for v in std):
        raise ConfigError(f"data_args.input_std = {std!r} is invalid: every value must be > 0")


def check_model_args(args) -> None:
    import timm

    from ..core import models as _models  # noqa: F401  (registers the fedmitr_vit_* presets)

    name = getattr(args, "model", None)
    if not isinstance(name, str) or not timm.is_model(name):
        raise ConfigError(f"model_args.model = {name!r} is invalid: expected a timm ViT name such as "
                          f"fedmitr_vit_micro, fedmitr_vit_tiny, vit_tiny_patch16_224")
    from .model import apply_pretrained_input, check_client_models
    apply_pretrained_input(args)   # a pretrained model's own input size is the one checked below
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
    if getattr(args, "checkpoint", None) and getattr(args, "pretrained_path", None):
        raise ConfigError("model_args.checkpoint and model_args.pretrained_path name the same thing: give one")
    if getattr(args, "pretrained", False) and (getattr(args, "checkpoint", None) or getattr(args, "pretrained_path", None)):
        raise ConfigError("model_args.pretrained (timm's published weights) and a checkpoint file exclude each "
                          "other: give one")
    for key in ("checkpoint", "pretrained_path"):
        path = getattr(args, key, None)
        if path and not os.path.isfile(os.path.expanduser(str(path))):
            raise ConfigError(f"model_args.{key} = {path!r}: no such file")
    check_client_models(args)


def check_mixed_clients(args, settings, method) -> None:
    """What a method cannot do with clients of several architectures (model_args.client_models)."""
    names = getattr(args, "client_models", None)
    if not names or len(set(names)) == 1 and names[0] == args.model:
        return
    cfg = settings.method
    if cfg.client_screening:
        raise ConfigError("fedmitr_args.client_screening compares the clients' weights, which needs one "
                          "architecture: model_args.client_models gives several (set client_screening: false)")
    averages = method.name == "OneShotFedAvg" or cfg.student_init == "fedavg"
    if averages and args.model not in names:
        raise ConfigError(f"{'OneShotFedAvg' if method.name == 'OneShotFedAvg' else 'fedmitr_args.student_init: fedavg'} "
                          f"averages the clients of the global architecture model_args.model = {args.model!r}, "
                          f"which none of model_args.client_models {list(names)} has: add it there, or set "
                          "student_init: scratch (or pretrained)")
