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
            if self.trainer.global_step == 3 and self.global_rank == 1:
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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["local", "torchrun"])
def test_a_stopped_rank_is_ended_by_its_peer_and_left_behind_by_nobody(tmp_path, launcher):
    pid_file = tmp_path / "rank1.pid"
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), pid_file=str(pid_file)))
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
