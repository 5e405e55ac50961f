"""ALST's face (``zerotrain.deepspeed.runtime.sequence_parallel``): DeepSpeed 0.19.8's signatures and
names, registered once under ``zerotrain.deepspeed``; what it does on 2 ranks, against DeepSpeed:
tests/distributed/test_ulysses_alst.py."""
import inspect

import pytest


def test_signatures_are_deepspeeds(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as their_mpu
    from deepspeed.runtime.sequence_parallel import ulysses_sp as theirs

    from zerotrain.deepspeed.runtime.sequence_parallel import parallel_state_sp as our_mpu
    from zerotrain.deepspeed.runtime.sequence_parallel import ulysses_sp as ours

    def params(f):
        return [(p.name, p.default, p.kind) for p in inspect.signature(f).parameters.values()]

    for cls, method in (("UlyssesSPAttentionHF", "__init__"), ("UlyssesSPAttentionHF", "register_with_transformers"),
                        ("UlyssesSPDataLoaderAdapter", "__init__")):
        assert params(getattr(getattr(ours, cls), method)) == params(getattr(getattr(theirs, cls), method)), method
    public = [n for n in dir(their_mpu) if n.startswith(("get_", "initialize_"))]
    assert public and all(callable(getattr(our_mpu, n)) for n in public)


def test_registered_once_and_sp_1_does_nothing():
    import sys

    import zerotrain.deepspeed as deepspeed
    from zerotrain.deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from zerotrain.trainer.compat.deepspeed.runtime.sequence_parallel import ulysses_sp

    assert "runtime.sequence_parallel.ulysses_sp" in deepspeed.SUBMODULES
    assert sys.modules["zerotrain.deepspeed.runtime.sequence_parallel.ulysses_sp"] is ulysses_sp
    assert UlyssesSPAttentionHF.register_with_transformers("any", "sdpa", 1, 1) is None


def test_groups_before_joining_a_process_group_are_refused():
    from zerotrain.deepspeed.runtime.sequence_parallel import parallel_state_sp

    with pytest.raises(RuntimeError, match="sequence parallel group is not initialized"):
        parallel_state_sp.get_sequence_parallel_group()
    with pytest.raises(RuntimeError, match="no process group joined"):
        parallel_state_sp.initialize_sequence_parallel(2)
