"""The benchmark's settings: command line, scale presets, the matched budget (no torch)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .store import ROOT, portable, stable_hash

HERE = ROOT / "benchmarks"
SCHEMA_VERSION = 2
# Bumped when the way data are loaded, split or normalised changes: cached clients of another
# version are not reused (2: through fedml_fedmitr.data, as the CLI).
DATA_PATH_VERSION = 2

# The server methods in table order: FedMITR, its ablations, then the baselines.
ALL_METHODS = ["FedMITR", "FedMITR-dense", "FedMITR-kd", "FedMITR-ce", "DeepInversion", "DENSE",
               "CoBoosting", "FedFTG", "OneShotFedAvg"]
INVERSION_METHODS = {"FedMITR", "FedMITR-dense", "FedMITR-kd", "FedMITR-ce", "DeepInversion"}
GENERATOR_METHODS = {"DENSE", "CoBoosting", "FedFTG"}
# FedMITR's distillation on real unlabelled training images in place of the synthetic pool
# (token relabel with masks from the ensemble's attention, and plain KD): a weak teacher or a short
# distillation told apart from weak synthesis. Rows of kind "reference", run like methods.
REAL_REFERENCES = {"KD-real": "FedMITR", "KD-real-plain": "FedMITR-kd"}
REFERENCE_ROWS = ["Ensemble", "Central"]
NOT_RUN = "not run (--report-only)"

# Numbers aggregated over seeds (mean, std, per seed) in every record.
NUMERIC_FIELDS = ["test_acc", "ensemble_acc", "client_acc_mean", "synthesis_s", "images_per_s", "distill_s",
                  "peak_rss_mb", "rss_growth_mb", "num_synthetic", "ensemble_queries", "total_s", "train_s",
                  "peak_gpu_mb", "start_acc"]
RECORD_FIELDS = ["method", "test_acc", "ensemble_acc", "client_acc_mean", "synthesis_s", "images_per_s",
                 "distill_s", "peak_rss_mb"]

# Scale presets: budgets only (sizes, steps, epochs); every method knob is FedMITRConfig's default
# unless --server-set changes it (and a changed knob is chosen on --split val, see the README).
# ``server``: FedMITRConfig knobs (generator knobs are derived, see budget());
# ``client``: ClientTrainConfig knobs (digits/image-data specific ones are added in build_settings);
# ``pretrain_epochs``: epochs of the offline backbone; ``model``: timm name and extra kwargs.
PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": {  # tests: seconds per job
        "model": ("fedmitr_vit_micro", {"depth": 2}),
        "client": dict(epochs=3, batch_size=32, lr=2e-3),
        "pretrain_epochs": 2,
        "server": dict(num_synthetic=40, synthesis_batch_size=20, inversion_iters=10, distill_epochs=2,
                       distill_batch_size=20, gen_epochs=2),
    },
    "cpu": {  # 2 CPU cores: one (setting, seed) of CIFAR-10 with K=10 is about 45-60 min with --jobs 2
        "model": ("fedmitr_vit_micro", {}),
        "client": dict(epochs=30, batch_size=32, lr=2e-3),
        "client_image": dict(epochs=20, batch_size=64, lr=1e-3),
        "pretrain_epochs": 20,
        "server": dict(num_synthetic=400, synthesis_batch_size=100, inversion_iters=200, distill_epochs=30,
                       distill_batch_size=64, gen_epochs=4),
    },
    "gpu": {  # paper-like (the GPU configs of config/): 2.7M-parameter ViT, 1000 inversion steps
        "model": ("fedmitr_vit_small", {}),
        "client": dict(epochs=100, batch_size=64, lr=1e-3),
        "pretrain_epochs": 100,
        "server": dict(num_synthetic=5120, synthesis_batch_size=256, inversion_iters=1000, distill_epochs=100,
                       distill_batch_size=256, gen_epochs=20),
    },
}


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


def build_parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring and benchmarks/README.md.")
    ap.add_argument("--dataset", choices=["digits", "npz", "cifar10_full"], default="digits",
                    help="cifar10_full: all 50,000 / 10,000 CIFAR-10 images, decoded once from "
                         "../shared/data/cifar10_jpeg.npz into the cache")
    ap.add_argument("--npz", help="archive with x_train, y_train, x_test, y_test (for --dataset npz)")
    ap.add_argument("--split", choices=["test", "val"], default="test",
                    help="evaluate on the test images, or on a validation split (a fifth of the training "
                         "images, stratified, held out of the clients' data): knobs are chosen on val")
    ap.add_argument("--partition", choices=["hetero", "pathological", "homo"], default="hetero")
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha of --partition hetero")
    ap.add_argument("--classes-per-client", type=int, default=1, help="of --partition pathological")
    ap.add_argument("--clients", type=int, default=5, help="K")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--scale", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--backbone", choices=["scratch", "pretrained"], default="scratch")
    ap.add_argument("--pretrain", choices=["split", "share", "npz"], default=None,
                    help="offline backbone source (default split; npz when --pretrain-npz is given): split = "
                         "the training images of --public-classes, the federation learns the other classes; "
                         "share = a stratified --public-share of every class's training images, the "
                         "federation learns every class on the rest")
    ap.add_argument("--public-share", type=float, default=0.5, help="of --pretrain share")
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
    ap.add_argument("--method-set", nargs="*", default=[], metavar="METHOD:KEY=VALUE",
                    help="a FedMITRConfig knob for one method only, over --server-set (a knob chosen for "
                         "that method on --split val, e.g. DENSE:baseline_kd_temperature=4); not a budget knob")
    ap.add_argument("--client-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="ClientTrainConfig knobs over the preset (e.g. epochs=10); also central and pretraining")
    ap.add_argument("--methods", nargs="+", default=None,
                    help=f"server methods to run (default all: {' '.join(ALL_METHODS)})")
    ap.add_argument("--no-central", action="store_true", help="skip the centrally trained reference")
    ap.add_argument("--no-references", action="store_true",
                    help="skip the KD-real / KD-real-plain rows (run by default after the methods)")
    ap.add_argument("--budget", choices=["queries", "time"], default="queries",
                    help="queries: every method the same ensemble queries (the preset); time: every "
                         "synthesis method the synthesis wall time --time-reference took at the query budget, "
                         "turned into images by each method's own measured speed (needs the query-budget "
                         "records of the same setting, run first)")
    ap.add_argument("--time-reference", default="DeepInversion",
                    help="the method whose query-budget synthesis time is the time budget")
    ap.add_argument("--plots", action="store_true",
                    help="also draw the learning curves (test accuracy per distillation epoch) to RESULTS/NAME_curves.png")
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


# Keys --method-set may not change: the budget is the same for every method, and the benchmark sets the rest.
# (the presets' server keys, which are budgets only, and what derive_budget() and --student-init set)
BUDGET_KEYS = tuple(sorted({k for preset in PRESETS.values() for k in preset["server"]}
                           | {"gen_batch_size", "gen_steps", "gen_kd_steps", "student_init"}))
RESERVED_KEYS = ("seed", "output_dir", "resume", "progress", "tensorboard", "save_images")


def parse_method_set(items: Sequence[str], rows: Sequence[str], server: Dict[str, Any],
                     cfgmod: Any) -> Dict[str, Dict[str, Any]]:
    """``METHOD:KEY=VALUE`` strings as ``{method: {key: value}}``: each key a FedMITRConfig knob that
    the method uses (checked against its ``used_keys()``, which needs the method registry and so
    torch), not a budget knob, valid over ``server``; each method one of ``rows``."""
    out: Dict[str, Dict[str, Any]] = {}
    for item in items or []:
        method, sep, assignment = item.partition(":")
        if not sep or "=" not in assignment:
            raise SystemExit(f"--method-set: {item!r} is not METHOD:KEY=VALUE")
        if method not in rows:
            raise SystemExit(f"--method-set {item}: {method!r} is not a row of this run "
                             f"(expected one of {' '.join(rows)})")
        knob = parse_assignments([assignment], f"--method-set {method}")
        key = next(iter(knob))
        if key in BUDGET_KEYS or key in RESERVED_KEYS:
            raise SystemExit(f"--method-set {item}: {key} is "
                             + ("a budget knob, the same for every method (use --server-set)" if key in BUDGET_KEYS
                                else "set by the benchmark, not a knob"))
        if key in out.get(method, {}):
            raise SystemExit(f"--method-set: {method}:{key} given twice")
        out.setdefault(method, {}).update(knob)
    if not out:
        return out
    from fedml_fedmitr.core.methods import get_method  # imports torch: only when --method-set is used
    for method, knobs in out.items():
        used = set(get_method(REAL_REFERENCES.get(method, method)).used_keys())
        unused = sorted(set(knobs) - used)
        if unused:
            raise SystemExit(f"--method-set {method}: {method} does not use {unused} "
                             f"(it uses: {', '.join(sorted(used))})")
        try:
            cfgmod.FedMITRConfig.from_dict(dict(server, **knobs), where=f"--method-set {method}")
        except cfgmod.ConfigError as exc:
            raise SystemExit(str(exc)) from None
    return out


def method_server(settings: Dict[str, Any], method: str) -> Dict[str, Any]:
    """The knobs ``method`` runs with over ``settings["server"]`` (from --method-set; empty if none)."""
    return dict((settings.get("method_server") or {}).get(method, {}))


def build_settings(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything that defines the benchmark (the JSON's ``settings``), from the command line."""
    preset = PRESETS[args.scale]
    if args.dataset == "cifar10_full":
        from .tasks import cifar10_full_archive
        npz = str(cifar10_full_archive(Path(args.cache_dir)))
        data_name = "cifar10_full"
    elif args.dataset == "npz":
        if not args.npz:
            raise SystemExit("--dataset npz needs --npz PATH")
        npz = str(Path(args.npz).expanduser().resolve())
        if not Path(npz).is_file():
            raise SystemExit(f"--npz {args.npz}: no such file")
        data_name = Path(npz).stem
    else:
        npz, data_name = None, "digits"
    classes, in_chans, side, _ = dataset_labels("digits" if args.dataset == "digits" else "npz", npz)

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
            elif source == "share":
                if not 0.0 < args.public_share < 1.0:
                    raise SystemExit(f"--public-share {args.public_share}: expected a fraction in (0, 1)")
                pretrain = {"source": "share", "public_share": args.public_share, "epochs": epochs,
                            "seed": args.pretrain_seed,
                            "what": f"pretrained on {args.public_share:.0%} of every class's training images of "
                                    f"{data_name} (stratified); the federation learns every class on the rest"}
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
    if args.budget == "time" and args.time_reference not in (args.methods or ALL_METHODS):
        raise SystemExit(f"--budget time: --time-reference {args.time_reference} is not among --methods")
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
    for key in RESERVED_KEYS:
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

    method_server = parse_method_set(args.method_set, methods + ([] if args.no_references
                                                                 else list(REAL_REFERENCES)), server, cfgmod)

    if args.partition == "pathological" and args.clients * args.classes_per_client < len(task_classes):
        raise SystemExit(f"--partition pathological: {args.clients} clients x {args.classes_per_client} "
                         f"class(es) cannot cover the {len(task_classes)} classes; use --clients "
                         f">= {math.ceil(len(task_classes) / args.classes_per_client)}")

    return {
        "schema_version": SCHEMA_VERSION,
        "dataset": args.dataset,
        "npz": npz,
        "data_name": data_name,
        "npz_file": portable(npz),
        "split": args.split,
        "test_set": ("a validation split: a fifth of the training images of every class, held out of the "
                     "clients' data (stratified, seed 7)" if args.split == "val" else
                     "the plugin's digits split (stratified 80/20, seeded by the seed)"
                     if args.dataset == "digits" and pretrain is None else
                     "a fixed stratified 80/20 split of scikit-learn's digits" if args.dataset == "digits"
                     else "the archive's x_test / y_test")
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
        "server_explicit": sorted(overrides),
        "method_server": method_server,
        "budget": args.budget,
        "budget_detail": budget,
        "time_reference": args.time_reference if args.budget == "time" else None,
        "methods": methods,
        "references": [] if args.no_references else list(REAL_REFERENCES),
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
    extra = {k: v for k, v in {"server": args.server_set, "method": args.method_set, "client": args.client_set, "model": args.model,
                                "depth": args.depth, "img": args.img_size, "patch": args.patch_size != 4,
                                "init": args.student_init != "fedavg", "device": args.device != "cpu",
                                "pretrain": settings["pretrain"] if args.backbone == "pretrained" and (
                                    args.pretrain_npz or args.public_classes or args.pretrained_path
                                    or args.timm_pretrained or args.pretrain_epochs) else None}.items() if v}
    if extra:
        bits.append(stable_hash(extra, 6))
    if settings["split"] == "val":
        bits.append("val")
    if settings["budget"] == "time":
        bits.append("time")
    return "compare_" + "_".join(str(b) for b in bits)


def client_key(settings: Dict[str, Any], seed: int) -> str:
    """What the client models (and the central model) depend on."""
    keys = ["dataset", "partition", "alpha", "classes_per_client", "clients", "backbone", "task_classes", "model",
            "client_train", "device", "split"]
    return stable_hash({"seed": int(seed), "data": DATA_PATH_VERSION, "npz": settings["npz_file"],
                        "pretrain": portable_pretrain(settings["pretrain"]), **{k: settings[k] for k in keys}})


def pretrain_key(settings: Dict[str, Any]) -> str:
    keys = ["dataset", "model", "client_train", "device"]
    return stable_hash({"data": DATA_PATH_VERSION, "npz": settings["npz_file"],
                        "pretrain": portable_pretrain(settings["pretrain"]), **{k: settings[k] for k in keys}})


def portable_pretrain(pretrain: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not pretrain:
        return pretrain
    return {k: portable(v) if k in ("npz", "path") else v for k, v in pretrain.items()}


def portable_settings(settings: Dict[str, Any]) -> Dict[str, Any]:
    """``settings`` as the result file holds it: no absolute path of this machine."""
    out = dict(settings, npz=settings["npz_file"], pretrain=portable_pretrain(settings["pretrain"]))
    out.pop("npz_file", None)
    return out


def server_key(settings: Dict[str, Any], override: Optional[Dict[str, Any]] = None) -> str:
    """What a server record depends on: the knobs it runs with (``settings["server"]`` and an
    ``override``: a method's own knobs, a time-budget's image count) and the threads."""
    return stable_hash({"server": dict(settings["server"], **(override or {})), "threads": settings["threads_per_job"]})


