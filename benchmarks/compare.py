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
4. adds the reference rows: the ensemble of the client models; a model trained centrally on the
   union of all client shards (same training config and epochs as a client: the upper bound);
   ``KD-real`` and ``KD-real-plain`` (FedMITR's distillation, token relabel or plain KD, on as many
   real unlabelled training images as the synthetic pool); and the attention probe (the ensemble on
   test images seen through only the top-k / random k / bottom-k CLS-attention patches);
5. writes ``benchmarks/results/<setting>.json`` (mean, std and per-seed values over the seeds)
   and ``<setting>.md`` (a markdown table, also printed).

The data go through the plugin's own path (``fedml_fedmitr.data.load_data``): a setting gives the
same clients, split and normalisation as ``python -m fedml_fedmitr`` with the same YAML. Every
method records its learning curve (test accuracy per distillation epoch) and its start; every row
its paired difference to FedMITR by seed with a 95% t interval. ``--budget time`` gives every
synthesis method the synthesis time of ``--time-reference`` at the query budget instead (each turns
it into images at its own measured speed). The package ``benchmarks/fedbench`` holds the pieces.

Every job (pretraining, client training, central training, one method on one seed) runs as
``python benchmarks/compare.py --worker JOB.json`` and writes its record to a JSON file in the
cache; a record that exists is reused, so an interrupted suite continues where it stopped
(``--force`` recomputes). The parent imports torch only to check ``--method-set`` keys against
the method's used keys. ``--method-set METHOD:KEY=VALUE`` gives one method a knob of its own (one
chosen for it on ``--split val``); its records are keyed by it.

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

import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from fedbench.report import aggregate_rows, markdown, plot_curves, references  # noqa: E402
from fedbench.schedule import WAIT, Job, Runner, claim_path, release_claim, try_claim  # noqa: E402,F401
from fedbench.settings import (  # noqa: E402,F401
    ALL_METHODS,
    GENERATOR_METHODS,
    INVERSION_METHODS,
    NOT_RUN,
    build_parser,
    build_settings,
    client_key,
    derive_budget,
    method_server,
    portable_settings,
    pretrain_key,
    server_key,
    setting_name,
)
from fedbench.store import portable, write_json_atomic  # noqa: E402

SYNTHESIS_METHODS = INVERSION_METHODS | GENERATOR_METHODS
# the most two query-budget records of one seed may differ in machine speed (their speed_probe_s) before
# --budget time refuses to combine them: jobs side by side on one machine were measured within 1.25x of
# each other, the slow and the normal machines of this project's sessions 1.8-2.5x apart
SPEED_TOLERANCE = 1.5


def plan(settings: Dict[str, Any], cache: Path) -> Dict[str, Any]:
    """The jobs of a setting: the backbone (if pretrained offline), then per seed the clients, the
    central model, each method and each reference row (query budget)."""
    base = cache / settings["data_name"]
    out: Dict[str, Any] = {"pretrain": None, "seeds": {}}
    if settings["backbone"] == "pretrained" and settings["pretrain"]["source"] in ("split", "share", "npz"):
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
        jobs["Ensemble"] = Job("ensemble", f"Ensemble seed {seed}", d / f"server-{skey}" / "Ensemble.json", {},
                               d / "logs" / f"Ensemble-{skey}.log")
        for m in settings["methods"] + settings["references"]:
            own = method_server(settings, m)
            mkey = server_key(settings, own)     # skey unless the method has knobs of its own
            jobs[m] = Job("method", f"{m} seed {seed}", d / f"server-{mkey}" / f"{m}.json",
                          {"method": m, "server_override": own}, d / "logs" / f"{m}-{mkey}.log")
        out["seeds"][seed] = {"dir": d, "jobs": jobs}
    return out


def time_budget_jobs(settings: Dict[str, Any], p: Dict[str, Any], seed: int) -> Dict[str, Job]:
    """The equal-synthesis-time jobs of one seed, from its query-budget records: the time budget is
    ``time_reference``'s synthesis seconds; each synthesis method gets as many images as its own
    kept-images-per-second made at the query budget fit in it (to the nearest whole synthesis batch, at
    least one);
    the KD-real rows get as many real images as FedMITR; methods without synthesis are unchanged."""
    jobs = p["seeds"][seed]["jobs"]
    ref = jobs[settings["time_reference"]].result
    if ref is None or not ref.get("synthesis_s"):
        raise RuntimeError(f"no query-budget record of {settings['time_reference']} (seed {seed})")
    seconds = float(ref["synthesis_s"])
    server = settings["server"]
    batch = int(server["synthesis_batch_size"])
    counts: Dict[str, int] = {}
    for m in settings["methods"]:
        r = jobs[m].result
        if m in SYNTHESIS_METHODS and r is not None and r.get("synthesis_s") and r.get("num_synthetic"):
            rate = float(r["num_synthetic"]) / float(r["synthesis_s"])
            counts[m] = max(batch, int(round(seconds * rate / batch)) * batch)
    speed = check_same_speed(settings, jobs, counts, seed)
    out: Dict[str, Job] = {}
    d = p["seeds"][seed]["dir"]
    for m in settings["methods"] + settings["references"]:
        n = counts.get(m if m not in settings["references"] else "FedMITR")
        override: Dict[str, Any] = method_server(settings, m)
        if n is not None:
            srv = dict(server, num_synthetic=n)
            derive_budget(srv, [k for k in settings["server_explicit"] if k != "num_synthetic"])
            override.update({k: srv[k] for k in ("num_synthetic", "gen_batch_size", "gen_kd_steps") if k in srv})
        key = server_key(settings, override)
        out[m] = Job("method", f"{m} seed {seed} (time budget)", d / f"server-{key}" / f"{m}.json",
                     {"method": m, "server_override": override, "seed": seed,
                      "clients": jobs["clients"].spec["checkpoint"]}, d / "logs" / f"{m}-{key}.log")
    out["_budget"] = {"seconds": seconds, "images": counts, **speed}   # type: ignore[assignment]
    return out


def check_same_speed(settings: Dict[str, Any], jobs: Dict[str, Job], counts: Dict[str, int],
                     seed: int) -> Dict[str, Any]:
    """The time budget multiplies one record's seconds by another's images per second, so the query-budget
    records of one seed must be timed at one machine speed (a suite resumed in another session, on another
    machine, can mix them). Each record's ``speed_probe_s`` (a fixed forward and backward pass of the
    student, timed just before the method) is compared with the reference's: a ratio beyond
    SPEED_TOLERANCE is refused, naming the records to delete and recompute; records made before the probe
    existed are listed as unchecked in the budget. ``counts``: the methods the budget gives images to."""
    ref_name = settings["time_reference"]
    ref = jobs[ref_name].result.get("speed_probe_s")
    ratios: Dict[str, float] = {}
    unchecked = []
    for m in counts:
        if m == ref_name:
            continue
        probe = jobs[m].result.get("speed_probe_s")
        if ref and probe:
            ratios[m] = probe / ref
        else:
            unchecked.append(m)
    off = {m: q for m, q in ratios.items() if not 1 / SPEED_TOLERANCE <= q <= SPEED_TOLERANCE}
    if off:
        names = ", ".join(f"{m} ({q:.2f}x {ref_name}'s probe time)" for m, q in off.items())
        paths = " ".join(str(jobs[m].out) for m in [ref_name, *off])
        raise RuntimeError(f"seed {seed}: the query-budget records of {names} were timed at another machine "
                           f"speed than {ref_name}'s, so a time budget built from them would be wrong; delete "
                           f"{paths} and rerun the command to time them together")
    return {"speed_ratio": ratios, "speed_unchecked": unchecked}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    if args.worker:
        from fedbench.jobs import worker_main
        return worker_main(args.worker)
    t0 = time.perf_counter()
    settings = build_settings(args)
    name = setting_name(settings, args)
    cache = Path(args.cache_dir).resolve()
    results_dir = Path(args.results_dir).resolve()
    p = plan(settings, cache)
    seeds = settings["seed"]
    rows = settings["methods"] + settings["references"]
    total = (1 if p["pretrain"] else 0) + sum(len(v["jobs"]) for v in p["seeds"].values()) \
        + (len(rows) * len(seeds) if settings["budget"] == "time" else 0)
    runner = Runner(settings, args, total, cache=cache)
    errors: Dict[str, Dict[int, str]] = {}
    time_jobs: Dict[int, Dict[str, Job]] = {}
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
                for m in rows:
                    errors.setdefault(m, {})[seed] = (NOT_RUN if jobs["clients"].error == NOT_RUN
                                                      else "client training failed")
                    runner.bar.update(1)
                runner.bar.update(1)
                continue
            second += [jobs["Ensemble"]] + [jobs[m] for m in rows]
        runner.run_all(second, "server methods" + (" (query budget)" if settings["budget"] == "time" else ""))
        if settings["budget"] == "time":
            third = []
            for seed in seeds:
                try:
                    time_jobs[seed] = time_budget_jobs(settings, p, seed)
                except RuntimeError as exc:
                    for m in rows:
                        errors.setdefault(m, {})[seed] = (NOT_RUN if args.report_only else str(exc))
                    continue
                for job in time_jobs[seed].values():
                    if isinstance(job, Job):
                        job.spec["backbone"] = backbone
                        third.append(job)
            runner.run_all(third, "server methods (time budget)")
    except KeyboardInterrupt:
        runner.kill_all()
        raise
    finally:
        runner.close()

    # ---- aggregate ----
    per_seed: Dict[str, Dict[int, Dict[str, Any]]] = {}
    clients_info, probes = {}, {}
    for seed in seeds:
        jobs = p["seeds"][seed]["jobs"]
        cl = jobs["clients"].result
        if cl is None:
            errors.setdefault("Ensemble", {})[seed] = jobs["clients"].error or "missing"
            continue
        clients_info[str(seed)] = {k: cl.get(k) for k in ("client_acc", "client_samples", "client_label_counts",
                                                          "train_s", "peak_rss_mb", "init", "num_test")}
        ens = jobs["Ensemble"].result
        if ens is None:
            errors.setdefault("Ensemble", {})[seed] = jobs["Ensemble"].error or "missing"
        else:
            probes[seed] = ens["attention_probe"]
            per_seed.setdefault("Ensemble", {})[seed] = {
                "test_acc": ens["test_acc"], "ensemble_acc": ens["test_acc"], "client_acc_mean": cl["client_acc_mean"]}
        source = time_jobs.get(seed, jobs) if settings["budget"] == "time" else jobs
        for m in rows:
            job = source.get(m)
            if job is not None and job.result is not None:
                rec = dict(job.result)
                rec["client_acc_mean"] = cl["client_acc_mean"]
                per_seed.setdefault(m, {})[seed] = rec
            elif job is not None and job.error:
                errors.setdefault(m, {})[seed] = job.error
        if "central" in jobs:
            c = jobs["central"]
            if c.result is not None:
                per_seed.setdefault("Central", {})[seed] = {
                    "test_acc": c.result["test_acc"], "train_s": c.result["train_s"],
                    "peak_rss_mb": c.result["peak_rss_mb"], "peak_gpu_mb": c.result.get("peak_gpu_mb")}
            else:
                errors.setdefault("Central", {})[seed] = c.error or "missing"
    order = settings["methods"] + ["Ensemble"] + (["Central"] if settings["central"] else []) + settings["references"]
    records = aggregate_rows(per_seed, order, seeds, errors)
    here = Path(__file__).resolve()
    argv = [portable(a) if os.path.isabs(a) and portable(a) != Path(a).name else a for a in argv]
    command = shlex.join(["python", os.path.relpath(here, Path.cwd()) if Path.cwd() in here.parents else
                          "benchmarks/compare.py"] + [a for a in argv if a != "--report-only"])
    num_test = next((c["num_test"] for c in clients_info.values() if c.get("num_test")), None)
    out_settings = dict(portable_settings(settings), num_test=num_test)
    if settings["budget"] == "time":
        out_settings["time_budget"] = {str(s): v["_budget"] for s, v in time_jobs.items()}
    result = {
        "name": name,
        "command": command,
        "argv": argv,
        "settings": out_settings,
        "records": records,
        "references": references(per_seed, probes, seeds),
        "clients": clients_info,
        "pretrain": ({k: portable(v) if k == "checkpoint" else v for k, v in p["pretrain"].result.items()}
                     if p["pretrain"] is not None and p["pretrain"].result else None),
        "environment": {"python": platform.python_version(), "machine": platform.machine(),
                        "cpus": os.cpu_count()},
        "cache": {"clients": {str(s): portable(p["seeds"][s]["dir"]) for s in seeds}},
        "wall_s": time.perf_counter() - t0,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "report_only": bool(args.report_only),
    }
    first_method = next((per_seed[m][s] for m in rows for s in seeds if s in per_seed.get(m, {})), None)
    if first_method is not None:
        result["environment"]["torch"] = first_method.get("torch")
    json_path = results_dir / f"{name}.json"
    md_path = results_dir / f"{name}.md"
    table = markdown(result)
    if args.plots:
        pic = plot_curves(result, results_dir / f"{name}_curves.png")
        if pic:
            result["curves_png"] = portable(pic)
            table += f"\nLearning curves: `{Path(pic).name}`\n"
    write_json_atomic(json_path, result)
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


if __name__ == "__main__":
    sys.exit(main())
