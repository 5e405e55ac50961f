"""``optimizer_state_dtype="bf16"`` through the real Trainer on 2 gloo processes: the swap files
hold half the bytes for Adam's moments (file sizes measured while training), the loss over 20
steps tracks the fp32-state run (ZeRO-2 and ZeRO-3 with parameter files), and a checkpoint written
with one state dtype resumes under the other (checkpoints hold fp32 state). One spawn runs every
case."""
from __future__ import annotations

import os

import torch

from harness import run_ranks_once
from toy import ToyModule, build_net
from zerotrain import Callback, ModelCheckpoint, Trainer
from zerotrain.strategies.offload import Offload
from zerotrain.strategies.offload.aio import ALIGN, round_up
from zerotrain.strategies.zero.estimate import estimate_offload

STEPS = 20
#: bf16 moments against fp32 moments (lr 0.05), worst relative loss gap over 20 steps: 3.3e-3
#: (stage 2) and 3.5e-3 (stage 3) measured here, and 3.2e-3 / 2.5e-3 for stage 2 runs resumed
#: across dtypes; the bound is the issue's 1%
LOSS_RTOL = 1e-2
#: large enough that page padding of the file regions is small (the master, in fp32 compute, is the
#: working parameters or ZeRO-3's parameter file: the swap files hold the moments only)
SUB_GROUP = 8192
CASES = {"s2": {}, "s3": {"stage": 3, "param_device": "nvme"}}
#: (case, saved with, resumed with)
RESUMES = [("s2", "fp32", "bf16"), ("s2", "bf16", "fp32"), ("s2", "bf16", "bf16"), ("s3", "fp32", "bf16"),
           ("s3", "bf16", "bf16")]


class WideToy(ToyModule):
    """The toy with a 256-wide hidden layer (~70k parameters): sizes where file bytes mean bytes
    per parameter, not page padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = build_net(hidden=256)


class SwapFileBytes(Callback):
    """The bytes of the swap files on disk after each step (the sub-group files only)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        d = trainer.strategy.offload_report()["swap_dir"]
        self.sizes.append(sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".swp")))


def _fit(case: str, dtype: str, root: str, steps: int = STEPS, save: str | None = None,
         resume: str | None = None) -> dict:
    module, sizes = WideToy(), SwapFileBytes()
    strategy = Offload(optimizer_device="nvme", nvme_path=os.path.join(root, "nvme"), buffer_count=2,
                       sub_group_size=SUB_GROUP, optimizer_state_dtype=dtype, **CASES[case])
    cbs = [sizes] + ([ModelCheckpoint(dirpath=save,
                                      filename="{step:06d}", save_top_k=-1, every_n_train_steps=steps,
                                      save_last=False)] if save else [])
    trainer = Trainer(strategy=strategy, devices=2, precision="32", max_steps=steps, gradient_clip_val=0.5,
                      callbacks=cbs, logger=False, enable_checkpointing=bool(save), enable_progress_bar=False)
    trainer.fit(module, ckpt_path=resume)
    rep = trainer.strategy.offload_report()
    return {"losses": torch.tensor(module.losses), "sizes": sizes.sizes, "disk_bytes": rep["disk_bytes"],
            "kinds": rep["swapped_kinds"], "dtype": rep["optimizer_state_dtype"],
            "numels": [sg.numel for sg in trainer.strategy.sharded.subgroups]}


def _worker(root: str) -> dict:
    out = {}
    for case in CASES:
        for dtype in ("fp32", "bf16"):
            out[f"{case}-{dtype}"] = _fit(case, dtype, root)
    # 10 steps with one state dtype, saved, resumed for 10 more under the same or the other
    for case, src, dst in RESUMES:
        ck = os.path.join(root, f"ck-{case}-{src}-{dst}")
        _fit(case, src, root, steps=10, save=ck)
        out[f"{case}:{src}->{dst}"] = _fit(case, dst, root, resume=os.path.join(ck, "step=000010.ckpt"))
    return out


_CACHE: dict = {}


def _results(tmp_path_factory) -> list[dict]:
    return run_ranks_once(_CACHE, "r", "test_offload_state_dtype:_worker", 2, tmp_path_factory, timeout=240,
                          root=str(tmp_path_factory.mktemp("state_dtype")))


def test_bf16_moments_halve_the_swap_file_bytes(tmp_path_factory):
    for res in _results(tmp_path_factory):
        for case in CASES:
            fp32, bf16 = res[f"{case}-fp32"], res[f"{case}-bf16"]
            assert fp32["kinds"] == bf16["kinds"] == ["exp_avg", "exp_avg_sq"]  # masters are not in them
            assert bf16["dtype"] == "bf16" and fp32["dtype"] == "fp32"
            assert set(fp32["sizes"]) == {fp32["disk_bytes"]} and set(bf16["sizes"]) == {bf16["disk_bytes"]}
            numels = fp32["numels"]  # two moments per sub-group, each region padded to ALIGN
            assert fp32["disk_bytes"] == sum(2 * round_up(4 * n) for n in numels)
            assert bf16["disk_bytes"] == sum(2 * round_up(2 * n) for n in numels)
            # bytes per swapped element: 8 -> 4 but for page padding (0.50 stage 2 and 0.54 stage 3,
            # whose 256-element slot pads to a page, measured here)
            assert bf16["disk_bytes"] / fp32["disk_bytes"] <= 0.55, (case, numels)


def test_bf16_moments_track_the_fp32_state_loss(tmp_path_factory):
    res = _results(tmp_path_factory)[0]
    for case in CASES:
        fp32, bf16 = res[f"{case}-fp32"]["losses"], res[f"{case}-bf16"]["losses"]
        assert len(fp32) == STEPS and not torch.equal(fp32, bf16)  # the rounding did happen
        gap = float(((bf16 - fp32).abs() / fp32.abs()).max())
        print(f"{case}: worst relative loss gap {gap:.2e}")
        assert gap <= LOSS_RTOL, f"{case}: bf16 moments stray {gap:.2e} from fp32 moments"


def test_a_checkpoint_resumes_under_either_state_dtype(tmp_path_factory):
    """Checkpoints hold fp32 state: bf16 -> bf16 resumes exactly (a bf16 value rounds to itself
    on load); across dtypes the resumed run tracks the uninterrupted run of the new dtype."""
    res = _results(tmp_path_factory)[0]
    for case, src, dst in RESUMES:
        resumed, full = res[f"{case}:{src}->{dst}"]["losses"], res[f"{case}-{dst}"]["losses"][10:]
        assert len(resumed) == 10
        if src == dst:
            assert torch.equal(resumed, full), case
            continue
        gap = float(((resumed - full).abs() / full.abs()).max())
        print(f"{case} {src}->{dst}: {gap:.2e}")
        assert gap <= LOSS_RTOL, f"{case} {src}->{dst}: {gap:.2e}"


def test_the_estimate_is_the_swap_files(tmp_path_factory):
    """zerotrain-estimate's disk bytes for the moments equal the files' but for page padding."""
    n = sum(p.numel() for p in WideToy().parameters())
    for res in _results(tmp_path_factory):
        for case, opts in CASES.items():
            for dtype in ("fp32", "bf16"):
                got = res[f"{case}-{dtype}"]
                est = estimate_offload(n, 2, opts.get("stage", 2), "32", optimizer_state_dtype=dtype,
                                       param_device=opts.get("param_device", "none"))
                assert est.disk.master == 0  # fp32 compute: no master of its own
                padding = 2 * ALIGN * len(got["numels"])
                assert 0 <= got["disk_bytes"] - est.disk.optimizer <= padding, (case, dtype)
