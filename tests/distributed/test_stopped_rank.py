"""A rank stopped with SIGSTOP: its own watchdog thread is stopped with it, so it cannot end
itself, and a stopped process ignores SIGTERM (our launcher's parent-death signal, torchrun's
first signal) until it is continued. The peer that notices it kills it (SIGKILL, same host), so the
job ends within seconds naming it and leaves no process behind (the fault campaign found a rank
left stopped after its job had ended, ``bench/fault_campaign.py``)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness import timeout_scale

SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]
    from toy import ToyModule
    from zerotrain import Trainer

    class Stops(ToyModule):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 3 and self.global_rank == {stop_rank}:
                with open({pid_file!r}, "w") as f:
                    f.write(str(os.getpid()))
                sys.stderr.write(f"FAULT sigstop at {{time.time():.3f}}\\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
            return super().training_step(batch, batch_idx)

    trainer = Trainer(strategy="ddp", devices=2, max_steps=8, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, stall_timeout_s=2.0)
    trainer.fit(Stops())
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _alive_after(pid: int, grace_s: float) -> bool:
    """Still there ``grace_s`` after the job ended: a SIGKILL sent to a stopped process by a rank
    that then exits lands, and the orphan is reaped, a moment later on a loaded machine."""
    deadline = time.time() + grace_s
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    return _alive(pid)


@pytest.mark.timeout(180)
# local runs with -m slow (~24 s; keeps the default suite under 15 minutes): the default suite keeps
# torchrun's, and our launcher's stopped rank 0 below
@pytest.mark.parametrize("launcher", [pytest.param(v, marks=pytest.mark.slow) for v in ("local", "torchrun")])  # default: rank 0 below
def test_a_stopped_rank_is_ended_by_its_peer_and_left_behind_by_nobody(tmp_path, launcher):
    pid_file = tmp_path / "rank1.pid"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), pid_file=str(pid_file), stop_rank=1))
    cmd = [sys.executable, str(script)]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--monitor-interval", "0.5", str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "ZEROTRAIN_LAUNCHED", "TORCHELASTIC_RUN_ID")}
    log = tmp_path / "job.log"  # not a pipe: a stopped rank left behind would hold it open
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=120 * timeout_scale())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if pid_file.exists():  # a stopped rank left behind is killed here, after the checks below
            stopped = int(pid_file.read_text())
            left = _alive(stopped)
            if left:
                os.kill(stopped, signal.SIGKILL)
    end = time.time()
    err = log.read_text(errors="replace")
    assert proc.returncode != 0, err[-3000:]
    assert "rank 1 made no progress" in err, err[-3000:]
    assert re.search(r"rank 0: rank 1 \(pid \d+\) published nothing for \d+ s \(stopped\?\) and cannot end itself: "
                     r"killed it \(SIGKILL\)", err), err[-3000:]
    time.sleep(0.5)
    assert not left, f"rank 1 (pid {stopped}) was left behind, stopped"
    fault_at = float(re.search(r"FAULT sigstop at ([0-9.]+)", err).group(1))
    assert end - fault_at < 30 * timeout_scale(), (end - fault_at, err[-3000:])


def _group_alive(pgid: int) -> list[int]:
    """The job's processes not yet ended (zombies count as ended): its whole process group."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.mark.timeout(180)
def test_a_stopped_rank_0_under_our_launcher_is_killed_by_the_rank_it_started(tmp_path):
    """Rank 0 is our launcher's process and hosts the store: before the fix the job never ended."""
    pid_file = tmp_path / "rank0.pid"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), pid_file=str(pid_file),
                                    stop_rank=0))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "ZEROTRAIN_LAUNCHED", "TORCHELASTIC_RUN_ID")}
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    bound = 30 * timeout_scale()
    deadline, fault_at, left = time.time() + 60 + bound, None, [proc.pid]
    try:
        while time.time() < deadline and left:
            proc.poll()  # reap rank 0: it is our child
            if fault_at is None and (m := re.search(r"FAULT sigstop at ([0-9.]+)", log.read_text(errors="replace"))):
                fault_at = float(m.group(1))
                deadline = min(deadline, fault_at + bound)
            left = _group_alive(proc.pid)
            time.sleep(0.2)
        end = time.time()
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    err = log.read_text(errors="replace")
    assert fault_at is not None, err[-3000:]
    assert not left, f"{len(left)} process(es) of the job still there {end - fault_at:.0f} s after rank 0 stopped: {err[-3000:]}"
    assert end - fault_at < bound, (end - fault_at, err[-3000:])
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-3000:])
    assert re.search(r"rank 1: rank 0 \(pid \d+, the launching process, which hosts the job's store\) has "
                     r"been stopped for \d+ s and cannot end itself: killed it \(SIGKILL\)", err), err[-3000:]
