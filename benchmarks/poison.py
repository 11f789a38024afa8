"""Poisoned clients: what 2 bad uploads out of K cost a server method, with and without a defence.

    python benchmarks/poison.py --dataset digits --clients 10 --alpha 0.5 --seeds 0 1 2 \\
        --poisoned 2 --attacks random flip --method FedMITR [compare.py options ...]

For each seed it reuses compare.py's cached honest clients (trained once), picks ``--poisoned``
clients at random (seeded) and replaces their uploads:

* ``random``: an untrained model with fresh random weights (not the federation's shared init),
  reporting the replaced client's label counts;
* ``flip``: the client trains normally on its shard with every label y turned into C - 1 - y
  (and reports the flipped label counts, as its training data says).

Rows, all on the same honest clients and the same server settings:

* ``clean``: the run without the poisoned clients (the K - P honest ones): the reference;
* ``clean+screening``: the same with ``client_screening: true`` (what the screen costs honest runs);
* ``<attack>``: all K uploads, P of them poisoned, plain mean ensemble;
* ``<attack>+median``: the median-logit ensemble (``ensemble_aggregate: median``), no screening;
* ``<attack>+screening``: ``client_screening: true``.

The table gives mean and standard deviation of test accuracy over the seeds, the cost against
``clean`` (positive = accuracy lost), and which clients the screen dropped. JSON + markdown go to
``benchmarks/results/``; each run is cached under ``benchmarks/cache/``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import compare  # noqa: E402  (the benchmark's plan of jobs)

from fedbench import jobs  # noqa: E402  (client training and the method worker)
from fedbench.settings import build_parser, build_settings, portable_settings, setting_name  # noqa: E402
from fedbench.store import read_json, stable_hash, write_json_atomic  # noqa: E402
from fedbench.tasks import load_task  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    ap.add_argument("--poisoned", type=int, default=2, help="clients replaced by a poisoned upload")
    ap.add_argument("--attacks", nargs="+", choices=["random", "flip"], default=["random", "flip"])
    ap.add_argument("--defences", nargs="+", choices=["median", "screening"], default=["median", "screening"])
    ap.add_argument("--method", default="FedMITR", help="the server method (federated_optimizer name)")
    return ap


def _poisoned_ids(k: int, p: int, seed: int) -> List[int]:
    import torch
    g = torch.Generator().manual_seed(1_000 + seed)
    return sorted(torch.randperm(k, generator=g)[:p].tolist())


def make_variants(settings: Dict[str, Any], seed: int, clients_pt: Path, out: Path, poisoned: List[int],
                  attacks: List[str], device, cache: Path) -> Dict[str, Path]:
    """Write clean.pt (honest clients only) and <attack>.pt (P uploads replaced) next to the cache."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from fedml_fedmitr.core.client import train_client

    blob = torch.load(str(clients_pt), map_location="cpu", weights_only=True)
    paths = {"clean": out / "clean.pt"}
    for a in attacks:
        paths[a] = out / f"{a}.pt"
    if all(p.exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    uploads = blob["uploads"]
    torch.save(dict(blob, uploads=[u for u in uploads if u["client_id"] not in poisoned]), str(paths["clean"]))
    dataset, n, _ = load_task(settings, seed, cache)
    cfg = jobs._client_cfg(settings)
    for attack in attacks:
        bad = []
        for u in uploads:
            k = u["client_id"]
            if k not in poisoned:
                bad.append(u)
                continue
            if attack == "random":
                torch.manual_seed(50_000 + 100 * seed + k)
                model = jobs.build_model(settings, n)      # fresh random weights, not the shared init
                state = {name: v.detach().clone() for name, v in model.state_dict().items()}
                bad.append(dict(u, state_dict=state))
            else:  # flip: honest training on labels C - 1 - y
                model = jobs.build_model(settings, n)
                model.load_state_dict(blob["init_state"])
                x, y = dataset[5][k].dataset.tensors      # the client's own shard, labels flipped
                torch.manual_seed(seed * 1000 + k)
                loader = DataLoader(TensorDataset(x, n - 1 - y), batch_size=cfg.batch_size, shuffle=True,
                                    generator=torch.Generator().manual_seed(seed * 1000 + k))
                up = train_client(k, model, loader, cfg, device, n)
                bad.append(up.to_payload())
        torch.save(dict(blob, uploads=bad), str(paths[attack]))
    return paths


def run_row(settings, seed, method, clients: Path, server_over: Dict[str, Any], out: Path, log: Path,
            cache: Path) -> Dict:
    """One server run in its own process (compare.py's worker), cached in ``out``."""
    cached = read_json(out)
    if cached and cached.get("ok"):
        return cached
    job = {"kind": "method", "settings": dict(settings, server=dict(settings["server"], **server_over)),
           "seed": seed, "method": method, "clients": str(clients), "out": str(out), "cache": str(cache)}
    spec = out.with_suffix(".job.json")
    write_json_atomic(spec, job)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        rc = subprocess.call([sys.executable, str(HERE / "compare.py"), "--worker", str(spec)],
                             stdout=fh, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{method} on {clients.name} seed {seed} failed (exit {rc}); see {log}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    own, rest = _parser().parse_known_args(argv)
    cargs = build_parser().parse_args(rest + ["--methods", own.method, "--no-central", "--no-references"])
    settings = build_settings(cargs)
    import torch
    torch.set_num_threads(int(cargs.threads))
    device = torch.device(cargs.device)
    cache = Path(cargs.cache_dir).resolve()
    plan = compare.plan(settings, cache)
    k, p = settings["clients"], own.poisoned
    if not 0 < p < k / 2:
        raise SystemExit(f"--poisoned {p}: expected 1 .. {(k - 1) // 2} (a minority of the {k} clients)")
    rows = ["clean", "clean+screening"] if "screening" in own.defences else ["clean"]
    for a in own.attacks:
        rows += [a] + [f"{a}+{d}" for d in own.defences]
    over = {"screening": {"client_screening": True}, "median": {"ensemble_aggregate": "median"}}
    per_seed: Dict[str, Dict[int, Dict]] = {r: {} for r in rows}
    t0 = time.perf_counter()
    for seed in settings["seed"]:
        d = plan["seeds"][seed]["dir"]
        clients_pt = d / "clients.pt"
        if not clients_pt.exists():
            print(f"training the {k} honest clients of seed {seed} ...", flush=True)
            if settings["backbone"] == "pretrained":
                raise SystemExit("poison.py trains scratch clients itself; for a pretrained backbone run "
                                 "compare.py with the same options first (it caches the clients)")
            jobs.job_clients({"settings": settings, "seed": seed, "checkpoint": str(clients_pt), "cache": str(cache)},
                             device)
        bad_ids = _poisoned_ids(k, p, seed)
        pdir = d / f"poison-{stable_hash({'ids': bad_ids, 'attacks': sorted(own.attacks)})}"
        paths = make_variants(settings, seed, clients_pt, pdir, bad_ids, own.attacks, device, cache)
        skey = stable_hash({"server": settings["server"], "method": own.method})
        for row in rows:
            data, _, defence = row.partition("+")
            res = run_row(settings, seed, own.method, paths[data], over.get(defence, {}),
                          pdir / f"server-{skey}" / f"{row}.json", pdir / "logs" / f"{row}-{skey}.log", cache)
            scr = (res.get("screening") or {})
            res = dict(res, poisoned_ids=bad_ids if data != "clean" else [],
                       dropped=sorted(int(c) for c in (scr.get("dropped") or {})))
            per_seed[row][seed] = res
            print(f"seed {seed} {row:>20}: test acc {res['test_acc']:.3f}"
                  + (f", dropped {res['dropped']} (poisoned {res['poisoned_ids']})" if scr else ""), flush=True)
    records = []
    clean_mean = statistics.mean(per_seed["clean"][s]["test_acc"] for s in settings["seed"])
    for row in rows:
        accs = [per_seed[row][s]["test_acc"] for s in settings["seed"]]
        mean = statistics.mean(accs)
        records.append({"row": row, "test_acc": mean, "test_acc_std": statistics.pstdev(accs) if len(accs) > 1 else 0.0,
                        "test_acc_per_seed": accs, "cost_points": 100 * (clean_mean - mean),
                        "poisoned_ids": [per_seed[row][s]["poisoned_ids"] for s in settings["seed"]],
                        "dropped": [per_seed[row][s]["dropped"] for s in settings["seed"]],
                        "ensemble_acc": [per_seed[row][s]["ensemble_acc"] for s in settings["seed"]],
                        "screening": [per_seed[row][s].get("screening") for s in settings["seed"]]})
    name = cargs.name or "poison_" + setting_name(settings, cargs).replace("compare_", "", 1)
    command = "python benchmarks/poison.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"settings": portable_settings(settings), "method": own.method, "poisoned": p, "attacks": own.attacks,
              "defences": own.defences, "records": records, "command": command,
              "wall_s": time.perf_counter() - t0}
    res_dir = Path(cargs.results_dir)
    res_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(res_dir / f"{name}.json", result)
    lines = [f"## {name}", "",
             f"{settings['data_name']}, K={k} clients ({p} poisoned, chosen per seed), partition "
             f"{settings['partition']} alpha {settings['alpha']}, method {own.method}, seeds {settings['seed']}. "
             "Cost = accuracy of `clean` (the run without the poisoned clients) minus the row's, in points.", "",
             "| row | test acc (%) mean ± std | per seed | cost (points) | dropped by the screen (poisoned) |",
             "|---|---:|---|---:|---|"]
    for r in records:
        per = " / ".join(f"{100 * a:.1f}" for a in r["test_acc_per_seed"])
        dropped = "; ".join(f"{d} ({pi})" for d, pi in zip(r["dropped"], r["poisoned_ids"])) \
            if r["row"].endswith("screening") else ""
        lines.append(f"| {r['row']} | {100 * r['test_acc']:.1f} ± {100 * r['test_acc_std']:.1f} | {per} | "
                     f"{r['cost_points']:+.1f} | {dropped} |")
    lines += ["", f"Command: `{command}`", ""]
    (res_dir / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
