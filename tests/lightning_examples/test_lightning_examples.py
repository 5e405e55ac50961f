"""Lightning code ports by the rename alone. Each example here is one file written as Lightning's
demos are, importing ``pytorch_lightning``; ``port`` makes the zerotrain copy by the README's
rule only (the module path ``lightning``, ``lightning.pytorch`` or ``pytorch_lightning`` to
``zerotrain``, ``LightningModule`` to ``TrainModule``, ``LightningDataModule`` to ``DataModule``).
Both run under ``torchrun --nproc_per_node 2`` (``driver.py``): pytorch-lightning 2.6 once with
ddp, zerotrain once per strategy (ddp, zero2, zero3), and every number must be the same: the
metrics a callback sees after every training batch, the CSV rows, what validate/test return, the
final parameters. Exact, in fp32: the data order and the RNG streams are the same on both sides.

Adding an example: write ``<name>.py`` with a ``main(**trainer_kwargs)`` returning (trainer,
model, results) and add it to ``EXAMPLES``."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tolerance import peer_bound

HERE = os.path.dirname(os.path.abspath(__file__))
#: (example file, zerotrain strategies it runs under, the Lightning strategy of the reference run,
#: whether it clips gradients). Exact unless the example clips gradients under a sharded strategy: a
#: ZeRO stage takes the global norm from its partitions' sums of squares, which rounds differently
#: from torch's norm of per-tensor norms (ddp is exact there too); then no worse than a peer
#: (``_peer_rtol``).
#: A module that toggles optimizers leaves parameters without gradients in a backward: DDP needs
#: ``find_unused_parameters`` there, on both sides, under the same strategy name.
UNUSED = "ddp_find_unused_parameters_true"
#: the default run takes the GAN (two optimizers, manual optimization, log_dict) under zero3; the
#: rest are `slow` (the suite's time on 2 cores)
EXAMPLES = [
    pytest.param("boring.py", ("ddp", "zero3"), "ddp", False, id="boring", marks=pytest.mark.slow),
    pytest.param("manual.py", ("zero2",), "ddp", True, id="manual-optimization", marks=pytest.mark.slow),
    pytest.param("gan.py", ("zero3",), UNUSED, False, id="gan"),
    pytest.param("boring.py", ("zero2",), "ddp", False, id="boring-zero2", marks=pytest.mark.slow),
    pytest.param("manual.py", ("ddp", "zero3"), "ddp", True, id="manual-optimization-ddp-zero3",
                 marks=pytest.mark.slow),
    pytest.param("gan.py", (UNUSED, "zero2"), UNUSED, False, id="gan-ddp-zero2", marks=pytest.mark.slow),
]

#: the porting rule, as the README states it: (pattern, replacement), applied in order
RENAMES = [
    (r"\blightning\.pytorch\b", "zerotrain"),
    (r"\bpytorch_lightning\b", "zerotrain"),
    # the bare package (``import lightning as L``, ``from lightning import ...``, ``lightning.Trainer``);
    # only as a module path, so a word "lightning" in text or in ``lightning_logs`` stays
    (r"(?m)^(\s*import\s+)lightning\b", r"\1zerotrain"),
    (r"\blightning\b(?=\.\w|\s+import\b|\s+as\b)", "zerotrain"),
    (r"\bLightningDataModule\b", "DataModule"),
    (r"\bLightningModule\b", "TrainModule"),
]


def port(source: str) -> str:
    """The zerotrain version of a Lightning file: the rename, and nothing else."""
    for pattern, new in RENAMES:
        source = re.sub(pattern, new, source)
    return source


def _run(example: str, lib: str, strategy: str, out: str, nudge_seed: int | None = None) -> list[dict]:
    """One side on 2 processes; returns each rank's record. ``nudge_seed``: the peer run, every
    parameter one ulp off after each optimizer step (driver.py)."""
    os.makedirs(out, exist_ok=True)
    scale = float(os.environ.get("ZEROTRAIN_TEST_TIMEOUT_SCALE", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "driver.py"), example, lib, strategy, out]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}  # tests/: tolerance
    if nudge_seed is not None:
        env["ZEROTRAIN_TEST_NUDGE_SEED"] = str(nudge_seed)
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=240 * scale)
    assert proc.returncode == 0, f"{lib} {strategy} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    records = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as f:
            records.append(json.load(f))
    return records


def _same(mine, ref, rtol: float) -> bool:
    """Equal; numbers within ``rtol`` relative + ``rtol/10`` absolute when ``rtol`` > 0. CSV
    cells are text: compared as numbers where both parse."""
    if isinstance(ref, dict):
        return isinstance(mine, dict) and mine.keys() == ref.keys() and all(_same(mine[k], ref[k], rtol) for k in ref)
    if isinstance(ref, list):
        return isinstance(mine, list) and len(mine) == len(ref) and all(_same(a, b, rtol) for a, b in zip(mine, ref))
    if rtol and isinstance(ref, str) and isinstance(mine, str):
        try:
            return _same(float(mine), float(ref), rtol)
        except ValueError:
            return mine == ref
    if rtol and isinstance(ref, float) and isinstance(mine, (int, float)):
        return abs(mine - ref) <= rtol * abs(ref) + rtol / 10
    return mine == ref


def _max_rel(mine, ref) -> float:
    """The largest relative difference of the numbers (CSV cells too) in ``mine`` from ``ref``'s."""
    if isinstance(ref, dict):
        return max((_max_rel(mine[k], ref[k]) for k in ref), default=0.0)
    if isinstance(ref, list):
        return max((_max_rel(a, b) for a, b in zip(mine, ref)), default=0.0)
    try:
        a, b = float(mine), float(ref)
    except (TypeError, ValueError):
        return 0.0
    return abs(a - b) / abs(b) if b else abs(a)


def _peer_rtol(theirs: list[dict], peer: list[dict]) -> float:
    """tolerance.peer_bound of the peer's largest relative difference from Lightning's run."""
    return peer_bound(max(_max_rel({k: p[k] for k in NUMBERS if k in t}, {k: t[k] for k in NUMBERS if k in t})
                          for p, t in zip(peer, theirs)))  # the CSV rows: rank 0's only


#: what ``_compare`` compares as numbers (besides global_step)
NUMBERS = ("batches", "results", "callback", "logged", "rows", "params")


def _compare(ours: list[dict], theirs: list[dict], label: str, rtol: float = 0.0) -> None:
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        for key in ("global_step", "batches", "results", "callback", "logged"):
            assert _same(mine[key], ref[key], rtol), f"{label} rank {rank}: {key} differs"
    assert _same(ours[0]["rows"], theirs[0]["rows"], rtol), f"{label}: the CSV rows differ"
    assert ours[0]["params"].keys() == theirs[0]["params"].keys(), label
    for name, values in theirs[0]["params"].items():
        worst = max((abs(a - b) / (abs(b) + 1e-12) for a, b in zip(ours[0]["params"][name], values)), default=0.0)
        assert _same(ours[0]["params"][name], values, rtol), f"{label}: final {name} differs (worst rel. {worst:.2e})"


def test_port_renames_only_the_module_path_and_classes():
    src = ("import pytorch_lightning as pl\nfrom lightning.pytorch import LightningModule, LightningDataModule\n"
           "class M(LightningModule): pass  # a LightningModuleX stays\n")
    assert port(src) == ("import zerotrain as pl\nfrom zerotrain import TrainModule, DataModule\n"
                         "class M(TrainModule): pass  # a LightningModuleX stays\n")


#: each way Lightning code imports it: (the import lines, how the code then names the package)
IMPORT_FORMS = [
    ("import lightning as L", "L."),
    ("import lightning\nimport lightning.pytorch", "lightning.pytorch."),
    ("import lightning", "lightning."),
    ("import lightning.pytorch as pl", "pl."),
    ("import pytorch_lightning as pl", "pl."),
    ("from lightning import LightningModule, LightningDataModule, Trainer, Callback, seed_everything", ""),
    ("from lightning.pytorch import LightningModule, LightningDataModule, Trainer, Callback, seed_everything", ""),
    ("from pytorch_lightning import LightningModule, LightningDataModule, Trainer, Callback, seed_everything", ""),
]


@pytest.mark.parametrize("imports, prefix", IMPORT_FORMS, ids=[f[0].split("\n")[-1] for f in IMPORT_FORMS])
def test_every_import_form_ports_and_runs_under_zerotrain(imports, prefix):
    """The rule on each import form, the submodules' paths too: the ported text names no
    Lightning module and executes against zerotrain alone (no ``lightning`` package needed)."""
    import zerotrain
    from zerotrain.callbacks import ModelCheckpoint

    p = prefix
    source = (f"{imports}\n"
              "from lightning.pytorch.callbacks import ModelCheckpoint\n"
              "from lightning.pytorch.loggers import CSVLogger\n"
              "from lightning.pytorch.utilities import rank_zero_only\n"
              f"class Model({p}LightningModule):\n    pass\n"
              f"class Data({p}LightningDataModule):\n    pass\n"
              f"class Hook({p}Callback):\n    pass\n"
              f"TRAINER, SEED = {p}Trainer, {p}seed_everything\n"
              "LOGS = 'lightning_logs'  # a lightning word in text stays\n")
    ported = port(source)
    code, text = ported.split("LOGS = ")
    assert not re.search(r"\b(lightning|pytorch_lightning)\b", code), ported
    assert text == "'lightning_logs'  # a lightning word in text stays\n"
    namespace: dict = {}
    exec(compile(ported, "<ported>", "exec"), namespace)
    assert issubclass(namespace["Model"], zerotrain.TrainModule)
    assert issubclass(namespace["Data"], zerotrain.DataModule)
    assert issubclass(namespace["Hook"], zerotrain.Callback)
    assert namespace["TRAINER"] is zerotrain.Trainer and namespace["SEED"] is zerotrain.seed_everything
    assert namespace["ModelCheckpoint"] is ModelCheckpoint and namespace["LOGS"] == "lightning_logs"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example, strategies, reference, clips", EXAMPLES)
def test_example_gives_lightnings_numbers_under_every_strategy(example, strategies, reference, clips, tmp_path,
                                                              monkeypatch):
    # importing pytorch-lightning sets this variable: restore the environment after
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "1"))
    pytest.importorskip("pytorch_lightning")
    source = os.path.join(HERE, example)
    ported = tmp_path / ("zt_" + example)
    with open(source) as f:
        ported.write_text(port(f.read()))
    theirs = _run(source, "pl", reference, str(tmp_path / "pl"))
    assert theirs[0]["batches"] and theirs[0]["rows"], "the Lightning run recorded nothing"
    sharded_rtol = _peer_rtol(theirs, _run(source, "pl", reference, str(tmp_path / "peer"), nudge_seed=0)) \
        if clips and any(s.startswith("zero") for s in strategies) else 0.0
    for strategy in strategies:
        ours = _run(str(ported), "zerotrain", strategy, str(tmp_path / strategy))
        # tolerance: exact, or (a clipping example, sharded) no worse than Lightning with every step one ulp off (PEER_FACTOR x + 4 ulps)
        _compare(ours, theirs, f"{example} under zerotrain {strategy}",
                 sharded_rtol if strategy.startswith("zero") else 0.0)
