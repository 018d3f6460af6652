"""A watchdog that ends a local Ray's processes when the run that started them is gone.

``ray.init`` starts Ray's GCS server and raylet with PR_SET_PDEATHSIG, so the kernel kills them
with the run. The raylet's own children (the dashboard and runtime-env agents) are not: after an
unexpected raylet death each tries to report it to the dead GCS server and waits out a 60 s RPC
timeout before it exits (Ray 2.60's agent process watcher; measured: 62 s). This process closes that gap.

``python -m nitro.actors.ray_reaper ROOT_PID...`` keeps a list of the roots (the processes
``ray.init`` started) and all their descendants, refreshed every half second, while its stdin
stays open. Its stdin is a pipe from the run: it reads end-of-file when the run closes the backend
or dies, however it dies, and then kills every process on the list that is still the same process
(same pid and start time), and exits.
"""

from __future__ import annotations

import os
import select
import signal
import sys

import psutil

REFRESH_S = 0.5


def _tracked(roots: list[int], known: dict[int, float]) -> None:
    """Add each live root and its descendants to ``known`` (pid -> start time)."""
    for pid in roots:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in family:
            try:
                known.setdefault(proc.pid, proc.create_time())
            except psutil.Error:
                pass


def _kill(known: dict[int, float]) -> None:
    procs = []
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:  # not a new process that reuses the pid
                proc.kill()
                procs.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the run, which closes the backend
    roots = [int(a) for a in argv]
    known: dict[int, float] = {}
    while True:
        _tracked(roots, known)
        ready, _, _ = select.select([sys.stdin], [], [], REFRESH_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    _tracked(roots, known)
    _kill(known)


if __name__ == "__main__":
    main(sys.argv[1:])
