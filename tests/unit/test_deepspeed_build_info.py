"""What DeepSpeed's own test helpers and scripts read besides the training API: the build record
``deepspeed.git_version_info``, ``deepspeed.accelerator.is_current_accelerator_supported``, the CPU
accelerator's device count from ``LOCAL_SIZE``, and ``deepspeed.runtime.utils``' partition and
memory helpers. Found running DeepSpeed's tests/unit renamed (issue 42): its ``unit/util.py`` imports
the first two, so every module importing it failed to import; its ``DistributedTest`` skips a
world of N when the accelerator counts fewer than N devices."""
from __future__ import annotations

import random

import pytest
import torch

import zerotrain.deepspeed as deepspeed
from zerotrain.deepspeed.accelerator import Accelerator, is_current_accelerator_supported
from zerotrain.deepspeed.git_version_info import torch_info
from zerotrain.deepspeed.pipe.partition import balanced, uniform
from zerotrain.deepspeed.runtime.utils import partition_balanced, partition_uniform, prefix_sum_inc, see_memory_usage

pytestmark = pytest.mark.timeout(120)


def test_build_record_names_this_release_and_the_torch_it_runs_on():
    assert deepspeed.git_version_info.version == deepspeed.__version__
    assert set(torch_info) >= {"version", "cuda_version", "nccl_version", "hip_version", "bf16_support"}
    assert torch_info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if torch.version.cuda is None:
        assert torch_info["cuda_version"] == "0.0"  # DeepSpeed's "unknown", which its helpers test for
    else:
        assert torch_info["cuda_version"] == ".".join(torch.version.cuda.split(".")[:2])


def test_both_accelerators_the_face_runs_on_are_supported():
    assert is_current_accelerator_supported() is True


@pytest.mark.parametrize("local_size, local_world_size, expected", [("3", "2", 3), (None, "2", 2), ("0", None, 1),
                                                                      (None, None, 1)])
def test_cpu_device_count_reads_local_size_first(monkeypatch, local_size, local_world_size, expected):
    for key, value in (("LOCAL_SIZE", local_size), ("LOCAL_WORLD_SIZE", local_world_size)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert Accelerator("cpu").device_count() == expected


def test_prefix_sum_is_inclusive_and_leaves_its_argument():
    weights = [2, 0, 5, 1]
    assert prefix_sum_inc(weights) == [2, 2, 7, 8]
    assert weights == [2, 0, 5, 1]
    assert prefix_sum_inc([0.5, 0.25]) == [0.5, 0.75]
    assert prefix_sum_inc([]) == []


def test_partition_helpers_are_the_pipeline_rules():
    rng = random.Random(7)
    for _ in range(50):
        weights = [rng.randint(0, 9) for _ in range(rng.randint(1, 10))]
        parts = rng.randint(1, 5)
        assert partition_uniform(len(weights), parts) == uniform(len(weights), parts)
        assert partition_balanced(weights, parts) == balanced(weights, parts)
    assert partition_balanced((5, 1, 1, 1, 1, 1), 2) == [0, 1, 6]  # 5 | 5; a tuple is accepted


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("loud", force=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "loud"
    assert lines[1].startswith("MA ") and "Max_MA" in lines[1] and "CA" in lines[1]
