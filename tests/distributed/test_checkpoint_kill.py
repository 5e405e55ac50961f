"""Killed processes: ``kill -9`` of a rank in the middle of a save leaves ``latest`` complete and
loadable; ``kill -9`` of a rank mid-training under restarts (the Trainer's ``max_restarts`` and
``torchrun --max-restarts``) ends with the parameters of a run never interrupted.

This file is also the training script those jobs run: ``python test_checkpoint_kill.py ROOT KILL``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import RankFailed, run_ranks  # noqa: E402
from toy import ToyModule, assert_params_close, reference  # noqa: E402
from zerotrain import Callback, ModelCheckpoint, Trainer  # noqa: E402

STEPS, EVERY, KILL_AT = 12, 4, 6


class KillRank1(Callback):
    """``kill -9`` of rank 1 after step ``KILL_AT``, on the job's first start only."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and trainer.global_rank == 1 and trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


class FirstStep(Callback):
    def on_fit_start(self, trainer, module) -> None:
        module.first_step = trainer.global_step


def _train(root: str, kill: bool, max_restarts: int = 0, timeout_s: float = 20.0, hang_check: bool = False) -> dict:
    module = ToyModule(n=96)
    cbs = [ModelCheckpoint(dirpath=os.path.join(root, "ck"),
                           filename="{step:06d}", save_top_k=-1, every_n_train_steps=EVERY, save_last=False),
           FirstStep()] + ([KillRank1()] if kill else [])
    trainer = Trainer(strategy="zero2", devices=2, max_steps=STEPS, callbacks=cbs, logger=False,
                      enable_progress_bar=False, max_restarts=max_restarts, collective_timeout_s=timeout_s)
    trainer.fit(module)
    full = trainer.full_state_dict()
    out = {"params": full, "first_step": module.first_step,
           "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
    if trainer.is_global_zero:
        torch.save(out, os.path.join(root, "result.pt"))
    if hang_check:  # a peer that hangs (alive, never joins) is detected after the lowered timeout
        import time

        import torch.distributed as dist

        if trainer.global_rank == 1:
            time.sleep(timeout_s + 5)
        else:
            start = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1))
            except RuntimeError:
                out["hang_detected_after_s"] = time.monotonic() - start
    return out


def _run_job(cmd: list[str], root, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "ZEROTRAIN"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(os.path.join(root, "job.log"), "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(root),
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.seek(0)
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read()[-8000:], "")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("uninterrupted")
    return run_ranks("test_checkpoint_kill:_train", 2, root, timeout=120, root=str(root), kill=False,
                     timeout_s=5.0, hang_check=True)[0]


def test_a_hung_peer_is_detected_after_the_lowered_timeout(uninterrupted):
    # collective_timeout_s=5 after the first step (set-up and saves keep the long one)
    assert 4.0 <= uninterrupted["hang_detected_after_s"] <= 15.0


def _check_restarted(root, uninterrupted: dict, job: subprocess.CompletedProcess) -> None:
    assert job.returncode == 0, job.stdout
    got = torch.load(root / "result.pt", weights_only=True)
    assert got["restart"] == 1 and got["first_step"] == 4, (got["restart"], got["first_step"])
    for k, v in uninterrupted["params"].items():
        assert torch.equal(got["params"][k], v), k  # re-did steps 5..12 exactly


@pytest.mark.slow
def test_trainer_max_restarts_resumes_from_latest_after_kill_9(tmp_path, uninterrupted):
    job = _run_job([sys.executable, os.path.abspath(__file__), str(tmp_path), "1", "1"], tmp_path)
    _check_restarted(tmp_path, uninterrupted, job)


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_from_latest_after_kill_9(tmp_path, uninterrupted):
    job = _run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "--max-restarts", "1", "--monitor-interval", "0.5", os.path.abspath(__file__),
                    str(tmp_path), "1", "0"], tmp_path)
    _check_restarted(tmp_path, uninterrupted, job)


def _kill_during_second_save(root: str) -> dict:
    """Rank 1 writes half of its shard of the step-8 checkpoint, then is killed with SIGKILL."""
    from zerotrain.trainer.checkpoint import directory as checkpoint_io

    write, calls = checkpoint_io._write_shard, []

    def dying(file, entries, rank):
        calls.append(file)
        digest = write(file, entries, rank)
        if len(calls) == 2 and rank == 1:
            os.truncate(file, digest.size // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return digest

    checkpoint_io._write_shard = dying
    _train(root, kill=False)
    return {}


def test_kill_9_of_a_rank_mid_save_leaves_latest_loadable(tmp_path):
    from zerotrain.trainer.checkpoint import directory as checkpoint_io

    with pytest.raises(RankFailed, match="exited with code"):
        run_ranks("test_checkpoint_kill:_kill_during_second_save", 2, tmp_path, timeout=120, root=str(tmp_path))
    ck = tmp_path / "ck"
    assert (ck / "step=000008.ckpt.partial").is_dir() and not (ck / "step=000008.ckpt").exists()
    root, meta = checkpoint_io.load_meta(ck / "latest")
    assert root == ck / "step=000004.ckpt" and meta["loop"]["global_step"] == 4
    checkpoint_io.verify(root, meta)
    # every tensor of it reads back: its weights are those of 4 uninterrupted steps
    from zerotrain.trainer.checkpoint.consolidate import consolidate
    from safetensors.torch import load_file

    got = load_file(consolidate(ck / "latest", tmp_path / "step4.safetensors"))
    # tolerance: no worse than torch DDP's order of the same sums (tolerance.PEER_FACTOR x its error + 4 ulps)
    assert_params_close({k.removeprefix("net."): v for k, v in got.items()},
                        *(reference(4, world_size=2, bs=8, n=96, as_ranks=k)["params"] for k in (0, 2)))


if __name__ == "__main__":
    _train(sys.argv[1], kill=sys.argv[2] == "1", max_restarts=int(sys.argv[3]))
