"""``python3 bench/conformance.py examples UPSTREAM WORK``: Lightning's examples/pytorch/basics
scripts, run unchanged under Lightning (ddp) and, ported by the README's rename
(``tests/lightning_examples``), under zerotrain's ddp, zero2 and zero3 on 2 ranks; the first
``EXAMPLE_STEPS`` steps' losses, the trained weights and the test metrics are compared
(WORK/examples.json, bench/CONFORMANCE.md). Each rank runs this file under torchrun
(``_example``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests", "lightning_examples"), os.path.join(ROOT, "tests")]  # its tolerance
from test_lightning_examples import port  # noqa: E402  (the README's rule, one definition)


#: examples/pytorch/basics: what each needs here besides the Trainer. Only a download is replaced
#: (by random data of the same shape, written where the download would have put it) and
#: torchvision by our stand-in (conformance_torchvision.py: no torchvision wheel imports with this
#: torch), the same for both libraries; the scripts run unchanged.
EXAMPLES = {
    "transformer.py": "WikiText2 download: data/wikitext-2.txt, seeded random words of its size",
    "autoencoder.py": "stand-in torchvision (MNIST, ToTensor, make_grid, save_image)",
    "backbone_image_classifier.py": "stand-in torchvision (MNIST, ToTensor)",
    "profiler_example.py": "stand-in torchvision (CIFAR10, Resize/CenterCrop/ToTensor, resnet18 'DEFAULT' weights from a fixed seed)",
}
#: what the harness sets on every Trainer the script builds (both libraries): the processes, the
#: strategy and a short run (the scripts train 10-20 epochs; the first EXAMPLE_STEPS steps compare)
EXAMPLE_STEPS = 20
#: Lightning's run once more with the total gradient norm taken in another valid fp32 order (the
#: square root of the sum of per-tensor sums of squares, where torch takes the norm of per-tensor
#: norms): what an equally valid clip does to the example, shown beside the rows. Every strategy
#: must be within 1e-5 (ZeRO takes torch's order too since 3306478, ``strategies/zero/comm/grad_norm.py``).
PEER_CLIP = """
import torch as _torch
def _clip_other_order(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    ps = [p for p in ([parameters] if isinstance(parameters, _torch.Tensor) else parameters) if p.grad is not None]
    total = _torch.stack([p.grad.float().pow(2).sum() for p in ps]).sum().sqrt()
    coef = _torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in ps:
        p.grad.mul_(coef)
    return total
_torch.nn.utils.clip_grad_norm_ = _clip_other_order
"""


def _wikitext(path: str, tokens: int = 2_088_628, vocab: int = 33_278) -> None:
    """A stand-in for WikiText2's train.txt (the demo downloads it): seeded random words, about
    its size in tokens and vocabulary, in lines of ~57 words as the original."""
    import random
    rng = random.Random(0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        left = tokens
        while left > 0:
            n = min(left, rng.randint(40, 74))
            f.write(" " + " ".join(f"w{rng.randrange(vocab)}" for _ in range(n)) + " \n")
            left -= n + 1


def examples(upstream: str, work: str, strategies: list[str], reuse: bool = False,
             scripts: list[str] | None = None) -> dict:
    src = os.path.join(upstream, "examples", "pytorch", "basics")
    base = os.path.join(work, "examples")
    data = os.path.join(base, "data", "wikitext-2.txt")
    if not os.path.exists(data):
        _wikitext(data)
    from conformance_torchvision import write as write_torchvision  # bench/ is on sys.path here
    standin = write_torchvision(os.path.join(base, "_standin"))
    table = {}
    for script in scripts or EXAMPLES:
        with open(os.path.join(src, script)) as f:
            text = f.read()
        runs = {}
        clips = "gradient_clip_val" in text
        peer = [("lightning", "ddp-peer")] if clips else []
        for lib, strategy in [("lightning", "ddp")] + peer + [("zerotrain", s) for s in strategies]:
            out = os.path.join(base, f"{script[:-3]}-{lib}-{strategy}")
            if lib == "lightning" and reuse and os.path.exists(os.path.join(out, "rank1.json")):
                runs[(lib, strategy)] = {"rc": 0, "error": None, "records": [
                    json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]}
                continue
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            os.symlink(os.path.dirname(data), os.path.join(out, "data"))
            copy = os.path.join(out, script)
            with open(copy, "w") as f:
                f.write(port(text) if lib == "zerotrain" else PEER_CLIP + text if strategy == "ddp-peer" else text)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   os.path.abspath(__file__), "_example", lib, copy, strategy.removesuffix("-peer"), work]
            start = time.time()
            proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                                       "PYTHONPATH": os.pathsep.join([standin, os.environ.get("PYTHONPATH", "")])})
            with open(os.path.join(out, "log.txt"), "w") as f:
                f.write(proc.stdout + proc.stderr)
            recs = []
            for r in range(2):
                f = os.path.join(out, f"rank{r}.json")
                recs.append(json.load(open(f)) if os.path.exists(f) else None)
            runs[(lib, strategy)] = {"rc": proc.returncode, "records": recs, "s": time.time() - start,
                                     "error": None if proc.returncode == 0 else _last_error(proc.stderr + proc.stdout)}
            print(f"{script} {lib} {strategy}: rc {proc.returncode} ({time.time() - start:.0f} s)", flush=True)
        ref = runs[("lightning", "ddp")]
        row = {"lightning": "ok" if ref["rc"] == 0 else ref["error"], "data": EXAMPLES[script]}
        if clips:
            row["peer"] = _compare(ref, runs[("lightning", "ddp-peer")])
        for s_ in strategies:
            mine = runs[("zerotrain", s_)]
            row[s_] = _compare(ref, mine)
        table[script] = row
    path = os.path.join(work, "examples.json")
    if scripts and os.path.exists(path):  # the other scripts' rows stay
        with open(path) as f:
            table = {**json.load(f), **table}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    return table


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b", ln.strip())
             and "torch.distributed.elastic" not in ln]
    return lines[-1][:300] if lines else text.strip().splitlines()[-1][:300] if text.strip() else "?"


def _compare(ref: dict, mine: dict) -> dict:
    if ref["rc"] or mine["rc"] or None in ref["records"] or None in mine["records"]:
        return {"ok": False, "error": mine["error"] or ref["error"] or "no record"}
    dloss = max(abs(a - b) for r in range(2) for a, b in
                zip(ref["records"][r]["losses"], mine["records"][r]["losses"], strict=True))
    p, q = ref["records"][0]["params"], mine["records"][0]["params"]
    if set(p) != set(q):
        return {"ok": False, "error": f"parameter names differ: {sorted(set(p) ^ set(q))[:4]}"}
    dw = max(max((abs(a - b) for a, b in zip(p[k], q[k], strict=True)), default=0.0) for k in p)
    dtest = max((abs(v - mine["records"][0]["test"].get(k, float("inf"))) for k, v in ref["records"][0]["test"].items()),
                default=0.0)
    first = {k: [ref["records"][r].get(k) == mine["records"][r].get(k) for r in range(2)]
             for k in ("initial_param_sum", "batch_sums", "rng")}
    return {"ok": max(dloss, dw, dtest) <= 1e-5, "steps": len(ref["records"][0]["losses"]), "same": first,
            "max_dloss": dloss, "max_dweight": dw, "max_dtest": dtest}


def _example_rank(lib: str, script: str, strategy: str, work: str) -> None:
    """One rank of an example (under torchrun): the script runs as __main__, unchanged; every
    Trainer it builds gets the processes, the strategy, the short run and a recording callback."""
    import functools
    import runpy

    import torch
    torch.set_num_threads(1)
    rec = {"losses": [], "params": {}, "test": {}}
    if lib == "zerotrain":  # zerotrain's own demos, cli, ...: nothing of upstream's
        import zerotrain as L
        Trainer = L.Trainer
    else:
        import lightning.pytorch as L
        Trainer = L.Trainer

    class Record(L.Callback):
        def on_fit_start(self, trainer, pl_module):  # to tell a different start from a different step
            rec["initial_param_sum"] = float(sum(p.detach().double().sum() for p in pl_module.parameters()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.setdefault("batch_sums", []).append(float(sum(t.double().sum() for t in batch)))
            rec.setdefault("rng", []).append(float(torch.rand(1, generator=torch.Generator().set_state(
                torch.get_rng_state()))))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            rec["losses"].append(float(loss))

        def on_fit_end(self, trainer, pl_module):
            state = trainer.full_state_dict() if lib == "zerotrain" else pl_module.state_dict()
            rec["params"] = {k: v.detach().double().flatten().tolist() for k, v in state.items()}

        def on_test_end(self, trainer, pl_module):
            rec["test"] = {k: float(v) for k, v in trainer.callback_metrics.items()}

    init = Trainer.__init__

    @functools.wraps(init)
    def patched(self, *args, **kwargs):
        callbacks = kwargs.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        kwargs.update(accelerator="cpu", devices=2, strategy=strategy, max_steps=EXAMPLE_STEPS,
                      limit_val_batches=2, limit_test_batches=2, enable_progress_bar=False,
                      callbacks=callbacks + [Record()])
        init(self, *args, **kwargs)

    Trainer.__init__ = patched
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    rank = int(os.environ.get("RANK", "0"))
    with open(f"rank{rank}.json", "w") as f:
        json.dump(rec, f)
    if lib == "lightning":  # see tests/lightning_examples/driver.py: Lightning's gloo teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "_example":  # one rank, from examples()
    _example_rank(*sys.argv[2:6])
