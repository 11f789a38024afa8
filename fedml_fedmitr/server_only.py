"""Rerun the server alone from the client uploads a run saved: no client, no FedML runtime.

    python -m fedml_fedmitr.server_only --cf CONFIG [--uploads PATH] [--optimizer NAME]
                                        [--output_dir DIR] [--set KEY=VALUE ...] [--fresh]

Every run's server saves the uploads it received to ``<output_dir>/state/uploads.pt`` before its
long work (synthesis, distillation). This command loads them and runs the server's aggregation
again, exactly as the federated run's server would, with the same config file's data, model and
``fedmitr_args`` unless told otherwise:

* ``--uploads PATH``: the saved uploads (default: ``<output_dir>/state/uploads.pt`` of the config);
* ``--optimizer NAME``: another server method (``FedMITR``, ``DeepInversion``, ``DENSE``,
  ``OneShotFedAvg``, ...), compared on the very same client models;
* ``--set KEY=VALUE``: override a ``fedmitr_args`` key (YAML value), e.g. ``--set distill_epochs=60``;
* ``--output_dir DIR``: write ``global_model.pt``, ``summary.json`` and the checkpoints there instead
  (advisable with another method or settings, so the first run's results stay);
* ``--fresh``: start the method over; by default it resumes (``resume: true``) from its own
  checkpoints in ``<output_dir>/state`` when they were made with the same settings and uploads,
  which is how a killed server is continued without its clients.

Typical uses: continue a server that was killed (``python -m fedml_fedmitr.server_only --cf
server.yaml``); try another method on the same clients (``... --optimizer DENSE --output_dir
runs/dense``). Exit status as for ``python -m fedml_fedmitr``: 0, 2 for a user error (one line
``fedml_fedmitr: error: ...``), 1 otherwise.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

log = logging.getLogger("fedml_fedmitr")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fedml_fedmitr.server_only",
                                description="Rerun the fedml_fedmitr server alone from saved client uploads")
    p.add_argument("--cf", "--yaml_config_file", dest="yaml_config_file", required=True,
                   help="the run's FedML YAML configuration file (the server's)")
    p.add_argument("--uploads", default=None, help="saved uploads (default: <output_dir>/state/uploads.pt)")
    p.add_argument("--optimizer", default=None, help="server method (default: the config's federated_optimizer)")
    p.add_argument("--output_dir", "--output-dir", dest="output_dir", default=None,
                   help="where to write the results (default: fedmitr_args.output_dir)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a fedmitr_args key (the value is read as YAML); repeatable")
    p.add_argument("--fresh", action="store_true", help="start the method over instead of resuming")
    return p


def _apply(sections, cmd) -> None:
    import yaml

    from .core.config import ConfigError

    fedmitr = sections.setdefault("fedmitr_args", {}) or {}
    sections["fedmitr_args"] = fedmitr
    for item in cmd.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is invalid: expected KEY=VALUE (a fedmitr_args key)")
        try:
            fedmitr[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {exc}") from exc
    if cmd.output_dir is not None:
        fedmitr["output_dir"] = cmd.output_dir
    fedmitr["resume"] = not cmd.fresh
    if cmd.optimizer is not None:
        for section in sections.values():
            if isinstance(section, dict) and "federated_optimizer" in section:
                section["federated_optimizer"] = cmd.optimizer
                break
        else:
            sections.setdefault("train_args", {})["federated_optimizer"] = cmd.optimizer


def run(cmd) -> int:
    from .cli import EXIT_FAILURE, _set_threads, preflight, report_user_error, validate_sections, write_error
    from .fedml_adapter.config import load_yaml
    from .fedml_adapter.errors import USER_ERRORS

    out_dir = None
    try:
        sections = load_yaml(cmd.yaml_config_file)
        uploads_default_dir = (sections.get("fedmitr_args") or {}).get("output_dir", "./fedmitr_output")
        _apply(sections, cmd)
        _, flat = validate_sections(sections, cmd.yaml_config_file)   # reads the settings, once
        preflight(sections, flat)
        out_dir = flat.fedmitr_settings.method.output_dir
        _set_threads(flat)
        uploads = cmd.uploads or os.path.join(os.path.expanduser(str(uploads_default_dir)), "state", "uploads.pt")
        return _serve(flat, uploads, cmd.yaml_config_file)
    except USER_ERRORS as exc:
        return report_user_error(exc, out_dir=out_dir, rank=0)
    except Exception as exc:
        import traceback
        traceback.print_exc(file=sys.__stderr__)
        write_error(out_dir, 0, exc, EXIT_FAILURE)
        return EXIT_FAILURE


def _serve(flat, uploads: str, yaml_path: str) -> int:
    import torch

    from .data import load_data
    from .fedml_adapter.model import create_model
    from .fedml_adapter.runner import aggregate_saved_uploads
    from .fedml_adapter.state import load_uploads

    _logging()
    load_uploads(uploads)  # a clear error before the data and model are built
    args = flat
    args.yaml_config_file = yaml_path
    settings = flat.fedmitr_settings
    args.rank = 0
    use_gpu = bool(getattr(args, "using_gpu", False)) and torch.cuda.is_available()
    device = torch.device(f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}" if use_gpu else "cpu")
    args.device = device
    dataset, class_num = load_data(args)
    model = create_model(args, class_num)
    from .fedml_adapter.aggregator import FedMITRServerAggregator

    aggregator = FedMITRServerAggregator(model, args, settings=settings, device=device, test_data=dataset[3])
    aggregator.set_id(0)
    log.info("server only: %s on the uploads %s, results in %s", args.federated_optimizer, uploads,
             settings.method.output_dir)
    aggregate_saved_uploads(aggregator, uploads, args, check_settings=False)
    return 0


def _logging() -> None:
    plog = logging.getLogger("fedml_fedmitr")
    if not plog.handlers:
        handler = logging.StreamHandler(sys.__stderr__)
        handler.setFormatter(logging.Formatter("[fedml_fedmitr %(asctime)s %(levelname)s] %(message)s"))
        plog.addHandler(handler)
        plog.setLevel(logging.INFO)
        plog.propagate = False


def main(argv: Optional[List[str]] = None) -> int:
    return run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
