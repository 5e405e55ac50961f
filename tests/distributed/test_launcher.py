"""The Trainer's own launcher: a script asking for devices=2 re-runs itself as rank 1; a rank
that raises ends the whole job quickly with its traceback and a non-zero exit."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent('''
    import os, sys
    sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # tests/distributed and tests/ (tolerance)
    import torch
    from toy import ToyModule
    from zerotrain import Trainer

    class Failing(ToyModule):
        def training_step(self, batch, batch_idx):
            if self.global_rank == {bad_rank} and self.trainer.global_step == 3:
                raise RuntimeError("boom on rank {bad_rank}")
            return super().training_step(batch, batch_idx)

    trainer = Trainer(strategy="ddp", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False)
    trainer.fit(Failing())
    print(f"rank {{trainer.global_rank}} after fit: step {{trainer.global_step}} world {{trainer.world_size}}", flush=True)
''')


def _run(tmp_path, bad_rank):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(__file__), bad_rank=bad_rank))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ZEROTRAIN_LAUNCHED")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=90)
    return proc, time.monotonic() - t0


def test_launcher_reruns_script_and_code_after_fit_runs_on_every_rank(tmp_path):
    proc, _ = _run(tmp_path, bad_rank=-1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 after fit: step 6 world 2" in proc.stdout
    assert "rank 1 after fit: step 6 world 2" in proc.stdout


def test_raising_child_rank_ends_job_fast_with_traceback(tmp_path):
    proc, elapsed = _run(tmp_path, bad_rank=1)
    assert proc.returncode != 0
    assert "RuntimeError: boom on rank 1" in proc.stderr
    assert elapsed < 30


@pytest.mark.slow
def test_raising_rank_zero_ends_job_fast_with_traceback(tmp_path):
    proc, elapsed = _run(tmp_path, bad_rank=0)
    assert proc.returncode != 0
    assert "RuntimeError: boom on rank 0" in proc.stderr
    assert elapsed < 30
