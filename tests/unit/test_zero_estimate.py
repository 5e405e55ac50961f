"""The ZeRO memory formulas, the zerotrain-estimate command and storage counting."""
import itertools
import math

import pytest
import torch

from zerotrain.strategies.memory import count_bytes, storage_bytes
from zerotrain.strategies.zero.estimate import (
    estimate_model_states, estimate_offload, format_bytes, gpt_num_params, largest_offload_model, main)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_mixed_precision_adam_formulas(world):
    psi = 1_000_000 * world  # divisible, so the formulas are exact
    est = estimate_model_states(psi, world, "bf16-mixed")
    assert est["ddp"].total == 16 * psi
    assert est["zero1"].total == 2 * psi + 2 * psi + 12 * psi // world
    assert est["zero2"].total == 2 * psi + 14 * psi // world
    assert est["zero3"].total == 16 * psi // world
    z1 = est["zero1"]
    assert (z1.params, z1.grads, z1.master, z1.optimizer) == (2 * psi, 2 * psi, 4 * psi // world, 8 * psi // world)


def test_fp32_has_no_separate_master_and_overrides_apply():
    est = estimate_model_states(100, 4, "32")
    assert est["zero1"].master == 0 and est["zero1"].total == 4 * 100 + 4 * 100 + 8 * 25
    sgd = estimate_model_states(100, 4, "bf16-mixed", optimizer_bytes=4, grad_bytes=4)
    assert sgd["zero2"].optimizer == 4 * 25 and sgd["zero2"].grads == 4 * 25
    assert estimate_model_states(10, 3)["zero3"].params == 2 * 4  # ceil(10 / 3) per rank


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size=0"):
        estimate_model_states(10, 0)
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate_model_states(10, 2, "fp8")
    with pytest.raises(ValueError, match="num_params=-1"):
        estimate_model_states(-1, 2)


def test_gpt_param_count():
    assert gpt_num_params(12, 768, 50257) == 124_439_808  # GPT-2 small (tied head)
    assert gpt_num_params(1, 4, 10, block_size=8, bias=False, tied_embeddings=False) == (
        10 * 4 + 8 * 4 + (12 * 16 + 2 * 4) + 4 + 10 * 4)


def test_command_prints_every_stage(capsys):
    assert main(["--n-layer", "12", "--n-embd", "768", "--world-size", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808 parameters" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["2"], ["4"])]
    assert [r[1] for r in rows] == ["ddp", "zero1", "zero2", "zero3"] * 2
    assert main(["--num-params", "1e6"]) == 0
    assert "1,000,000 parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--num-params", "1e6", "--n-layer", "2", "--n-embd", "8"])
    with pytest.raises(SystemExit):
        main(["--num-params", "10", "--world-size", "0"])


def test_format_bytes():
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.00 GiB"


def test_count_bytes_counts_each_storage_once():
    flat = torch.zeros(100)
    views = [flat[:10], flat[10:60], flat[60:]]
    other = torch.zeros(7, dtype=torch.bfloat16)
    assert storage_bytes(views + [other]) == 400 + 14

    class Fake:
        def memory_tensors(self):
            # the master is a view of the params: charged to params only
            return {"params": views, "grads": [other], "master": [flat[20:30]], "optimizer": []}

    got = count_bytes(Fake())
    assert got == {"params": 400, "grads": 14, "master": 0, "optimizer": 0, "comm_buffers": 0, "total": 414}


# ---------------------------------------------------------------------------- offload: RAM and disk
#: every valid (stage, optimizer_device, param_device, optimizer_state_dtype)
OFFLOAD_COMBOS = [c for c in itertools.product((2, 3), ("cpu", "nvme"), ("none", "cpu", "nvme"), ("fp32", "bf16"))
                  if (c[0] == 3 or c[2] == "none") and (c[3] == "fp32" or c[1] == "nvme")]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("stage,opt_dev,param_dev,state", OFFLOAD_COMBOS)
def test_offload_disk_and_ram_bytes_are_the_formula(stage, opt_dev, param_dev, state, precision):
    psi, world, sub = 12_000_000, 4, 1_000_000
    shard = psi // world
    est = estimate_offload(psi, world, stage, precision, optimizer_device=opt_dev, param_device=param_dev,
                           optimizer_state_dtype=state, sub_group_size=sub, buffer_count=3)
    p, m = (4, 0) if precision == "32" else (2, 4)
    s = {"fp32": 4, "bf16": 2}[state]
    params = p * (psi if stage == 2 else shard)
    master_disk = m * shard * (param_dev == "nvme" if stage == 3 else opt_dev == "nvme")
    disk = (params if param_dev == "nvme" else 0) + master_disk + (2 * s * shard if opt_dev == "nvme" else 0)
    assert est.disk.total == disk
    assert (est.disk.params, est.disk.grads) == (params if param_dev == "nvme" else 0, 0)
    assert est.disk.optimizer == (2 * s * shard if opt_dev == "nvme" else 0)
    staging = 3 * sub * (2 * s + (m if stage == 2 else 0)) if opt_dev == "nvme" else 0
    assert est.ram.grads == p * shard  # the precision's gradient bytes, partitioned
    assert est.ram.optimizer == (staging if opt_dev == "nvme" else 2 * 4 * shard)
    assert est.ram.params + est.disk.params == params
    assert est.ram.master + est.disk.master == m * shard


def test_bf16_moments_halve_the_moment_bytes_on_disk():
    a, b = (estimate_offload(10**9, 2, 3, optimizer_state_dtype=d) for d in ("fp32", "bf16"))
    assert b.disk.optimizer * 2 == a.disk.optimizer and b.disk.params == a.disk.params
    assert a.disk.total == 12 * 10**9 // 2 and b.disk.total == 8 * 10**9 // 2  # fp32: 4 param + 8 moments


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage,opt_dev,param_dev,state", [c for c in OFFLOAD_COMBOS if c[1] == "nvme"])
def test_largest_model_fits_and_one_percent_more_does_not(world, stage, opt_dev, param_dev, state):
    opts = dict(stage=stage, optimizer_device=opt_dev, param_device=param_dev, optimizer_state_dtype=state,
                grad_bytes=2, sub_group_size=4_000_000)
    ram, disk = 20 * 2**30, 74 * 2**30
    n = largest_offload_model(ram, disk, world, **opts)
    assert n > 10**8
    for count, fits in ((n, True), (math.ceil(n * 1.01), False)):
        est = estimate_offload(count, world, **opts)
        assert (est.ram.total * world <= ram and est.disk.total * world <= disk) is fits, (count, est)
    if stage == 3 and param_dev == "nvme":  # disk-bound: the per-parameter disk bytes set the answer
        per_param = {"fp32": 12, "bf16": 8}[state]
        assert n == pytest.approx(disk / per_param, rel=1e-6)


def test_gradients_on_disk_move_the_partition_to_disk_and_stage_sub_groups():
    psi, sub = 10**9, 4_000_000
    a, b = (estimate_offload(psi, 1, 3, optimizer_state_dtype="bf16", grad_bytes=2, sub_group_size=sub,
                             buffer_count=4, grad_device=d) for d in ("cpu", "nvme"))
    assert (a.ram.grads, a.disk.grads) == (2 * psi, 0)
    assert (b.ram.grads, b.disk.grads) == (4 * sub * 2, 2 * psi)  # 4 staged sub-groups of bf16
    assert b.disk.total == 10 * psi  # 4 param file + 4 bf16 moments + 2 bf16 gradient
    deep = estimate_offload(psi, 1, 3, optimizer_state_dtype="bf16", grad_bytes=2, sub_group_size=sub,
                            buffer_count=4, grad_device="nvme", grad_buffer_count=32)
    assert (deep.ram.grads, deep.disk.total) == (32 * sub * 2, 10 * psi)  # deeper write queue: RAM only
    with pytest.raises(ValueError, match="grad_device='nvme' needs stage=3 and optimizer_device='nvme'"):
        estimate_offload(10, stage=3, optimizer_device="cpu", grad_device="nvme")


def test_bf16_parameter_files_add_a_bf16_shard_beside_the_fp32_master():
    psi = 10**9
    a, b = (estimate_offload(psi, 1, 3, optimizer_state_dtype="bf16", grad_bytes=2, param_dtype=d)
            for d in ("auto", "bf16"))
    assert (a.disk.params, a.disk.master) == (4 * psi, 0)  # fp32 compute: the file is the master
    assert (b.disk.params, b.disk.master) == (2 * psi, 4 * psi)
    assert b.disk.total == a.disk.total + 2 * psi and b.ram.total == a.ram.total
    # under bf16-mixed the working shard is bf16 anyway: the option changes nothing
    assert estimate_offload(psi, 1, 3, "bf16-mixed", param_dtype="bf16") == estimate_offload(psi, 1, 3, "bf16-mixed")
    with pytest.raises(ValueError, match="param_dtype='bf16' needs param_device='nvme'"):
        estimate_offload(10, stage=3, param_device="cpu", param_dtype="bf16")
    with pytest.raises(ValueError, match="param_dtype='fp16'; valid choices: auto, bf16"):
        estimate_offload(10, param_dtype="fp16")


def test_offload_estimate_refuses_what_offload_refuses():
    with pytest.raises(ValueError, match="optimizer_state_dtype='bf16' needs optimizer_device='nvme'"):
        estimate_offload(10, optimizer_device="cpu", param_device="none", optimizer_state_dtype="bf16")
    with pytest.raises(ValueError, match="param_device='nvme' needs stage=3"):
        estimate_offload(10, stage=2)
    with pytest.raises(ValueError, match="optimizer_state_dtype='fp8'; valid choices: fp32, bf16"):
        estimate_offload(10, optimizer_state_dtype="fp8")


def test_command_prints_ram_disk_and_the_largest_model(capsys):
    assert main(["--num-params", "3.33e9", "--offload-stage", "3", "--optimizer-state-dtype", "bf16",
                 "--grad-bytes", "2", "--ram-gb", "20", "--disk-gb", "74", "--world-size", "1,2"]) == 0
    out = capsys.readouterr().out
    disk_rows = [line.split() for line in out.splitlines() if line.split()[1:2] == ["disk"]]
    assert [r[-1] for r in disk_rows] == ["8.00", "8.00"]  # bytes per parameter on disk
    want = largest_offload_model(20 * 2**30, 74 * 2**30, 2, optimizer_state_dtype="bf16", grad_bytes=2)
    assert f"(all 2 ranks): {want:,} parameters" in out
    with pytest.raises(SystemExit):
        main(["--num-params", "1e9", "--ram-gb", "20"])  # --disk-gb missing
    with pytest.raises(SystemExit):
        main(["--num-params", "1e9", "--offload-stage", "2", "--param-device", "nvme"])
