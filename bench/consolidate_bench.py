"""Peak memory of checkpoint consolidation on the 118M-parameter demo GPT.

    python -m zerotrain.bench.consolidate_bench [--workdir DIR] [--vocab-size 16384] [--formats ...]

1. ``save`` (2 processes, the Trainer's own launcher): ``GPTModule`` with
   ``GPTConfig(block_size=256, n_layer=8, n_head=16, n_embd=1024, vocab_size=V)`` (V=16384, the
   byte data's ids fit: 117.7M parameters, as ``bench/common.py``'s gpt_118m; V=256 gives 101M),
   trained one step by ``zero2`` on 2 ranks and checkpointed (fp32 masters and both Adam moments:
   1.41 GB in two shard files).
2. ``measure`` (one fresh process per output format): import torch and zerotrain, record the
   resident set (the baseline), reset the kernel's peak counter (``/proc/self/clear_refs``),
   consolidate (checksums verified), and report the peak resident set above the baseline against
   the target: 2 x the largest parameter + 200 MB.
3. The outputs are checked by loading them into the unwrapped GPTModule with ``strict=True``.

Consolidation is I/O- and memory-bound, so a busy machine changes its time, not its memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _config(vocab_size: int):
    from zerotrain.examples.gpt import GPTConfig

    return GPTConfig(block_size=256, n_layer=8, n_head=16, n_embd=1024, vocab_size=vocab_size)


def save(workdir: str, vocab_size: int) -> None:
    """Runs on both ranks (the launcher re-runs this command line for rank 1)."""
    from zerotrain import ModelCheckpoint, Trainer
    from zerotrain.examples.gpt_module import GPTModule

    module = GPTModule(_config(vocab_size), batch_size=1, max_steps=1, warmup_steps=0, val_fraction=0.0,
                       max_bytes=200_000)
    trainer = Trainer(strategy="zero2", devices=2, max_steps=1, logger=False, enable_progress_bar=False,
                      callbacks=[ModelCheckpoint(dirpath=os.path.join(workdir, "ck"),
                                                 filename="{step:06d}", save_top_k=-1, every_n_train_steps=1)])
    trainer.fit(module)


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(ckpt: str, out: str, bf16: bool) -> dict:
    """In a fresh process: peak resident set of one consolidation above the torch baseline."""
    import math

    import torch  # noqa: F401 - the baseline includes the interpreter and torch

    from zerotrain.trainer.checkpoint import directory as checkpoint_io
    from zerotrain.trainer.checkpoint.consolidate import consolidate

    _, meta = checkpoint_io.load_meta(ckpt)
    largest = max(math.prod(p["shape"]) for p in meta["params"].values()) * 4
    base = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    start = time.perf_counter()
    consolidate(ckpt, out, bf16=bf16)
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM")
    above = (peak - base) * 1024
    target = 2 * largest + 200 * 2**20
    return {"output": os.path.basename(out), "bf16": bf16, "seconds": round(seconds, 1),
            "baseline_mib": round(base / 1024, 1), "peak_above_baseline_mib": round(above / 2**20, 1),
            "largest_param_mib": round(largest / 2**20, 1), "target_mib": round(target / 2**20, 1),
            "within_target": above < target, "output_mib": round(os.path.getsize(out) / 2**20, 1)}


def _check(out: str, vocab_size: int) -> None:
    import torch

    from zerotrain.examples.gpt_module import GPTModule

    module = GPTModule(_config(vocab_size))
    with torch.device("meta"):
        module.configure_model()
    if out.endswith(".safetensors"):
        from safetensors.torch import load_file
        sd = load_file(out)
    else:
        sd = torch.load(out, weights_only=True, mmap=True)
    module.load_state_dict(sd, strict=True, assign=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("phase", nargs="?", default="all", choices=["all", "save", "measure"])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--formats", default="safetensors,pt,bf16.safetensors")
    parser.add_argument("--out", default=None, help="measure: the output file")
    args = parser.parse_args(argv)
    if args.phase == "save":
        save(args.workdir, args.vocab_size)
        return 0
    if args.phase == "measure":
        print(json.dumps(measure(os.path.join(args.workdir, "ck"), args.out, ".bf16." in args.out)))
        return 0
    workdir = args.workdir or tempfile.mkdtemp(prefix="zt-consolidate-")
    me = [sys.executable, "-m", "zerotrain.bench.consolidate_bench"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(me + ["save", "--workdir", workdir, "--vocab-size", str(args.vocab_size)], check=True, env=env)
    print(f"saved with zero2 on 2 ranks in {time.perf_counter() - start:.0f} s: {workdir}/ck", flush=True)
    rows = []
    for fmt in args.formats.split(","):
        out = os.path.join(workdir, f"model.{fmt}")
        res = subprocess.run(me + ["measure", "--workdir", workdir, "--out", out], check=True, env=env,
                             capture_output=True, text=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        _check(out, args.vocab_size)
        rows[-1]["loads_strict"] = True
        print(json.dumps(rows[-1]), flush=True)
    print("\n| output | peak above baseline | target (2 x largest + 200 MB) | time | size |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['output']} | {r['peak_above_baseline_mib']} MiB | {r['target_mib']} MiB "
              f"({'ok' if r['within_target'] else 'OVER'}) | {r['seconds']} s | {r['output_mib']} MiB |")
    return 0 if all(r["within_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
