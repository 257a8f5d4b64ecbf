"""Local parameter-server launcher: ``python -m example_rcnn.launch -n 2 -s 1 -- <train args>``.

Starts one scheduler, ``-s`` servers (``python -m example_rcnn.ps_node``) and ``-n`` workers
(``python -m example_rcnn.train ... --kvstore dist_sync``) on this machine, talking over
127.0.0.1 on a free port.  Every worker reads its own shard of the dataset (rank r takes images
r, r+n, ...).  The whole job is bounded by ``--timeout``; on timeout, failure of any process,
Ctrl-C or SIGTERM all process groups are terminated (then killed), so no process outlives the
launcher.  Exit status: 0 if all workers succeeded, else the first non-zero worker status
(124 on timeout).  See README.md for running the same job across several machines.
"""
from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dmlc_env(role, port, num_workers, num_servers, base=None):
    env = dict(os.environ if base is None else base)
    env.pop("PORT", None)      # ps-lite would use it as this node's port
    env.update(DMLC_ROLE=role, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER=str(num_servers), DMLC_NUM_WORKER=str(num_workers),
               DMLC_NODE_HOST="127.0.0.1", DMLC_INTERFACE="lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Job:
    def __init__(self):
        self.procs = []

    def start(self, name, cmd, env):
        p = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.procs.append((name, p))
        return p

    def kill_all(self, grace=5.0):
        live = [(n, p) for n, p in self.procs if p.poll() is None]
        for _, p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        for _, p in live:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in live:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def launch(num_workers, num_servers, train_args, timeout=900.0, python=None, log=print):
    """Run the job; returns the exit status (see module doc)."""
    python = python or sys.executable
    if "--kvstore" not in train_args:
        train_args = list(train_args) + ["--kvstore", "dist_sync"]
    port = free_port()
    job = Job()
    atexit.register(job.kill_all)

    def on_signal(signum, _frame):
        job.kill_all()
        sys.exit(128 + signum)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        node = [python, "-m", "example_rcnn.ps_node"]
        job.start("scheduler", node, dmlc_env("scheduler", port, num_workers, num_servers))
        for i in range(num_servers):
            job.start("server%d" % i, node, dmlc_env("server", port, num_workers, num_servers))
        workers = [job.start("worker%d" % i, [python, "-m", "example_rcnn.train"] + train_args,
                             dmlc_env("worker", port, num_workers, num_servers))
                   for i in range(num_workers)]
        log("launch: scheduler 127.0.0.1:%d, %d server(s), %d worker(s), timeout %.0fs"
            % (port, num_servers, num_workers, timeout))
        deadline = time.time() + timeout
        status = None
        while status is None:
            codes = [w.poll() for w in workers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                log("launch: a worker failed with status %d; stopping the job" % status)
            elif all(c == 0 for c in codes):
                status = 0
            elif time.time() > deadline:
                status = 124
                log("launch: timeout after %.0fs; stopping the job" % timeout)
            else:
                time.sleep(0.2)
        if status == 0:   # scheduler and servers exit by themselves once workers finalize
            end = time.time() + min(30.0, max(1.0, deadline - time.time()))
            for _, p in job.procs:
                try:
                    p.wait(max(0.1, end - time.time()))
                except subprocess.TimeoutExpired:
                    pass
        return status
    finally:
        job.kill_all()
        for s, h in old.items():
            signal.signal(s, h)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        i = argv.index("--")
        own, train_args = argv[:i], argv[i + 1:]
    else:
        own, train_args = argv, []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole job")
    args = p.parse_args(own)
    sys.exit(launch(args.num_workers, args.num_servers, train_args, args.timeout))


if __name__ == "__main__":
    main()
