"""`retriever-server --workers N`: N server processes over one index, forked from the process that
opened it, as gunicorn's `--preload` does.

The parent imports the libraries and opens the index once, then forks the workers: they share its
pages copy-on-write (the imported modules, the index whether read or mapped, the document store's
mapping) and its listening socket, from which the kernel hands each connection to one worker. A
worker's own memory is what it writes after the fork (its encoder session, its event loop, its
request heap, the pages its reference counts touch), where a second `retriever-server` started
apart holds its own copy of every library (bench/RESULTS.md has both).

The parent serves nothing: it writes the ready file (`url`, its own `pid`, the `workers`' pids)
once every worker listens, starts a new worker in place of one that dies, and stops them all on
SIGTERM or SIGINT. Each worker has its own batcher, result cache and `/metrics`; `/health` names
the worker that answered (`pid`). Linux only (fork, and a worker ends with its parent), CPU indexes
with the ONNX Runtime encoder: not BM25 (its in-process JVM does not survive fork), not the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl(2)


def refusal(workers: int, kind: str, device: str | None, encoder_runtime: str | None) -> str | None:
    """Why `--workers N` cannot serve this index, before it is opened; None when it can."""
    if workers < 1:
        return f"--workers must be at least 1, got {workers}"
    if workers == 1:
        return None
    if not sys.platform.startswith("linux"):
        return f"--workers {workers} needs Linux (fork); start one retriever-server a process instead"
    if kind == "bm25":
        return f"--workers {workers} serves dense indexes only: a BM25 index's JVM does not survive fork"
    if device and device.startswith("cuda"):
        return f"--workers {workers} serves CPU indexes only; one GPU server takes the batches of all clients"
    if encoder_runtime == "torch":
        return f"--workers {workers} needs the onnx encoder runtime (--encoder-runtime onnx or auto)"
    return None


def worker_threads(threads: int, workers: int) -> int:
    """Each worker's encoder and search threads: `--threads` when given, else the cores this
    process may run on shared out (at least one each), so N workers do not oversubscribe them."""
    if threads:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


def write_ready(path: Path | None, url: str, workers: list[int] | None = None) -> None:
    """The ready file, atomically, so whoever waits on it finds a server that answers: `url` and this
    process's pid (the one to signal); with `workers`, their pids too (this process is their parent)."""
    if path is None:
        return
    ready: dict[str, Any] = {"url": url, "pid": os.getpid()}
    if workers is not None:
        ready["workers"] = sorted(workers)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(ready))
    os.replace(tmp, path)


def run_worker(
    app: Any,
    config: Any,
    sock: socket.socket,
    threads: int,
    ready_fd: int,
    parent: int,
    mask: set[int | signal.Signals],
) -> int:
    """A forked worker: its own encoder session and thread counts, then uvicorn on the shared socket
    until SIGTERM or SIGINT. `mask`: the signal mask to restore once the parent's handlers are gone.
    Returns its exit status."""
    import uvicorn

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # uvicorn installs its own for a graceful stop
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    gc.enable()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above: nobody would stop this worker
        return 0
    import faiss

    faiss.omp_set_num_threads(threads)
    app.state.retriever.index.encoder.reopen(threads)
    app.state.on_ready = lambda: os.write(ready_fd, f"{os.getpid()}\n".encode())
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def serve_workers(
    app: Any, config: Any, sock: socket.socket, workers: int, threads: int, url: str, ready_file: Path | None
) -> int:
    """Fork `workers` workers of `app` (opened in this process, nothing served yet) on `sock`, write the
    ready file once each listens, keep them running until SIGTERM or SIGINT. Returns the exit status:
    0 after a stop, 2 when a worker cannot start."""
    encoder = getattr(app.state.retriever.index, "encoder", None)
    if encoder is None or getattr(encoder, "session", None) is None:
        print("retriever-server: error: --workers needs a dense index with the onnx encoder runtime", file=sys.stderr)
        return 2
    app.state.retriever.workers = workers
    ready_r, ready_w = os.pipe()
    os.set_blocking(ready_r, False)
    parent = os.getpid()
    pids: dict[int, bool] = {}  # worker pid -> whether it has listened
    stopping = False

    def note_ready() -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(ready_r, 4096):
                for line in chunk.split():
                    if int(line) in pids:
                        pids[int(line)] = True

    def fork_worker() -> None:
        gc.freeze()  # the parent's objects move out of the collector's reach: a worker's collection does not write them
        # SIGTERM and SIGINT held over the fork: a worker must not run the parent's handler (it would stop its siblings)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        pid = os.fork()
        if pid == 0:
            status = 2
            try:
                os.close(ready_r)
                status = run_worker(app, config, sock, threads, ready_w, parent, held)
            except BaseException:  # noqa: BLE001 - a worker reports and exits; the parent decides what follows
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)  # not the parent's exit handlers: they are the parent's
        pids[pid] = False
        signal.pthread_sigmask(signal.SIG_SETMASK, held)

    def stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for _ in range(workers):
        fork_worker()
    gc.enable()
    listening = False
    while pids:
        if not listening:
            select.select([ready_r], [], [], 0.2)
            pid, status = os.waitpid(-1, os.WNOHANG)
        else:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
        note_ready()
        if not listening and not stopping and all(pids.values()):
            listening = True
            write_ready(ready_file, url, list(pids))
            names = " ".join(map(str, sorted(pids)))
            print(f"retriever-server listening on {url} ({workers} workers: {names})", flush=True)
        if not pid or stopping:
            pids.pop(pid, None)
            continue
        if not pids.pop(pid):  # it never listened: a fault a new worker would repeat
            print(
                f"retriever-server: error: worker {pid} exited ({describe(status)}) before it listened; stopping",
                file=sys.stderr,
            )
            stop(signal.SIGTERM, None)
            reap(pids)
            return 2
        print(f"retriever-server: worker {pid} exited ({describe(status)}); starting another", file=sys.stderr)
        fork_worker()
        write_ready(ready_file, url, list(pids))
    return 0


def reap(pids: dict[int, bool]) -> None:
    """Wait for the workers told to stop (SIGKILL after 30 s)."""
    deadline = time.monotonic() + 30
    while pids:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        elif time.monotonic() > deadline:
            for left in list(pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(left, signal.SIGKILL)
            deadline = float("inf")
        else:
            time.sleep(0.05)


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"status {os.waitstatus_to_exitcode(status)}"
