"""Fault-injection campaign: many short jobs of 2-3 processes, one fault each, and four checks.

    python -m zerotrain.bench.fault_campaign --jobs 64 --seed 0 --workdir /tmp/faults \\
        --out faults.json --markdown faults.md

Each job (``bench/fault_job.py``, a tiny MLP, 8 steps, a checkpoint after every step) draws a
strategy (ddp, zero1, zero2, zero3, offload to CPU, offload to NVMe, pipeline), a world size (2 or
3), a launcher (ours: ``Trainer(devices=N)``; or torchrun), a fault, the rank it hits and the step
(the moment). The faults:

=====================  =======================================================================
``sigkill``            ``kill -9`` of one rank, sent by this driver once the rank began step k
``sigstop``            ``SIGSTOP`` of one rank (it stays stopped: the others must notice)
``exception_step``     an exception in ``training_step`` on one rank (the stage's forward
                       under the pipeline, which runs no ``training_step``)
``exception_callback`` an exception in a callback's ``on_train_batch_end`` on one rank
``rank0_forward``      a forward on rank 0 alone (zero3's trap; harmless elsewhere)
``enospc``             ENOSPC while one rank writes its shard of the checkpoint of step k (under ddp,
                       whose checkpoint is one file, while rank 0 writes it)
``truncate``/``flip``  the newest checkpoint (step k) loses half of one file / gets one byte
                       flipped, after a run that stopped there
``sigterm``            SIGTERM to the job's whole process group
``nan``                a NaN loss on one rank (the last stage under the pipeline)
=====================  =======================================================================

The checks, per job:

- **ended**: seconds from the fault to the end of the job's main process (for the corruption faults,
  to the end of the resume that must refuse the corrupt checkpoint); the bar is 30 s.
- **named**: the output names the right rank (or, for the corruption faults, the right file), and
  **cause**: the right cause (the signal, the exception, the disk, the checksum, the loss).
  A job whose fault is harmless by design (a rank-0-only forward outside ZeRO-3) must finish.
- **orphans**: processes carrying the job's marker variable still alive 1 s after it ended.
- **exact**: a resume from ``latest`` (after a corruption: from the checkpoint before it, once the
  loader refused ``latest``) without the fault, to step 8, ends with the parameters of a run of the
  same strategy and world size that never failed, ``torch.equal`` for every tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STEPS = 8
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "offload_cpu", "offload_nvme", "pipeline")
FAULTS = ("sigkill", "sigstop", "exception_step", "exception_callback", "rank0_forward", "enospc",
          "truncate", "flip", "sigterm", "nan")
LAUNCHERS = ("ours", "torchrun")
#: the bar: a fault ends the job within this many seconds
END_WITHIN_S = 30.0
#: a job still running this long after its fault is killed (and counts as a hang)
HARD_CAP_S = 90.0
MARK = "ZT_FAULT_CAMPAIGN"
#: under zero3 (and offload with parameters on disk: stage 3) a rank-0-only forward waits forever
GATHERS_IN_FORWARD = ("zero3", "offload_nvme")


#: strategies whose checkpoint is one ``.ckpt`` file written by rank 0 (every other rank's shard is empty)
ONE_FILE = ("ddp",)


def draw(jobs: int, seed: int) -> list[dict]:
    """The jobs: every fault and every strategy as evenly as the count allows, in a seeded order;
    the rest at random."""
    rng = random.Random(seed)
    faults, strategies = [], []
    while len(faults) < jobs:
        faults += rng.sample(FAULTS, len(FAULTS))
    while len(strategies) < jobs:
        strategies += rng.sample(STRATEGIES, len(STRATEGIES))
    out = []
    for i in range(jobs):
        fault, strategy, world = faults[i], strategies[i], rng.choice((2, 3))
        rank = rng.randrange(world)
        if fault == "rank0_forward":
            rank = 0
        if fault == "nan" and strategy == "pipeline":
            rank = world - 1  # only the last stage computes the loss
        if fault == "enospc" and strategy in ONE_FILE:
            rank = 0  # replicated state is saved as one file, which rank 0 writes
        out.append({"id": i, "strategy": strategy, "world": world, "launcher": rng.choice(LAUNCHERS),
                    "fault": fault, "rank": rank, "step": rng.randint(2, STEPS - 3),
                    "delay_s": round(rng.uniform(0.0, 0.3), 3)})
    return out


# ---------------------------------------------------------------------------- running a job

def _env(tag: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ZEROTRAIN_LAUNCHED", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({MARK: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _command(launcher: str, world: int, cfg_file: Path) -> list[str]:
    job = ["-m", "zerotrain.bench.fault_job", str(cfg_file)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                "--monitor-interval", "0.5", *job]
    return [sys.executable, *job]


class Run:
    """One launch of the job script: its process, log and marker."""

    def __init__(self, root: Path, name: str, cfg: dict, launcher: str) -> None:
        self.root, self.tag = root, f"{root.name}-{name}-{time.monotonic_ns()}"
        cfg_file = root / f"{name}.json"
        cfg_file.write_text(json.dumps(cfg))
        self.log_path = root / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(_command(launcher, cfg["world"], cfg_file), env=_env(self.tag), cwd=root,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ended_at: float | None = None

    def wait(self, deadline: float) -> bool:
        """Until the main process ends or ``deadline`` (time.time()); False on the deadline."""
        while self.proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        if self.proc.poll() is None:
            return False
        self.ended_at = time.time()
        return True

    def text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def leftovers(self) -> list[int]:
        """Processes carrying this run's marker that are alive (not zombies)."""
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if f"{MARK}={self.tag}".encode() not in (d / "environ").read_bytes().split(b"\0"):
                    continue
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(int(d.name))
        return found

    def kill_all(self) -> None:
        """Everything this run started (its process group, then any marked process left)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()


def _cfg(job: dict, root: Path, stall_timeout_s: float, **kw) -> dict:
    cfg = {"strategy": job["strategy"], "world": job["world"], "steps": STEPS, "root": str(root), "resume": None,
           "out": str(root / "final.pt"), "stall_timeout_s": stall_timeout_s, "fault": None}
    cfg.update(kw)
    return cfg


def _finish(run: Run, timeout_s: float) -> tuple[int | None, str]:
    ok = run.wait(time.time() + timeout_s)
    text = run.text()
    run.kill_all()
    return (run.proc.returncode if ok else None), text


_ref_lock = threading.Lock()


def reference(job: dict, workdir: Path, stall_timeout_s: float, cache: dict) -> Path | None:
    """The final parameters of a run of the job's strategy and world size that never failed (our
    launcher), once per configuration."""
    key = (job["strategy"], job["world"])
    with _ref_lock:
        lock = cache.setdefault(("lock", key), threading.Lock())
    with lock:
        return _reference(job, workdir, stall_timeout_s, cache, key)


def _reference(job: dict, workdir: Path, stall_timeout_s: float, cache: dict, key: tuple) -> Path | None:
    if key not in cache:
        root = workdir / f"ref-{job['strategy']}-w{job['world']}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        code, text = _finish(Run(root, "ref", _cfg(job, root, stall_timeout_s), "ours"), 300)
        cache[key] = root / "final.pt" if code == 0 else None
        if code != 0:
            print(f"reference {key} failed (exit {code}):\n{text[-3000:]}", file=sys.stderr)
    return cache[key]


def _wait_for(path: Path, run: Run, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while not path.exists():
        if run.proc.poll() is not None or time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


def _announced(text: str) -> float | None:
    m = re.search(r"^FAULT \S+ rank \d+ step \d+ at ([0-9.]+)", text, re.M)
    return float(m.group(1)) if m else None


def _checkpoint(ck: Path, step: int) -> Path:
    """Step ``step``'s checkpoint in ``ck``: a folder (sharded state) or one ``.ckpt`` file."""
    found = [p for p in ck.iterdir() if p.name in (f"step={step:06d}", f"step={step:06d}.ckpt")]
    if len(found) != 1:
        raise FileNotFoundError(f"no single checkpoint of step {step} in {ck}: {sorted(p.name for p in ck.iterdir())}")
    return found[0]


def _corrupt(ck: Path, job: dict, rng: random.Random) -> Path:
    """Truncate or flip one byte of one file of the newest checkpoint; returns the file."""
    newest = _checkpoint(ck, job["step"])
    files = [newest] if newest.is_file() else sorted(p for p in newest.iterdir() if p.suffix in (".safetensors", ".pt"))
    target = rng.choice(files)
    size = target.stat().st_size
    if job["fault"] == "truncate":
        os.truncate(target, size // 2)
    else:
        with open(target, "r+b") as f:
            at = rng.randrange(size)
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x5A]))
    return target


def run_job(job: dict, workdir: Path, stall_timeout_s: float, refs: dict) -> dict:
    root = workdir / f"job{job['id']:03d}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    fault, launcher = job["fault"], job["launcher"]
    row = dict(job, ended_s=None, rc=None, named=False, cause=False, orphans=[], exact=False, note="")
    fault_at = None
    if fault in ("truncate", "flip"):
        first = Run(root, "run", _cfg(job, root, stall_timeout_s, steps=job["step"]), launcher)
        code, text = _finish(first, 300)
        if code != 0:
            row["note"] = f"the run to step {job['step']} failed (exit {code})"
            return row
        target = _corrupt(root / "ck", job, random.Random(job["id"]))
        row["target"] = str(target.relative_to(root))
        fault_at = time.time()
        run = Run(root, "refuse", _cfg(job, root, stall_timeout_s, resume="latest"), launcher)
    else:
        spec = {"kind": fault, "rank": job["rank"], "step": job["step"]}
        pace = 0.25 if fault in ("sigkill", "sigstop", "sigterm") else 0.0
        run = Run(root, "run", _cfg(job, root, stall_timeout_s, fault=spec, pace_s=pace), launcher)
        if fault in ("sigkill", "sigstop", "sigterm"):
            r, k = job["rank"], job["step"]
            if _wait_for(root / f"at.{r}.{k}", run, 180) and _wait_for(root / f"pid.{r}", run, 5):
                time.sleep(job["delay_s"])
                fault_at = time.time()
                try:
                    if fault == "sigterm":
                        os.killpg(run.proc.pid, signal.SIGTERM)
                    else:
                        os.kill(int((root / f"pid.{r}").read_text()),
                                signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP)
                except ProcessLookupError:
                    fault_at = None
    ended = run.wait(time.time() + (HARD_CAP_S if fault_at else 300))
    if ended and fault_at is None:
        fault_at = _announced(run.text())
    time.sleep(1.0)  # what a job leaves behind is still there a second after it ended
    row["orphans"] = run.leftovers()
    text = run.text()
    run.kill_all()
    row["rc"] = run.proc.returncode if ended else None
    if fault_at is not None and ended:
        row["ended_s"] = round(run.ended_at - fault_at, 1)
    elif fault_at is None:
        row["note"] = "the fault was never injected"
    (root / "output.txt").write_text(text)
    row["signal_checkpoint"] = (root / "ck").is_dir() and any(p.name.startswith("sigterm-step=")
                                                                for p in (root / "ck").iterdir())
    row["named"], row["cause"] = judge(job, row, text)
    # the resume, without the fault
    resume = "latest"
    if fault in ("truncate", "flip"):
        resume = str(_checkpoint(root / "ck", job["step"] - 1))
    if (root / "final.pt").exists():
        os.unlink(root / "final.pt")
    code, rtext = _finish(Run(root, "resume", _cfg(job, root, stall_timeout_s, resume=resume), launcher), 300)
    ref = reference(job, workdir, stall_timeout_s, refs)
    if code != 0:
        row["note"] += f" resume failed (exit {code}): {rtext.strip().splitlines()[-1:]}"
    elif ref is None:
        row["note"] += " the reference run failed"
    else:
        row["exact"] = same_params(root / "final.pt", ref)
    return row


def same_params(a: Path, b: Path) -> bool:
    import torch

    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def judge(job: dict, row: dict, text: str) -> tuple[bool, bool]:
    """(the right rank or file named, the right cause named), from the job's output."""
    f, r, k, ours = job["fault"], job["rank"], job["step"], job["launcher"] == "ours"
    rc = row["rc"]
    if f == "sigkill":
        if ours and r == 0:  # the launching process itself: its own status says it
            return rc == -signal.SIGKILL, rc == -signal.SIGKILL
        if ours:
            said = f"rank {r} was killed by signal 9 (SIGKILL)"
            return said in text, said in text
        m = _torchrun_failure(text, r)
        return m is not None, m is not None and "SIGKILL" in m
    if f == "sigstop":
        if ours and r == 0:  # the launching process: a rank it started sees it stopped in /proc
            said = re.search(r"rank 0 \(pid \d+, the launching process.*\) has been stopped for", text)
            return bool(said), bool(said) and "killed it (SIGKILL)" in text
        return f"rank {r} made no progress" in text, "made no progress" in text
    if f in ("exception_step", "exception_callback"):
        where = "training_step" if f == "exception_step" else "on_train_batch_end"
        line = re.search(rf"^\[rank{r}\]: .*FaultInjected: FaultInjected in {where}", text, re.M)
        launcher_said = (f"rank {r} exited with code 1" in text) if ours and r > 0 else \
            (_torchrun_failure(text, r) is not None) if not ours else True
        return bool(line) and launcher_said, bool(line)
    if f == "rank0_forward":
        if job["strategy"] in GATHERS_IN_FORWARD:
            hint = "hint: under zero3 every forward gathers parameters collectively" in text
            return "rank 0 made no progress" in text, hint
        done = rc == 0 and all(f"rank {q} finished at step {STEPS}" in text for q in range(job["world"]))
        return done, done
    if f == "enospc":
        file = r"\.ckpt(\.tmp)?" if job["strategy"] in ONE_FILE else rf"rank_{r:05d}\.safetensors"
        said = re.search(rf"rank {r}: writing \S*{file}: No space left on device", text)
        return bool(said), "No space left on device" in text
    if f in ("truncate", "flip"):
        name = Path(row["target"]).name
        said = re.search(rf"CheckpointError: .*{re.escape(name)}", text)
        why = re.search(r"truncated or corrupt|is corrupt|CRC|cannot read checkpoint file", text)
        return bool(said), bool(said and why)
    if f == "sigterm":
        # every rank saved the signal's checkpoint; our launcher's job then exits with status 0,
        # torchrun's agent (which got the signal too) with its own SignalException, status 1
        saved = "SIGTERM: saving a checkpoint at step" in text and row.get("signal_checkpoint", False)
        clean = rc == 0 if ours else rc == 1 and "got signal: 15" in text
        return saved and clean, saved
    if f == "nan":
        said = f"rank {r}: the training loss is nan at step {k}" in text
        return said, said
    raise ValueError(f)


def _torchrun_failure(text: str, rank: int) -> str | None:
    """The block torchrun prints for a failed worker of global rank ``rank``, or None."""
    for block in re.split(r"\n(?=\[\d+\]:|Root Cause)", text):
        if re.search(rf"^\s*rank\s*:\s*{rank} \(local_rank", block, re.M) and "exitcode" in block:
            return block
    return None


# ---------------------------------------------------------------------------- report

def passed(row: dict) -> bool:
    return (row["ended_s"] is not None and row["ended_s"] <= END_WITHIN_S and row["named"] and row["cause"]
            and not row["orphans"] and row["exact"])


def markdown(rows: list[dict], args: argparse.Namespace, started: float, wall_s: float) -> str:
    ok = [r for r in rows if passed(r)]
    ended = [r["ended_s"] for r in rows if r["ended_s"] is not None]
    cpu = _lscpu()
    lines = [
        f"## Fault-injection campaign ({time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))} UTC, "
        f"{len(rows)} jobs, seed {args.seed})", "",
        "| faults | ended <= 30 s | rank/file named | cause named | jobs with orphans | resumes exact | every check |",
        "|---|---|---|---|---|---|---|",
        f"| {len(rows)} | {sum(1 for r in rows if r['ended_s'] is not None and r['ended_s'] <= END_WITHIN_S)} "
        f"| {sum(r['named'] for r in rows)} | {sum(r['cause'] for r in rows)} "
        f"| {sum(1 for r in rows if r['orphans'])} | {sum(r['exact'] for r in rows)} | {len(ok)} |", "",
        f"Fault to end of job: median {_median(ended):.1f} s, max {max(ended, default=float('nan')):.1f} s. "
        f"Campaign wall time {wall_s / 60:.1f} min. CPU: {cpu}; load average before the run "
        f"{args.load_before}; {platform.python_version()}, torch {_torch_version()}.", "",
        "```bash", f"python -m zerotrain.bench.fault_campaign {' '.join(args.argv)}", "```", "",
        "| id | strategy | launcher | world | fault | rank | step | ended (s) | named | cause | orphans | resume exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fault = r["fault"] + (f" ({Path(r['target']).name})" if r.get("target") else "")
        lines.append(f"| {r['id']} | {r['strategy']} | {r['launcher']} | {r['world']} | {fault} | {r['rank']} "
                     f"| {r['step']} | {r['ended_s'] if r['ended_s'] is not None else 'no end'} "
                     f"| {_yes(r['named'])} | {_yes(r['cause'])} | {len(r['orphans']) or 'none'} "
                     f"| {_yes(r['exact'])} |")
    bad = [r for r in rows if not passed(r)]
    lines += ["", "Exceptions: " + ("none." if not bad else "")]
    for r in bad:
        lines.append(f"- job {r['id']} ({r['strategy']}, {r['launcher']}, {r['fault']}): {r['note'] or 'see its row'}")
    return "\n".join(lines) + "\n"


def _yes(v: bool) -> str:
    return "yes" if v else "**no**"


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _lscpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
        return f"{model}, {os.cpu_count()} cores"
    except Exception:  # noqa: BLE001 - only for the report
        return platform.processor() or "unknown"


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated job ids to run (of the drawn list)")
    p.add_argument("--workdir", default="/tmp/zerotrain-faults")
    p.add_argument("--out", default="", help="the rows as JSON")
    p.add_argument("--markdown", default="", help="write the report section (summary and table) there")
    p.add_argument("--stall-timeout", type=float, default=5.0, help="Trainer(stall_timeout_s=...) of every job")
    p.add_argument("--parallel", type=int, default=2, help="jobs at once (each is 2-3 mostly idle processes)")
    p.add_argument("--keep", action="store_true", help="keep the jobs' folders")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs={args.jobs} must be >= 1")
    args.argv = argv if argv is not None else sys.argv[1:]
    args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = draw(args.jobs, args.seed)
    if args.only:
        wanted = {int(x) for x in args.only.split(",")}
        jobs = [j for j in jobs if j["id"] in wanted]
    started, refs = time.time(), {}

    def one(job: dict) -> dict:
        t = time.time()
        row = run_job(job, workdir, args.stall_timeout, refs)
        print(f"job {job['id']:3d} {job['strategy']:12s} {job['launcher']:8s} w{job['world']} {job['fault']:18s} "
              f"rank {job['rank']} step {job['step']}: ended {row['ended_s']} s named {row['named']} "
              f"cause {row['cause']} orphans {row['orphans']} exact {row['exact']} {row['note']} "
              f"({time.time() - t:.0f} s)", flush=True)
        if passed(row) and not args.keep:
            shutil.rmtree(workdir / f"job{job['id']:03d}", ignore_errors=True)
        return row

    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(one, jobs))
    wall = time.time() - started
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args, started, wall))
    failed = [r["id"] for r in rows if not passed(r)]
    print(f"{len(rows) - len(failed)}/{len(rows)} jobs met every check; failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
