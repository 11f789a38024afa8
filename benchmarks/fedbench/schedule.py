"""Running the benchmark's jobs: child processes, ``--jobs`` at a time, claimed across processes.

Several ``compare.py`` processes may share one cache (one per seed, or the same command twice). A
process claims a job before running it by taking ``<record>.lock`` with ``filelock`` (an OS lock,
released when the process ends, however it ends) and writing ``<record>.claim`` (its pid, host and
start, for messages); the others take other jobs first and then wait for the record. A cache on a
shared disk needs a filesystem whose locks work across hosts.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Dict, List, Optional

from filelock import FileLock, Timeout

from .settings import NOT_RUN
from .store import ROOT, read_json, write_json_atomic

WAIT = object()
POLL_S = 10.0


class Job:
    def __init__(self, kind: str, name: str, out: Path, spec: Dict[str, Any], log: Path):
        self.kind, self.name, self.out, self.spec, self.log = kind, name, Path(out), spec, Path(log)
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[str] = None
        self.cached = False
        self.elapsed = 0.0
        self.lock: Optional[FileLock] = None


def claim_path(job: Job) -> Path:
    return job.out.with_name(job.out.stem + ".claim")


def lock_path(job: Job) -> Path:
    return job.out.with_name(job.out.stem + ".lock")


def try_claim(job: Job) -> Optional[str]:
    """Claim ``job`` for this process: None when it is ours now, else who holds it."""
    if job.lock is not None and job.lock.is_locked:
        return None
    path = lock_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        holder = read_json(claim_path(job)) or {}
        return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}; "
                f"lock {path}")
    job.lock = lock
    write_json_atomic(claim_path(job), {"pid": os.getpid(), "host": socket.gethostname(),
                                        "since": time.strftime("%Y-%m-%d %H:%M:%S")})
    return None


def release_claim(job: Job) -> None:
    if job.lock is None or not job.lock.is_locked:
        return
    claim_path(job).unlink(missing_ok=True)
    job.lock.release()
    job.lock = None


class Runner:
    """Runs jobs as ``compare.py --worker JOB.json`` children, ``--jobs`` at a time (a thread pool, each
    thread waiting on its child), with a tqdm bar; every job is claimed first (:func:`try_claim`)."""

    def __init__(self, settings: Dict[str, Any], args: argparse.Namespace, total: int,
                 cache: Optional[Path] = None):
        from tqdm.auto import tqdm
        self.settings, self.args = settings, args
        self.cache = Path(cache) if cache is not None else None
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

        pool = ThreadPoolExecutor(max_workers=max(1, self.args.jobs), thread_name_prefix="bench")
        loops = [pool.submit(loop) for _ in range(max(1, self.args.jobs))]
        received = 0
        while received < len(todo):
            try:
                job = finished.get(timeout=1.0)
            except Empty:
                if not all(f.done() for f in loops):
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
        pool.shutdown(wait=False)

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
        write_json_atomic(spec_path, {"kind": job.kind, "settings": self.settings, "out": str(job.out),
                                      "cache": str(self.cache), **job.spec})
        env = dict(os.environ)
        env.update({"OMP_NUM_THREADS": str(self.args.threads), "MKL_NUM_THREADS": str(self.args.threads),
                    "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled",
                    "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
        cmd = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--worker", str(spec_path)]
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
