"""A parent for the harness's rank processes that has already imported what every rank imports.

A rank process spends ~5 s on 2 cores importing torch, ``torch._dynamo`` (the first optimizer
imports it; zerotrain imports it before the process group on purpose) and zerotrain before it runs a
line of its test, and the suite starts a few hundred of them. ``harness.run_ranks`` therefore asks
this server, started once per pytest process, to ``fork()`` each rank from a process that holds
those modules already. The forked rank then becomes what a fresh one would be: its own session, the
test's environment, working directory, ``sys.argv`` and log file, fresh random seeds, and at the
end the interpreter's exit handlers (``atexit``) before ``os._exit``. What it cannot reproduce, a
process that starts from nothing (a test that checks which modules a rank imports, or how the
interpreter itself finalizes), asks ``run_ranks(..., fresh=True)``; so does any spawn whose
environment differs from this server's in a variable read at start-up (``harness.needs_fresh``).

The server imports nothing that starts threads or runs a parallel region (forking after OpenMP has
run would leave the child's thread pool broken), and leaves when its parent does.

Protocol, one JSON line per request on a Unix socket: ``{"argv", "env", "cwd", "log", "rc"}``; the
reply is the child's pid. When the child ends, its exit status is written to the ``rc`` path
(written then renamed, so a reader sees all of it or nothing): the code, or -N for signal N.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time


def _write_rc(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)


def _child(req: dict) -> None:
    """In the forked process: become the rank, run it, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for path in reversed([p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]):
            if path not in sys.path:
                sys.path.insert(0, path)
        sys.argv = list(req["argv"][1:])  # as the interpreter sets it: the script, then its arguments
        import random

        random.seed()  # a fresh process draws its own seeds: the forked ones must not share the server's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import torch

        torch.seed()  # a new process seeds torch's generator from the OS too
        import harness

        harness._child(sys.argv[1], sys.argv[2])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would, then exit 1
        import traceback

        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()  # what interpreter exit runs first (our process-group release among them)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reap(children: dict[int, str], lock: threading.Lock) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            time.sleep(0.05)
            continue
        with lock:
            rc = children.pop(pid, None)
        if rc is not None:
            _write_rc(rc, status)


def _watch_parent(parent: int, path: str) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    try:
        os.unlink(path)
    finally:
        os._exit(0)


def serve(path: str) -> None:
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    import harness  # noqa: F401  (its own imports)
    import zerotrain  # noqa: F401
    import zerotrain.trainer  # noqa: F401

    children: dict[int, str] = {}
    lock = threading.Lock()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    threading.Thread(target=_reap, args=(children, lock), daemon=True).start()
    threading.Thread(target=_watch_parent, args=(os.getppid(), path), daemon=True).start()
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            if not data.endswith(b"\n"):
                continue
            req = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            with lock:  # the reaper must know the pid before the child can end
                pid = os.fork()
                if pid == 0:
                    server.close()
                    _child(req)
                children[pid] = req["rc"]
            conn.sendall(f"{pid}\n".encode())


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    serve(sys.argv[1])
