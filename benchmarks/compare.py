"""Side-by-side benchmark of every one-shot server method on the same client models.

For a dataset, a partition, K clients and one or more seeds it

1. (``--backbone pretrained`` only) pretrains a ViT on public data the clients do not hold, once,
   cached on disk (see "Backbones" below);
2. trains the K clients once per seed from one shared initialisation, cached on disk under
   ``benchmarks/cache/`` keyed by every setting the clients depend on;
3. runs every server method and FedMITR's ablations (``FedMITR-dense``: dense inversion + token
   relabel; ``FedMITR-kd``: sparse inversion + plain KD; ``FedMITR-ce``: sparse inversion + CE on
   the foreground only) on those same client uploads, each in its own child process (so its peak
   memory is its own), with the same student initialisation and the same budget;
4. adds two reference rows: the ensemble of the client models, and a model trained centrally on
   the union of all client shards (same training config and epochs as a client: the upper bound);
5. writes ``benchmarks/results/<setting>.json`` (mean, std and per-seed values over the seeds)
   and ``<setting>.md`` (a markdown table, also printed).

Every job (pretraining, client training, central training, one method on one seed) runs as
``python benchmarks/compare.py --worker JOB.json`` and writes its record to a JSON file in the
cache; a record that exists is reused, so an interrupted suite continues where it stopped
(``--force`` recomputes). The parent never imports torch.

    # smoke run (about a minute on 2 cores)
    python benchmarks/compare.py --dataset digits --clients 3 --scale tiny \\
        --methods OneShotFedAvg FedMITR
    # (A) scratch backbone, CIFAR-10 (5k/1k) archive, Dirichlet 0.5, 5 clients, 3 seeds
    python benchmarks/compare.py --dataset npz --npz ../shared/data/cifar10_small.npz \\
        --partition hetero --alpha 0.5 --clients 5 --seeds 0 1 2 --scale cpu --jobs 2
    # (B) pretrained backbone: pretrain on classes 0-4, federate the 5-class task on classes 5-9
    python benchmarks/compare.py --dataset npz --npz ../shared/data/cifar10_small.npz \\
        --backbone pretrained --partition hetero --alpha 0.5 --clients 5 --seeds 0 1 2 --scale cpu --jobs 2

Backbones: ``scratch``: the clients start from one shared random init (seeded by the seed).
``pretrained``: the federation starts from a ViT pretrained on public data. Offline the benchmark
makes its own (``--pretrain split``, the default): it pretrains on the training images of the
public classes (``--public-classes``, default the first half of the classes) and federates the
task made of the other classes (relabelled 0..C'-1; the test set is cut to them). ``--pretrain-npz
PATH`` pretrains on all of another archive instead (e.g. MNIST for digits) and federates every
class. Online, ``--pretrained-path CKPT`` (a local checkpoint, loaded by the core's
``create_vit(..., pretrained_path=...)``) or ``--timm-pretrained`` (timm's published weights of
``--model``) skip the pretraining. In every case the body comes from the backbone and the
classifier head is fresh (seeded).

See benchmarks/README.md for the JSON layout and how the budget is matched.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCHEMA_VERSION = 1

# The server methods in table order: FedMITR, its ablations, then the baselines.
ALL_METHODS = ["FedMITR", "FedMITR-dense", "FedMITR-kd", "FedMITR-ce", "DeepInversion", "DENSE",
               "CoBoosting", "FedFTG", "OneShotFedAvg"]
INVERSION_METHODS = {"FedMITR", "FedMITR-dense", "FedMITR-kd", "FedMITR-ce", "DeepInversion"}
GENERATOR_METHODS = {"DENSE", "CoBoosting", "FedFTG"}
REFERENCE_ROWS = ["Ensemble", "Central"]
NOT_RUN = "not run (--report-only)"

# Numbers aggregated over seeds (mean, std, per seed) in every record.
NUMERIC_FIELDS = ["test_acc", "ensemble_acc", "client_acc_mean", "synthesis_s", "images_per_s", "distill_s",
                  "peak_rss_mb", "rss_growth_mb", "num_synthetic", "ensemble_queries", "total_s", "train_s",
                  "peak_gpu_mb"]
RECORD_FIELDS = ["method", "test_acc", "ensemble_acc", "client_acc_mean", "synthesis_s", "images_per_s",
                 "distill_s", "peak_rss_mb"]

# FedMITR server knobs measured to work on small images (digits): a gentler pixel lr, a stronger
# TV prior, a prune schedule that fits few inversion iterations, softer KD targets, a sparser
# foreground (keep 60% at each of the 4 prune points: 16 -> 2 tokens) and a heavier background
# relabel term (lambda 20); see config/fedmitr_sp.yaml for what each measured.
SMALL_IMAGE_KNOBS = dict(inversion_lr=0.1, tv_weight=0.003, prune_fractions=[0.1, 0.2, 0.35, 0.5],
                         prune_ratio=0.4, relabel_weight=20.0, kd_temperature=4.0)

# Scale presets. ``server``: FedMITRConfig knobs (generator knobs are derived, see budget());
# ``client``: ClientTrainConfig knobs (digits/image-data specific ones are added in build_settings);
# ``pretrain_epochs``: epochs of the offline backbone; ``model``: timm name and extra kwargs.
PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": {  # tests: seconds per job
        "model": ("fedmitr_vit_micro", {"depth": 2}),
        "client": dict(epochs=3, batch_size=32, lr=2e-3),
        "pretrain_epochs": 2,
        "server": dict(num_synthetic=40, synthesis_batch_size=20, inversion_iters=10, distill_epochs=2,
                       distill_batch_size=20, gen_epochs=2, **SMALL_IMAGE_KNOBS),
    },
    "cpu": {  # 2 CPU cores: one (setting, seed) of CIFAR-10 with K=10 is about 45-60 min with --jobs 2
        "model": ("fedmitr_vit_micro", {}),
        "client": dict(epochs=30, batch_size=32, lr=2e-3),
        "client_image": dict(epochs=20, batch_size=64, lr=1e-3),
        "pretrain_epochs": 20,
        "server": dict(num_synthetic=384, synthesis_batch_size=64, inversion_iters=50, distill_epochs=15,
                       distill_batch_size=64, gen_epochs=6, **SMALL_IMAGE_KNOBS),
    },
    "gpu": {  # paper-like (the GPU configs of config/): 2.7M-parameter ViT, 1000 inversion steps
        "model": ("fedmitr_vit_small", {}),
        "client": dict(epochs=100, batch_size=64, lr=1e-3),
        "pretrain_epochs": 100,
        "server": dict(num_synthetic=5120, synthesis_batch_size=256, inversion_iters=1000, distill_epochs=100,
                       distill_batch_size=256, gen_epochs=20),
    },
}


# =============================================================================================
# Small helpers (no torch)
# =============================================================================================
def stable_hash(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def write_json_atomic(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _config_module():
    """``fedml_fedmitr/core/config.py`` loaded alone (it needs only the standard library), so the
    parent can validate knobs without importing torch; the package import is the fallback."""
    import importlib.util
    path = ROOT / "fedml_fedmitr" / "core" / "config.py"
    try:
        spec = importlib.util.spec_from_file_location("_fedmitr_config_standalone", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look the module up by name
        spec.loader.exec_module(mod)
        return mod
    except Exception:  # the file grew a torch import: pay for the package import instead
        from fedml_fedmitr.core import config as mod
        return mod


def parse_assignments(items: Sequence[str], where: str) -> Dict[str, Any]:
    """``key=value`` strings; values parsed as JSON (numbers, true/false, lists), else strings."""
    out: Dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"{where}: {item!r} is not KEY=VALUE")
        key, raw = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def dataset_labels(dataset: str, npz: Optional[str]) -> Tuple[List[int], int, int, int]:
    """(sorted classes, channels, image side, training images) of the dataset, read with numpy."""
    import numpy as np
    if dataset == "digits":
        from sklearn.datasets import load_digits
        y = load_digits().target
        return sorted(int(c) for c in np.unique(y)), 1, 8, int(round(0.8 * len(y)))
    with np.load(npz, allow_pickle=False) as blob:
        for key in ("x_train", "y_train", "x_test", "y_test"):
            if key not in blob.files:
                raise SystemExit(f"--npz {npz}: missing array {key!r} (has {sorted(blob.files)})")
        y = blob["y_train"]
        shape = blob["x_train"].shape
    chans = 1 if len(shape) == 3 else (shape[-1] if shape[-1] in (1, 3, 4) else shape[1])
    side = shape[1] if len(shape) == 3 or shape[-1] in (1, 3, 4) else shape[2]
    return sorted(int(c) for c in np.unique(y)), int(chans), int(side), int(len(y))


# =============================================================================================
# Settings
# =============================================================================================
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring and benchmarks/README.md.")
    ap.add_argument("--dataset", choices=["digits", "npz"], default="digits")
    ap.add_argument("--npz", help="archive with x_train, y_train, x_test, y_test (for --dataset npz)")
    ap.add_argument("--partition", choices=["hetero", "pathological", "homo"], default="hetero")
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha of --partition hetero")
    ap.add_argument("--classes-per-client", type=int, default=1, help="of --partition pathological")
    ap.add_argument("--clients", type=int, default=5, help="K")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--scale", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--backbone", choices=["scratch", "pretrained"], default="scratch")
    ap.add_argument("--pretrain", choices=["split", "npz"], default=None,
                    help="offline backbone source (default split; npz when --pretrain-npz is given)")
    ap.add_argument("--public-classes", type=int, nargs="+", default=None,
                    help="classes pretrained on with --pretrain split (default: the first half)")
    ap.add_argument("--pretrain-npz", help="archive to pretrain on (all its classes), e.g. MNIST for digits")
    ap.add_argument("--pretrain-epochs", type=int, default=None, help="default: the scale preset's")
    ap.add_argument("--pretrain-seed", type=int, default=0, help="seed of the backbone (one for all seeds)")
    ap.add_argument("--pretrained-path", help="a local ViT checkpoint as backbone (no pretraining)")
    ap.add_argument("--timm-pretrained", action="store_true",
                    help="timm's published weights of --model as backbone (needs network)")
    ap.add_argument("--model", default=None, help="timm ViT name (default: the scale preset's)")
    ap.add_argument("--depth", type=int, default=None, help="ViT depth override")
    ap.add_argument("--img-size", type=int, default=None, help="default: 16 for digits, the archive's side")
    ap.add_argument("--patch-size", type=int, default=4)
    ap.add_argument("--student-init", choices=["fedavg", "scratch", "pretrained"], default="fedavg",
                    help="the one student initialisation of every method (scratch: the clients' shared init)")
    ap.add_argument("--server-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="FedMITRConfig knobs over the preset (e.g. num_synthetic=256)")
    ap.add_argument("--client-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="ClientTrainConfig knobs over the preset (e.g. epochs=10); also central and pretraining")
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"server methods to run (default all: {' '.join(ALL_METHODS)})")
    ap.add_argument("--no-central", action="store_true", help="skip the centrally trained reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child process")
    ap.add_argument("--jobs", type=int, default=1,
                    help="child processes at once (keep jobs x threads <= cores for fair timings)")
    ap.add_argument("--cache-dir", default=str(HERE / "cache"))
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default=None, help="result file name (default: from the setting)")
    ap.add_argument("--force", action="store_true", help="recompute cached clients and records")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: tabulate the cached records, marking the missing ones 'not run'")
    ap.add_argument("--job-timeout", type=float, default=0, help="seconds per child job (0: none)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--worker", metavar="JOB_JSON", help=argparse.SUPPRESS)
    return ap


def derive_budget(server: Dict[str, Any], explicit: Sequence[str]) -> Dict[str, Any]:
    """Match the generator methods' budget to the inversion methods' (unless set explicitly):
    gen_epochs x gen_batch_size ~ num_synthetic kept images, gen_steps = inversion_iters (the same
    synthesis ensemble queries), gen_kd_steps: the same total number of distillation steps."""
    n, bd = int(server["num_synthetic"]), int(server["distill_batch_size"])
    epochs = int(server["gen_epochs"])
    distill_steps = int(server["distill_epochs"]) * math.ceil(n / bd)
    if "gen_batch_size" not in explicit:
        server["gen_batch_size"] = max(1, math.ceil(n / epochs))
    if "gen_steps" not in explicit:
        server["gen_steps"] = int(server["inversion_iters"])
    if "gen_kd_steps" not in explicit:
        server["gen_kd_steps"] = max(1, math.ceil(distill_steps / epochs))
    queries = n * int(server["inversion_iters"])
    return {
        "synthetic_images": n,
        "synthesis_ensemble_queries": queries,
        "distill_steps": distill_steps,
        "distill_batch_size": bd,
        "generator_images": int(server["gen_epochs"]) * int(server["gen_batch_size"]),
        "generator_ensemble_queries": int(server["gen_epochs"]) * int(server["gen_steps"])
        * int(server["gen_batch_size"]),
        "generator_distill_steps": int(server["gen_epochs"]) * int(server["gen_kd_steps"]),
        "how": (
            "FedMITR, its ablations and DeepInversion: num_synthetic images, each optimised for "
            "inversion_iters steps against the ensemble (num_synthetic x inversion_iters ensemble "
            "queries), then distill_epochs epochs over the pool in batches of distill_batch_size "
            "(distill_steps student steps). DENSE, CoBoosting, FedFTG: gen_epochs x gen_batch_size ~ "
            "num_synthetic generated images, gen_steps = inversion_iters generator steps per epoch (the "
            "same synthesis ensemble queries), gen_kd_steps = ceil(distill_steps / gen_epochs) student "
            "steps of distill_batch_size per epoch (the same number of distillation steps; DENSE and "
            "CoBoosting cycle over their growing pool, FedFTG draws a fresh batch per step, so it "
            "generates more images than it keeps). OneShotFedAvg: no server training. Every method's "
            "student starts from the same weights (student_init) and sees the same client models. "
            "ensemble_queries in each record counts the images the method actually passed through the "
            "ensemble (all K clients; synthesis, with backward passes, and the distillation teacher), the "
            "test-set evaluation excluded."),
    }


def build_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that defines the benchmark (the JSON's ``settings``), from the command line."""
    preset = PRESETS[args.scale]
    if args.dataset == "npz":
        if not args.npz:
            raise SystemExit("--dataset npz needs --npz PATH")
        npz = str(Path(args.npz).expanduser().resolve())
        if not Path(npz).is_file():
            raise SystemExit(f"--npz {args.npz}: no such file")
        data_name = Path(npz).stem
    else:
        npz, data_name = None, "digits"
    classes, in_chans, side, _ = dataset_labels(args.dataset, npz)

    # ---- backbone ----
    pretrain: Optional[Dict[str, Any]] = None
    task_classes = list(classes)
    if args.backbone == "pretrained":
        if args.pretrained_path and args.timm_pretrained:
            raise SystemExit("give --pretrained-path or --timm-pretrained, not both")
        if args.pretrained_path:
            path = str(Path(args.pretrained_path).expanduser().resolve())
            if not Path(path).is_file():
                raise SystemExit(f"--pretrained-path {args.pretrained_path}: no such file")
            pretrain = {"source": "checkpoint", "path": path}
        elif args.timm_pretrained:
            pretrain = {"source": "timm"}
        else:
            source = args.pretrain or ("npz" if args.pretrain_npz else "split")
            epochs = args.pretrain_epochs or preset["pretrain_epochs"]
            if source == "split":
                public = sorted(args.public_classes) if args.public_classes else classes[:len(classes) // 2]
                bad = [c for c in public if c not in classes]
                if bad or not public or len(public) >= len(classes):
                    raise SystemExit(f"--public-classes {public}: expected a non-empty proper subset of {classes}")
                task_classes = [c for c in classes if c not in public]
                pretrain = {"source": "split", "public_classes": public, "epochs": epochs,
                            "seed": args.pretrain_seed,
                            "what": f"pretrained on the training images of classes {public} of {data_name}; "
                                    f"the federation learns classes {task_classes} (relabelled 0..{len(task_classes) - 1})"}
            else:
                if not args.pretrain_npz:
                    raise SystemExit("--pretrain npz needs --pretrain-npz PATH")
                path = str(Path(args.pretrain_npz).expanduser().resolve())
                if not Path(path).is_file():
                    raise SystemExit(f"--pretrain-npz {args.pretrain_npz}: no such file")
                pretrain = {"source": "npz", "npz": path, "epochs": epochs, "seed": args.pretrain_seed,
                            "what": f"pretrained on every class of {Path(path).name}; the federation learns "
                                    f"all classes of {data_name}"}
    elif args.pretrained_path or args.timm_pretrained or args.pretrain_npz or args.public_classes:
        raise SystemExit("--pretrained-path / --timm-pretrained / --pretrain-npz / --public-classes need "
                         "--backbone pretrained")
    if len(set(args.seeds)) != len(args.seeds):
        raise SystemExit(f"--seeds {args.seeds}: a seed is given twice")
    if args.clients < 1 or args.jobs < 1 or args.threads < 1:
        raise SystemExit("--clients, --jobs and --threads must be >= 1")
    if args.student_init == "pretrained" and args.backbone != "pretrained":
        raise SystemExit("--student-init pretrained needs --backbone pretrained")

    # ---- model ----
    name, kwargs = preset["model"]
    kwargs = dict(kwargs)
    if args.model:
        name = args.model
        kwargs = {}
    if args.depth:
        kwargs["depth"] = args.depth
    img = args.img_size or (16 if args.dataset == "digits" else side)
    model = {"name": name, "img_size": int(img), "patch_size": int(args.patch_size), "in_chans": in_chans,
             "kwargs": kwargs}

    # ---- client training (also central and pretraining) ----
    cfgmod = _config_module()
    client = dict(preset["client"])
    if args.dataset == "digits":
        client.update(augment=False, flip=False)       # a mirrored digit is another digit
    else:
        client.update(preset.get("client_image", {}))
        client.update(augment=True, flip=in_chans == 3)
    client.update(parse_assignments(args.client_set, "--client-set"))
    known = {f.name for f in cfgmod.dataclasses.fields(cfgmod.ClientTrainConfig)}
    unknown = sorted(set(client) - known)
    if unknown:
        raise SystemExit(f"--client-set: unknown key(s) {unknown}; accepted: {', '.join(sorted(known))}")
    try:
        client = cfgmod.dataclasses.asdict(cfgmod.ClientTrainConfig(**client).validate("--client-set"))
    except (cfgmod.ConfigError, TypeError) as exc:
        raise SystemExit(str(exc)) from None

    # ---- server ----
    overrides = parse_assignments(args.server_set, "--server-set")
    server = dict(preset["server"])
    server.update(overrides)
    server["student_init"] = args.student_init
    budget = derive_budget(server, list(overrides))
    for key in ("seed", "output_dir", "resume", "progress", "tensorboard", "save_images"):
        if key in server:
            raise SystemExit(f"--server-set {key}: set by the benchmark, not a knob")
    try:
        cfg = cfgmod.FedMITRConfig.from_dict(server, where="--server-set")
    except cfgmod.ConfigError as exc:
        raise SystemExit(str(exc)) from None
    defaults = cfgmod.FedMITRConfig().to_dict()
    full = cfg.to_dict()
    server = {k: full[k] for k in full if k in server or full[k] != defaults[k]}

    # ---- methods ----
    methods = list(args.methods or ALL_METHODS)
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:  # a method registered later than this script: ask the registry (imports torch)
        from fedml_fedmitr.core.methods import method_names
        names = method_names()
        bad = [m for m in unknown if m not in names]
        if bad:
            raise SystemExit(f"--methods: unknown {bad}; expected some of {' '.join(names)}")
    if len(set(methods)) != len(methods):
        raise SystemExit(f"--methods: {methods} names a method twice")

    if args.partition == "pathological" and args.clients * args.classes_per_client < len(task_classes):
        raise SystemExit(f"--partition pathological: {args.clients} clients x {args.classes_per_client} "
                         f"class(es) cannot cover the {len(task_classes)} classes; use --clients "
                         f">= {math.ceil(len(task_classes) / args.classes_per_client)}")

    return {
        "schema_version": SCHEMA_VERSION,
        "dataset": args.dataset,
        "npz": npz,
        "data_name": data_name,
        "test_set": ("a fixed stratified 80/20 split of scikit-learn's digits (the same for every seed)"
                     if args.dataset == "digits" else "the archive's x_test / y_test")
        + (", cut to the task classes" if task_classes != classes else ""),
        "partition": args.partition,
        "alpha": args.alpha if args.partition == "hetero" else None,
        "classes_per_client": args.classes_per_client if args.partition == "pathological" else None,
        "clients": int(args.clients),
        "seed": [int(s) for s in args.seeds],
        "backbone": args.backbone,
        "pretrain": pretrain,
        "classes": classes,
        "task_classes": task_classes,
        "num_classes": len(task_classes),
        "model": model,
        "scale": args.scale,
        "client_train": client,
        "central_train": dict(client, what="one model from the clients' shared init on the union of all "
                                           "client shards, the same training config and epochs"),
        "student_init": args.student_init,
        "server": server,
        "budget": budget,
        "methods": methods,
        "central": not args.no_central,
        "device": args.device,
        "threads_per_job": int(args.threads),
        "jobs": int(args.jobs),
    }


def setting_name(settings: Dict[str, Any], args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    p = settings["partition"]
    if p == "hetero":
        part = f"hetero-a{settings['alpha']:g}"
    elif p == "pathological":
        part = f"pathological-c{settings['classes_per_client']}"
    else:
        part = p
    bits = [settings["data_name"], part, f"K{settings['clients']}", settings["backbone"], settings["scale"]]
    extra = {k: v for k, v in {"server": args.server_set, "client": args.client_set, "model": args.model,
                                "depth": args.depth, "img": args.img_size, "patch": args.patch_size != 4,
                                "init": args.student_init != "fedavg", "device": args.device != "cpu",
                                "pretrain": settings["pretrain"] if args.backbone == "pretrained" and (
                                    args.pretrain_npz or args.public_classes or args.pretrained_path
                                    or args.timm_pretrained or args.pretrain_epochs) else None}.items() if v}
    if extra:
        bits.append(stable_hash(extra, 6))
    return "compare_" + "_".join(str(b) for b in bits)


def client_key(settings: Dict[str, Any], seed: int) -> str:
    """What the client models (and the central model) depend on."""
    keys = ["dataset", "npz", "partition", "alpha", "classes_per_client", "clients", "backbone", "pretrain",
            "task_classes", "model", "client_train", "device"]
    return stable_hash({"seed": int(seed), **{k: settings[k] for k in keys}})


def pretrain_key(settings: Dict[str, Any]) -> str:
    keys = ["dataset", "npz", "pretrain", "model", "client_train", "device"]
    return stable_hash({k: settings[k] for k in keys})


def server_key(settings: Dict[str, Any]) -> str:
    return stable_hash({"server": settings["server"], "threads": settings["threads_per_job"]})


# =============================================================================================
# Parent: plan the jobs, run them as child processes, aggregate
# =============================================================================================
class Job:
    def __init__(self, kind: str, name: str, out: Path, spec: Dict[str, Any], log: Path):
        self.kind, self.name, self.out, self.spec, self.log = kind, name, Path(out), spec, Path(log)
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[str] = None
        self.cached = False
        self.elapsed = 0.0


def plan(settings: Dict[str, Any], cache: Path) -> Dict[str, Any]:
    base = cache / settings["data_name"]
    out: Dict[str, Any] = {"pretrain": None, "seeds": {}}
    if settings["backbone"] == "pretrained" and settings["pretrain"]["source"] in ("split", "npz"):
        d = cache / "pretrain" / pretrain_key(settings)
        out["pretrain"] = Job("pretrain", "pretrain backbone", d / "backbone.json",
                              {"checkpoint": str(d / "backbone.pt")}, d / "pretrain.log")
    skey = server_key(settings)
    for seed in settings["seed"]:
        d = base / client_key(settings, seed)
        jobs = {"clients": Job("clients", f"clients seed {seed}", d / "clients.json",
                               {"checkpoint": str(d / "clients.pt")}, d / "logs" / "clients.log")}
        if settings["central"]:
            jobs["central"] = Job("central", f"Central seed {seed}", d / "central.json", {}, d / "logs" / "central.log")
        for m in settings["methods"]:
            jobs[m] = Job("method", f"{m} seed {seed}", d / f"server-{skey}" / f"{m}.json", {"method": m},
                          d / "logs" / f"{m}-{skey}.log")
        out["seeds"][seed] = {"dir": d, "jobs": jobs}
    return out


# Several compare.py processes may share one cache (one per seed, or the same command twice): a
# process claims a job before running it by creating ``<record>.claim`` (O_EXCL, so only one
# process wins), naming its pid and host; the others take other jobs first and then wait for the
# record. A claim whose process is gone (same host, pid not alive) is stale and taken over.
WAIT = object()
POLL_S = 10.0


def claim_path(job: "Job") -> Path:
    return job.out.with_name(job.out.stem + ".claim")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, another user's
        return True
    return True


def try_claim(job: "Job") -> Optional[str]:
    """Claim ``job`` for this process: None when it is ours now, else who holds it ("pid P on host H")."""
    path = claim_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_json(path)
            if holder is None:          # being written this instant (or left empty by a crash long ago)
                try:
                    if time.time() - path.stat().st_mtime > 60:
                        path.unlink()
                        continue
                except FileNotFoundError:
                    continue
                return f"a claim being written ({path})"
            if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                return None
            if holder.get("host") == me["host"] and not _pid_alive(int(holder.get("pid", -1))):
                try:                    # stale: its process died without releasing it
                    path.unlink()
                except FileNotFoundError:
                    pass
                continue
            return (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('since')}; "
                    f"delete {path} if that process is gone")
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None
    return f"claim {path} keeps changing hands"


def release_claim(job: "Job") -> None:
    path = claim_path(job)
    holder = read_json(path)
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


class Runner:
    """Runs jobs as ``compare.py --worker JOB.json`` children, ``jobs`` at a time, with a tqdm bar."""

    def __init__(self, settings: Dict[str, Any], args: argparse.Namespace, total: int):
        from tqdm.auto import tqdm
        self.settings, self.args = settings, args
        # off with --no-progress, and (tqdm's None) when stderr is not a terminal
        self.bar = tqdm(total=total, desc="compare", unit="job", dynamic_ncols=True, file=sys.stderr,
                        disable=True if args.no_progress else None)
        self.running: Dict[int, subprocess.Popen] = {}
        self.poll_s = POLL_S
        self._told_waiting: set = set()

    def say(self, msg: str) -> None:
        from tqdm.auto import tqdm
        tqdm.write(msg, file=sys.stderr)

    def run_all(self, jobs: List[Job], what: str) -> None:
        todo = []
        for job in jobs:
            if self._reuse(job):
                continue
            if self.args.report_only:
                job.error = NOT_RUN
                self.bar.update(1)
                continue
            todo.append(job)
        if not todo:
            return
        self.bar.set_description(what)
        queue, lock, finished = list(todo), threading.Lock(), Queue()
        active: List[str] = []

        def loop() -> None:
            # each thread takes the first job that is neither finished nor claimed by another process
            while True:
                with lock:
                    try:
                        job = self._pick(queue)
                    except Exception as e:  # noqa: BLE001 - e.g. the cache is not writable
                        self.say(f"scheduling failed: {type(e).__name__}: {e}")
                        return
                    if isinstance(job, Job) and not job.cached:
                        active.append(job.name)
                        self.bar.set_postfix_str(", ".join(active))
                if job is None:
                    return
                if job is WAIT:
                    time.sleep(self.poll_s)
                    continue
                try:
                    if not job.cached:
                        self._run_one(job)
                except Exception as e:  # noqa: BLE001 - reported like a failed child, the others go on
                    job.error = f"{type(e).__name__}: {e}"
                finally:
                    if not job.cached:
                        release_claim(job)
                        with lock:
                            active.remove(job.name)
                    finished.put(job)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(max(1, self.args.jobs))]
        for t in threads:
            t.start()
        received = 0
        while received < len(todo):
            try:
                job = finished.get(timeout=1.0)
            except Empty:
                if any(t.is_alive() for t in threads):
                    continue
                for job in queue:       # only if a thread died on an error of its own
                    job.error = job.error or "not run: the scheduling thread failed (see the message above)"
                    self.say(f"FAILED {job.name}: {job.error}")
                break
            received += 1
            if job.error:
                self.say(f"FAILED {job.name} (log {job.log}):\n{job.error}")
            elif not job.cached:   # (a record another process made meanwhile was announced)
                self.say(f"done {job.name} in {job.elapsed:.0f} s (log {job.log})")
            self.bar.update(1)
            self.bar.set_postfix_str(", ".join(active))

    def _pick(self, queue: List[Job]):
        """The next job for a thread (removed from ``queue``): one whose record another process wrote
        meanwhile (``cached``), else the first one this process could claim; ``WAIT`` when every job
        left is claimed by another live process; None when the queue is empty."""
        for job in list(queue):
            if self._reuse(job):
                queue.remove(job)
                return job
            owner = try_claim(job)
            if owner is None:
                queue.remove(job)
                return job
            if job.name not in self._told_waiting:
                self._told_waiting.add(job.name)
                self.say(f"{job.name} is being run by another compare.py ({owner}); "
                         f"taking other jobs first, then waiting for its record")
        return WAIT if queue else None

    def _reuse(self, job: Job) -> bool:
        """Take the job's cached record if there is one (not with --force)."""
        if self.args.force:
            return False
        res = read_json(job.out)
        if res is None or not res.get("ok"):
            return False
        job.result, job.cached = res, True
        self.say(f"reusing cached {job.name}: {job.out}" if job.kind != "clients"
                 else f"reusing cached clients (seed {job.spec['seed']}): {job.spec['checkpoint']}")
        return True

    def _run_one(self, job: Job) -> None:
        job.out.parent.mkdir(parents=True, exist_ok=True)
        job.log.parent.mkdir(parents=True, exist_ok=True)
        spec_path = job.out.with_name(job.out.stem + ".job.json")
        write_json_atomic(spec_path, {"kind": job.kind, "settings": self.settings, "out": str(job.out), **job.spec})
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(self.args.threads), "MKL_NUM_THREADS": str(self.args.threads),
                    "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled",
                    "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
        t = time.perf_counter()
        with open(job.log, "w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
            self.running[p.pid] = p
            try:
                rc = p.wait(timeout=self.args.job_timeout or None)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = "timeout"
            finally:
                self.running.pop(p.pid, None)
        job.elapsed = time.perf_counter() - t
        res = read_json(job.out)
        if rc != 0 or res is None or not res.get("ok"):
            tail = Path(job.log).read_text(errors="replace").strip().splitlines()[-15:]
            job.error = (f"exit {rc} after {time.perf_counter() - t:.0f} s\n  " + "\n  ".join(tail))
            job.result = None
        else:
            job.result = res

    def kill_all(self) -> None:
        for _pid, p in list(self.running.items()):
            if p.poll() is None:
                p.kill()

    def close(self) -> None:
        self.bar.close()


def _stats(values: List[Optional[float]]) -> Tuple[Optional[float], Optional[float]]:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
    return mean, std


def aggregate_rows(per_seed: Dict[str, Dict[int, Dict[str, Any]]], order: List[str], seeds: List[int],
                   errors: Dict[str, Dict[int, str]]) -> List[Dict[str, Any]]:
    """One record per row: each number's mean over the seeds, ``<key>_std`` (population std) and
    ``<key>_per_seed`` (in the order of ``seeds``, None where that seed is missing)."""
    rows = []
    for name in order:
        recs = per_seed.get(name, {})
        row: Dict[str, Any] = {"method": name, "kind": (
            "reference" if name in REFERENCE_ROWS else "ablation" if name.startswith("FedMITR-") else "method"),
            "seeds": [s for s in seeds if s in recs]}
        for key in NUMERIC_FIELDS:
            values = [recs[s].get(key) if s in recs else None for s in seeds]
            if all(v is None for v in values) and key not in RECORD_FIELDS:
                continue
            mean, std = _stats(values)
            row[key] = mean
            row[f"{key}_std"] = std
            row[f"{key}_per_seed"] = values
        failed = {str(s): e for s, e in errors.get(name, {}).items() if e != NOT_RUN}
        if failed:
            row["errors"] = failed
        not_run = [s for s, e in errors.get(name, {}).items() if e == NOT_RUN]
        if not_run:
            row["not_run"] = not_run
        first = next((recs[s] for s in seeds if s in recs), None)
        if first is not None and "config" in first:
            row["config"] = first["config"]
        rows.append(row)
    return rows


def _fmt(row: Dict[str, Any], key: str, kind: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    std = row.get(f"{key}_std")
    n = len([x for x in row.get(f"{key}_per_seed", []) if x is not None])
    if kind == "acc":
        s = f"{100 * v:.1f}"
        return s + (f" ± {100 * std:.1f}" if n > 1 and std is not None else "")
    if kind == "s":
        return f"{v:.1f}" + (f" ± {std:.1f}" if n > 1 and std is not None else "")
    if kind == "rate":
        return f"{v:.1f}"
    growth = row.get("rss_growth_mb")
    return f"{v:.0f}" + (f" (+{growth:.0f})" if key == "peak_rss_mb" and growth is not None else "")


TABLE_COLUMNS = [("method", "method", None), ("test acc (%)", "test_acc", "acc"),
                 ("ensemble acc (%)", "ensemble_acc", "acc"), ("mean client acc (%)", "client_acc_mean", "acc"),
                 ("synthesis (s)", "synthesis_s", "s"), ("images/s", "images_per_s", "rate"),
                 ("distillation (s)", "distill_s", "s"), ("peak memory (MB)", "peak_rss_mb", "mb")]


def markdown(result: Dict[str, Any]) -> str:
    st = result["settings"]
    part = {"hetero": f"Dirichlet alpha={st['alpha']}", "pathological": f"#C={st['classes_per_client']}",
            "homo": "IID"}[st["partition"]]
    seeds = st["seed"]
    columns = list(TABLE_COLUMNS)
    if len(seeds) > 1:   # the per-seed test accuracies beside their mean
        columns.insert(2, ("per seed", "test_acc_per_seed", "seeds"))
    lines = [f"## {result['name']}", "",
             f"{st['data_name']}, {st['num_classes']} classes, {part}, K={st['clients']} clients, "
             f"backbone {st['backbone']}, scale {st['scale']}, model {st['model']['name']} "
             f"{st['model']['img_size']}px/patch {st['model']['patch_size']}, "
             f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
             + (" (mean ± std)" if len(seeds) > 1 else "") + ".",
             f"Budget: {st['budget']['synthetic_images']} synthetic images, "
             f"{st['budget']['synthesis_ensemble_queries']} synthesis ensemble queries, "
             f"{st['budget']['distill_steps']} distillation steps of {st['budget']['distill_batch_size']}; "
             f"student init {st['student_init']}. Ensemble: mean of the client models; Central: one model "
             "trained on all clients' data (upper bound); peak memory: the child process's max RSS "
             "(in brackets: its growth during the method, above what loading torch, the data and the "
             "client models took).", "",
             "| " + " | ".join(c[0] for c in columns) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"]
    for row in result["records"]:
        cells = []
        for _title, key, kind in columns:
            if key == "method":
                label = row["method"] + (" (reference)" if row["kind"] == "reference" else "")
                if row.get("errors"):
                    label += f" (failed: seed {', '.join(row['errors'])})"
                if row.get("not_run"):
                    label += f" (not run yet: seed {', '.join(map(str, row['not_run']))})"
                cells.append(label)
            elif kind == "seeds":
                cells.append(" / ".join("-" if v is None else f"{100 * v:.1f}" for v in row.get(key, [])))
            else:
                cells.append(_fmt(row, key, kind))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    t0 = time.perf_counter()
    settings = build_settings(args)
    name = setting_name(settings, args)
    cache = Path(args.cache_dir).resolve()
    results_dir = Path(args.results_dir).resolve()
    p = plan(settings, cache)
    seeds = settings["seed"]
    total = (1 if p["pretrain"] else 0) + sum(len(v["jobs"]) for v in p["seeds"].values())
    runner = Runner(settings, args, total)
    errors: Dict[str, Dict[int, str]] = {}
    try:
        backbone = None
        if p["pretrain"] is not None:
            runner.run_all([p["pretrain"]], "pretraining")
            if p["pretrain"].error:
                raise SystemExit(f"pretraining the backbone failed:\n{p['pretrain'].error}")
            backbone = p["pretrain"].spec["checkpoint"]
        for seed in seeds:
            for job in p["seeds"][seed]["jobs"].values():
                job.spec.update(seed=seed, backbone=backbone, clients=p["seeds"][seed]["jobs"]["clients"].spec["checkpoint"])
        first = [j for s in seeds for k, j in p["seeds"][s]["jobs"].items() if k in ("clients", "central")]
        runner.run_all(first, "clients + central")
        second = []
        for seed in seeds:
            jobs = p["seeds"][seed]["jobs"]
            if jobs["clients"].error:
                for m in settings["methods"]:
                    errors.setdefault(m, {})[seed] = (NOT_RUN if jobs["clients"].error == NOT_RUN
                                                      else "client training failed")
                    runner.bar.update(1)
                continue
            second += [jobs[m] for m in settings["methods"]]
        runner.run_all(second, "server methods")
    except KeyboardInterrupt:
        runner.kill_all()
        raise
    finally:
        runner.close()

    # ---- aggregate ----
    per_seed: Dict[str, Dict[int, Dict[str, Any]]] = {}
    clients_info = {}
    for seed in seeds:
        jobs = p["seeds"][seed]["jobs"]
        cl = jobs["clients"].result
        if cl is None:
            errors.setdefault("Ensemble", {})[seed] = jobs["clients"].error or "missing"
            continue
        clients_info[str(seed)] = {k: cl.get(k) for k in ("client_acc", "client_samples", "client_label_counts",
                                                          "train_s", "peak_rss_mb", "checkpoint", "init")}
        per_seed.setdefault("Ensemble", {})[seed] = {
            "test_acc": cl["ensemble_acc"], "ensemble_acc": cl["ensemble_acc"],
            "client_acc_mean": cl["client_acc_mean"]}
        for m in settings["methods"]:
            job = jobs[m]
            if job.result is not None:
                rec = dict(job.result)
                rec["client_acc_mean"] = cl["client_acc_mean"]
                per_seed.setdefault(m, {})[seed] = rec
            elif job.error:
                errors.setdefault(m, {})[seed] = job.error
        if "central" in jobs:
            c = jobs["central"]
            if c.result is not None:
                per_seed.setdefault("Central", {})[seed] = {
                    "test_acc": c.result["test_acc"], "train_s": c.result["train_s"],
                    "peak_rss_mb": c.result["peak_rss_mb"], "peak_gpu_mb": c.result.get("peak_gpu_mb")}
            else:
                errors.setdefault("Central", {})[seed] = c.error or "missing"
    order = settings["methods"] + ["Ensemble"] + (["Central"] if settings["central"] else [])
    records = aggregate_rows(per_seed, order, seeds, errors)
    command = shlex.join(["python", os.path.relpath(Path(__file__).resolve(), Path.cwd())
                          if Path.cwd() in Path(__file__).resolve().parents else str(Path(__file__).resolve())]
                         + [a for a in argv if a != "--report-only"])
    import platform
    result = {
        "name": name,
        "command": command,
        "argv": argv,
        "settings": settings,
        "records": records,
        "clients": clients_info,
        "pretrain": p["pretrain"].result if p["pretrain"] is not None else None,
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count(), "host": platform.node()},
        "cache": {"dir": str(cache), "clients": {str(s): str(p["seeds"][s]["dir"]) for s in seeds}},
        "wall_s": time.perf_counter() - t0,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "report_only": bool(args.report_only),
    }
    first_method = next((per_seed[m][s] for m in settings["methods"] for s in seeds
                         if s in per_seed.get(m, {})), None)
    if first_method is not None:
        result["environment"]["torch"] = first_method.get("torch")
    json_path = results_dir / f"{name}.json"
    md_path = results_dir / f"{name}.md"
    write_json_atomic(json_path, result)
    table = markdown(result)
    md_path.write_text(table)
    print(table)
    print(f"wrote {json_path}\nwrote {md_path}")
    failed = sum(1 for v in errors.values() for e in v.values() if e != NOT_RUN)
    not_run = sum(1 for v in errors.values() for e in v.values() if e == NOT_RUN)
    if not_run:
        print(f"{not_run} job(s) not run yet (--report-only); run the command without it to finish them",
              file=sys.stderr)
    if failed:
        print(f"{failed} job(s) failed; rerun the same command to retry them (the rest is cached)", file=sys.stderr)
        return 1
    return 0


# =============================================================================================
# Worker (child process): torch lives here
# =============================================================================================
def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def load_task(settings: Dict[str, Any], with_public: bool = False) -> Dict[str, Any]:
    """Normalised tensors of the federated task (train, test), optionally the public pretraining
    data, and the normalisation. Labels of the task are relabelled to 0..C'-1."""
    import numpy as np
    import torch

    from fedml_fedmitr.data import digits_arrays, load_npz_arrays, resize_images

    if settings["dataset"] == "digits":
        x_tr, y_tr, x_te, y_te = digits_arrays(0, 0.2)   # a fixed split: the same test set for every seed
    else:
        x_tr, y_tr, x_te, y_te = load_npz_arrays(settings["npz"])
    img, chans = settings["model"]["img_size"], settings["model"]["in_chans"]
    task = settings["task_classes"]
    remap = np.full(max(settings["classes"]) + 1, -1, dtype=np.int64)
    remap[task] = np.arange(len(task))

    def pick(x, y, classes):
        keep = np.isin(y, classes)
        return x[keep], y[keep]

    xt_tr, yt_tr = pick(x_tr, y_tr, task)
    xt_te, yt_te = pick(x_te, y_te, task)
    for split, ys in (("training", yt_tr), ("test", yt_te)):
        if len(ys) == 0:
            raise ValueError(f"{settings['data_name']}: no {split} images of the task classes {task}")
    xt_tr = resize_images(torch.from_numpy(np.ascontiguousarray(xt_tr)), img)
    xt_te = resize_images(torch.from_numpy(np.ascontiguousarray(xt_te)), img)
    mean = xt_tr.mean(dim=(0, 2, 3))
    std = xt_tr.std(dim=(0, 2, 3)).clamp_min(1e-3)

    def norm(x):
        return (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)

    out = {"train": (norm(xt_tr), torch.from_numpy(remap[yt_tr])),
           "test": (norm(xt_te), torch.from_numpy(remap[yt_te])),
           "mean": mean.tolist(), "std": std.tolist(), "num_classes": len(task), "public": None}
    pre = settings.get("pretrain") or {}
    if with_public and pre.get("source") == "split":
        pub = pre["public_classes"]
        pmap = np.full(max(settings["classes"]) + 1, -1, dtype=np.int64)
        pmap[pub] = np.arange(len(pub))
        px_tr, py_tr = pick(x_tr, y_tr, pub)
        px_te, py_te = pick(x_te, y_te, pub)
        out["public"] = {"train": (norm(resize_images(torch.from_numpy(np.ascontiguousarray(px_tr)), img)),
                                   torch.from_numpy(pmap[py_tr])),
                         "test": (norm(resize_images(torch.from_numpy(np.ascontiguousarray(px_te)), img)),
                                  torch.from_numpy(pmap[py_te])),
                         "num_classes": len(pub)}
    elif with_public and pre.get("source") == "npz":
        px_tr, py_tr, px_te, py_te = load_npz_arrays(pre["npz"])
        classes = np.unique(py_tr)
        pmap = np.full(int(classes.max()) + 1, -1, dtype=np.int64)
        pmap[classes] = np.arange(len(classes))

        def conv(x):
            x = torch.from_numpy(np.ascontiguousarray(x))
            if x.shape[1] != chans:     # RGB -> grey (mean), or grey -> RGB (repeat)
                x = x.mean(1, keepdim=True) if chans == 1 else x[:, :1].repeat(1, chans, 1, 1)
            return norm(resize_images(x, img))

        keep = np.isin(py_te, classes)
        out["public"] = {"train": (conv(px_tr), torch.from_numpy(pmap[py_tr])),
                         "test": (conv(px_te[keep]), torch.from_numpy(pmap[py_te[keep]])),
                         "num_classes": len(classes)}
    return out


def build_model(settings: Dict[str, Any], num_classes: int, pretrained_path: Optional[str] = None,
                timm_pretrained: bool = False):
    from fedml_fedmitr.core.models import create_vit
    m = settings["model"]
    return create_vit(m["name"], img_size=m["img_size"], num_classes=num_classes, in_chans=m["in_chans"],
                      patch_size=m["patch_size"], pretrained=timm_pretrained, pretrained_path=pretrained_path,
                      **m["kwargs"])


def shared_init(settings: Dict[str, Any], seed: int, backbone: Optional[str]) -> Tuple[Dict[str, Any], str]:
    """The clients' common starting weights for ``seed`` (and a description): random (scratch), or
    the backbone's body with a fresh classifier head seeded by ``seed``."""
    import torch
    torch.manual_seed(seed)
    n = settings["num_classes"]
    pre = settings.get("pretrain")
    if settings["backbone"] == "scratch":
        model, what = build_model(settings, n), f"random (seed {seed})"
    else:
        if pre["source"] == "timm":
            model = build_model(settings, n, timm_pretrained=True)
            what = f"timm's published weights of {settings['model']['name']}"
        else:
            path = pre["path"] if pre["source"] == "checkpoint" else backbone
            model = build_model(settings, n, pretrained_path=path)
            what = f"backbone {path}"
        torch.manual_seed(seed)
        model.reset_classifier(n)
        what += f", fresh head (seed {seed})"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, what


def _loader(x, y, batch_size: int, shuffle: bool, seed: int = 0):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(seed) if shuffle else None)


def _client_cfg(settings):
    from fedml_fedmitr.core.config import ClientTrainConfig
    return ClientTrainConfig(**settings["client_train"])


def job_pretrain(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core.client import train_local
    from fedml_fedmitr.core.evaluate import evaluate_model

    settings = job["settings"]
    pre = settings["pretrain"]
    data = load_task(settings, with_public=True)
    pub = data["public"]
    torch.manual_seed(pre["seed"])
    model = build_model(settings, pub["num_classes"])
    cfg = _client_cfg(settings)
    cfg.epochs = int(pre["epochs"])
    t = time.perf_counter()
    train_local(model, _loader(*pub["train"], cfg.batch_size, True, pre["seed"]), cfg, device)
    train_s = time.perf_counter() - t
    acc = evaluate_model(model, _loader(*pub["test"], 256, False), device, pub["num_classes"])["acc"]
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = Path(job["checkpoint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state, "meta": {"pretrain": pre, "model": settings["model"],
                                              "num_classes": pub["num_classes"], "public_test_acc": acc}},
               str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"pretrained backbone: {len(pub['train'][1])} public images, {cfg.epochs} epochs, "
          f"public test accuracy {acc:.3f}, {train_s:.0f} s -> {path}")
    return {"checkpoint": str(path), "public_train_images": len(pub["train"][1]), "public_test_acc": acc,
            "epochs": cfg.epochs, "train_s": train_s}


def job_clients(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core.client import train_client
    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.ensemble import Ensemble
    from fedml_fedmitr.core.evaluate import evaluate_ensemble, evaluate_model
    from fedml_fedmitr.core.partition import partition

    settings, seed = job["settings"], int(job["seed"])
    data = load_task(settings)
    n = data["num_classes"]
    init, what = shared_init(settings, seed, job.get("backbone"))

    def model_fn():
        m = build_model(settings, n)
        m.load_state_dict(init)
        return m

    x, y = data["train"]
    shards = partition(y.numpy(), settings["clients"], settings["partition"], seed,
                       alpha=settings["alpha"] or 0.5, classes_per_client=settings["classes_per_client"] or 1)
    cfg = _client_cfg(settings)
    test = _loader(*data["test"], 256, False)
    uploads, accs, times = [], [], []
    for k, idx in enumerate(shards):
        idx_t = torch.from_numpy(idx)
        torch.manual_seed(seed * 1000 + k)
        t = time.perf_counter()
        up = train_client(k, model_fn(), _loader(x[idx_t], y[idx_t], cfg.batch_size, True, seed * 1000 + k),
                          cfg, device, n)
        times.append(time.perf_counter() - t)
        m = model_fn()
        m.load_state_dict(up.state_dict)
        accs.append(evaluate_model(m, test, device, n)["acc"])
        uploads.append(up)
        print(f"client {k}: {up.num_samples} samples, labels {up.label_counts}, test acc {accs[-1]:.3f}, "
              f"{times[-1]:.0f} s", flush=True)
    ens = Ensemble.from_uploads(uploads, model_fn, n, FedMITRConfig(), device)
    ens_acc = evaluate_ensemble(ens, test, device, n)["acc"]
    path = Path(job["checkpoint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"init_state": init, "uploads": [u.to_payload() for u in uploads], "client_acc": accs,
                "ensemble_acc": ens_acc}, str(path.with_suffix(".tmp")))
    os.replace(path.with_suffix(".tmp"), path)
    print(f"trained {len(uploads)} clients from {what}; ensemble acc {ens_acc:.3f} -> {path}")
    return {"checkpoint": str(path), "init": what, "client_acc": accs, "client_acc_mean": sum(accs) / len(accs),
            "ensemble_acc": ens_acc, "client_samples": [u.num_samples for u in uploads],
            "client_label_counts": [u.label_counts for u in uploads], "client_train_s": times,
            "train_s": sum(times)}


def job_central(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core.client import train_local
    from fedml_fedmitr.core.evaluate import evaluate_model

    settings, seed = job["settings"], int(job["seed"])
    data = load_task(settings)
    n = data["num_classes"]
    init, what = shared_init(settings, seed, job.get("backbone"))
    model = build_model(settings, n)
    model.load_state_dict(init)
    cfg = _client_cfg(settings)
    torch.manual_seed(seed * 1000 + 999)
    t = time.perf_counter()
    train_local(model, _loader(*data["train"], cfg.batch_size, True, seed * 1000 + 999), cfg, device,
                desc="central")
    train_s = time.perf_counter() - t
    acc = evaluate_model(model, _loader(*data["test"], 256, False), device, n)["acc"]
    print(f"central model on all {len(data['train'][1])} training images from {what}: test acc {acc:.3f}")
    return {"test_acc": acc, "train_s": train_s, "train_images": len(data["train"][1])}


def job_method(job: Dict[str, Any], device) -> Dict[str, Any]:
    import torch

    from fedml_fedmitr.core import ensemble as ensemble_module
    from fedml_fedmitr.core.config import FedMITRConfig
    from fedml_fedmitr.core.methods import Callbacks, ClientUpload, ServerContext, get_method

    settings, seed, name = job["settings"], int(job["seed"]), job["method"]
    data = load_task(settings)
    n = data["num_classes"]
    blob = torch.load(job["clients"], map_location="cpu", weights_only=True)
    init = blob["init_state"]
    uploads = [ClientUpload.from_payload(p) for p in blob["uploads"]]

    def model_fn():
        m = build_model(settings, n)
        m.load_state_dict(init)
        return m

    cfg = FedMITRConfig.from_dict(dict(settings["server"], progress=False, save_images=False),
                                  where="settings.server")
    ctx = ServerContext(model_fn=model_fn, num_classes=n, input_shape=tuple(data["train"][0].shape[1:]),
                        mean=data["mean"], std=data["std"], device=device,
                        eval_loader=_loader(*data["test"], 256, False), state_dir=None,
                        callbacks=Callbacks(progress=False), seed=seed,
                        pretrained_state=init if settings["backbone"] == "pretrained" else None,
                        client_augment=_client_cfg(settings).augment, client_flip=_client_cfg(settings).flip)
    # count the images each method passes through the ensemble (the test evaluation excluded)
    counter = {"on": True, "n": 0}
    original = ensemble_module.Ensemble.client_logits

    def counted(self, x, *a, **kw):
        if counter["on"]:
            counter["n"] += int(x.shape[0])
        return original(self, x, *a, **kw)

    ensemble_module.Ensemble.client_logits = counted
    method = get_method(name)(cfg)
    plain_evaluate = method.evaluate

    def evaluate(model, c):
        counter["on"] = False
        try:
            return plain_evaluate(model, c)
        finally:
            counter["on"] = True

    method.evaluate = evaluate
    rss_before = _peak_rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    result = method.run(uploads, ctx)
    total = time.perf_counter() - t
    m = result.metrics
    timings = m.get("timings", {})
    out = {"method": name, "test_acc": m.get("test_acc"), "ensemble_acc": m.get("ensemble_acc"),
           "synthesis_s": timings.get("synthesis_s"), "images_per_s": m.get("images_per_s"),
           "distill_s": timings.get("distill_s"), "total_s": total, "num_synthetic": m.get("num_synthetic"),
           "ensemble_queries": counter["n"], "rss_before_run_mb": rss_before,
           "per_class_acc": m.get("per_class_acc"), "pool_ensemble_fit": m.get("pool_ensemble_fit"),
           "clients_used": m.get("clients_used"), "screening": m.get("screening"),
           "config": method.config.to_dict()}
    print(f"{name} seed {seed}: test acc {out['test_acc']:.3f}, ensemble acc {out['ensemble_acc']:.3f}, "
          f"synthesis {out['synthesis_s']:.1f} s, distillation {out['distill_s']:.1f} s, "
          f"{out['ensemble_queries']} ensemble queries")
    return out


JOBS = {"pretrain": job_pretrain, "clients": job_clients, "central": job_central, "method": job_method}


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    import torch
    threads = int(job["settings"].get("threads_per_job") or 1)
    torch.set_num_threads(threads)
    device = torch.device(job["settings"].get("device", "cpu"))
    t = time.perf_counter()
    out = JOBS[job["kind"]](job, device)
    out.update(ok=True, kind=job["kind"], seed=job.get("seed"), wall_s=time.perf_counter() - t,
               peak_rss_mb=_peak_rss_mb(), threads=threads, torch=torch.__version__, device=str(device))
    if "rss_before_run_mb" in out:
        out["rss_growth_mb"] = out["peak_rss_mb"] - out["rss_before_run_mb"]
    if device.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    write_json_atomic(Path(job["out"]), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
