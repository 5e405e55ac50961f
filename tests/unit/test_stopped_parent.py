"""trainer/launch/stopped_parent.py on real processes: a parent stopped for longer than the timeout is
killed by the child's guard, which names rank 0; one stopped briefly (a
whole job's Ctrl-Z and ``fg``) or a guard whose store round still completes leaves it alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from zerotrain.trainer.launch.stopped_parent import process_state

# the parent (standing for rank 0) starts the child (a rank with the guard) and waits for it
PARENT = textwrap.dedent('''
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {child!r}])
    print(child.pid, flush=True)
    sys.exit(child.wait())
''')
CHILD = textwrap.dedent('''
    import os, sys, time
    from zerotrain.trainer.launch.stopped_parent import StoppedParentGuard
    rounds = {rounds}
    guard = StoppedParentGuard(1, 1.5, 86, (time.monotonic if rounds else lambda: 0.0), interval_s=0.1)
    guard.start()
    print("ready", flush=True)
    time.sleep(60)
''')


def _start(rounds: bool) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(child=CHILD.format(rounds=rounds))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"  # the guard is watching (after importing torch)
    return parent, child


def _end(parent: subprocess.Popen, child: int) -> None:
    for pid in (parent.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    parent.wait()


@pytest.mark.timeout(60)
def test_a_parent_stopped_past_the_timeout_is_killed_and_a_brief_stop_is_not():
    parent, child = _start(rounds=False)
    try:
        os.kill(parent.pid, signal.SIGSTOP)  # Ctrl-Z and fg: 0.5 s < 1.5 s
        time.sleep(0.5)
        os.kill(parent.pid, signal.SIGCONT)
        time.sleep(2.5)
        assert parent.poll() is None and process_state(child) not in (None, "Z")
        os.kill(parent.pid, signal.SIGSTOP)
        parent.wait(timeout=15)
        assert parent.returncode == -signal.SIGKILL
        for _ in range(100):  # the child ends itself right after
            if process_state(child) in (None, "Z"):
                break
            time.sleep(0.05)
        assert process_state(child) in (None, "Z")
        err = parent.stderr.read()
        assert f"rank 1: rank 0 (pid {parent.pid}, the launching process" in err, err
        assert "killed it (SIGKILL)" in err, err
    finally:
        _end(parent, child)


@pytest.mark.timeout(60)
def test_a_stopped_parent_is_left_alone_while_the_store_still_answers():
    parent, child = _start(rounds=True)
    try:
        os.kill(parent.pid, signal.SIGSTOP)
        time.sleep(3.5)
        assert process_state(parent.pid) == "T" and process_state(child) not in (None, "Z")
    finally:
        _end(parent, child)
