"""``ops/peak.py``: the matmul peak MFU is taken against, probed once per machine and cached.

The probe itself is timed (a few ms a round); the tests check what is stored and reused, not
how fast this machine is."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.ops import peak


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "peak.json"
    monkeypatch.setenv(peak.CACHE_ENV, str(path))
    calls = []

    def probe(dtype="fp32", sizes=(), seconds=0.3):
        calls.append(dtype)
        return {"fp32": 1.0e11, "bf16": 3.0e11, "fp16": 2.0e11}[dtype]

    monkeypatch.setattr(peak, "probe_cpu_matmul", probe)
    return path, calls


def test_a_machine_is_probed_once_per_dtype_then_read_from_the_cache(cache):
    path, calls = cache
    assert peak.cpu_peak_flops("fp32") == (1.0e11, False)
    assert peak.cpu_peak_flops("fp32") == (1.0e11, True)
    assert peak.cpu_peak_flops("bf16") == (3.0e11, False)
    assert calls == ["fp32", "bf16"]
    stored = json.loads(path.read_text())
    key = peak.cache_key("bf16")
    assert stored[key]["flops"] == 3.0e11 and "measured" in stored[key]
    assert f"{torch.get_num_threads()} threads" in key and torch.__version__ in key and "bf16" in key
    assert peak.cpu_peak_flops("fp32", refresh=True) == (1.0e11, False) and calls[-1] == "fp32"


def test_the_thread_count_is_part_of_the_key(cache, monkeypatch):
    assert peak.cache_key("fp32", threads=1) != peak.cache_key("fp32", threads=2)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"%s": {"flops": -1}}'])
def test_a_damaged_cache_is_probed_again_and_rewritten(cache, content):
    path, calls = cache
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("%s", peak.cache_key("fp32")) if "%s" in content else content)
    assert peak.cpu_peak_flops("fp32") == (1.0e11, False)
    assert json.loads(path.read_text())[peak.cache_key("fp32")]["flops"] == 1.0e11
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_an_unknown_dtype_is_refused(cache):
    with pytest.raises(ValueError, match="dtype='int8'; valid: "):
        peak.cpu_peak_flops("int8")


def test_the_real_probe_measures_a_positive_rate():
    assert peak.probe_cpu_matmul("fp32", sizes=(64,), seconds=0.01) > 0


def test_the_report_prints_both_peaks(cache, capsys):
    from zerotrain.ops.report import main_report

    assert main_report([]) == 0
    out = capsys.readouterr().out
    assert "peak fp32  100.0 GFLOP/s" in out and "peak bf16  300.0 GFLOP/s" in out and "measured now" in out
    main_report([])
    assert "cached in" in capsys.readouterr().out


class _Counted(__import__("toy").ToyModule):
    def flops_per_sample(self):
        return 1.0e6


@pytest.mark.parametrize("given,expect", [(None, 1.0e11), (0, None)])
def test_throughput_monitor_takes_the_machines_peak_unless_told(cache, tmp_path, given, expect):
    from zerotrain import ThroughputMonitor, Trainer

    thr = ThroughputMonitor(peak_flops=given, window=2)
    trainer = Trainer(devices=1, max_steps=4, logger=False, callbacks=[thr], enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=str(tmp_path))
    trainer.fit(_Counted())
    assert thr.peak_flops == (expect if expect is not None else 0)
    assert ("throughput/mfu" in thr.last) == (expect is not None)
    if expect is not None:
        rate = thr.last["throughput/samples_per_sec"] * 1.0e6 / (expect * trainer.world_size)
        assert thr.last["throughput/mfu"] == pytest.approx(rate)


def test_a_probe_beside_other_ranks_is_used_but_not_cached(cache):
    path, calls = cache
    assert peak.cpu_peak_flops("fp32", store=False) == (1.0e11, False)
    assert not path.exists()
    assert peak.cpu_peak_flops("fp32") == (1.0e11, False) and calls == ["fp32", "fp32"]
    assert peak.cpu_peak_flops("fp32", store=False) == (1.0e11, True)  # a stored figure is read by everyone
