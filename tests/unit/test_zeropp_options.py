"""ZeRO++'s options (``quantize_weights``, ``quantize_gradients``, ``quantize_block_size``,
``hierarchical_partition``): where
they live, how they are validated, and what the quantized collectives compute on one process (the
2-process behaviour is tests/distributed/test_zeropp.py)."""
import pytest
import torch

from zerotrain.ops.quantize_reference import dequantize_reference, quantize_reference
from zerotrain.strategies import strategy_from_name
from zerotrain.strategies.zero import ZeroConfig, ZeroStage1, ZeroStage2
from zerotrain.strategies.zero.comm.collectives import SizedPool
from zerotrain.strategies.zero.config import Stage3Config, ZeroSpec
from zerotrain.strategies.zero.comm.quantized import Quantization, wire_bytes


def test_options_route_to_their_sections():
    spec = ZeroSpec.from_options(3, quantize_weights=True, quantize_gradients=True, quantize_block_size=2048)
    assert spec.stage3.quantize_weights and spec.zero.quantize_gradients
    assert spec.zero.quantize_block_size == 2048
    assert ZeroStage2(quantize_gradients=True).config.resolved_reduce_mode("gloo", 2) == "quantized"
    assert ZeroConfig(quantize_gradients=True, reduce_mode="reduce_scatter").resolved_reduce_mode("nccl", 8) == "quantized"
    assert not Stage3Config().quantize_weights and not ZeroConfig().quantize_gradients  # opt-in


def test_options_are_validated_with_field_and_value():
    cases = [
        (lambda: ZeroStage1(quantize_gradients=True), ValueError, "quantize_gradients=True: stage 1"),
        (lambda: ZeroStage2(quantize_weights=True), ValueError, "quantize_weights=True is not an option of stage=2"),
        (lambda: ZeroStage2(quantize_gradients="yes"), TypeError, "quantize_gradients='yes'"),
        (lambda: ZeroStage2(quantize_block_size=0), ValueError, "quantize_block_size=0"),
        (lambda: strategy_from_name("zero3", quantize_weights=1), TypeError, "quantize_weights=1"),
        (lambda: strategy_from_name("zero3", hierarchical_partition="on"), TypeError, "hierarchical_partition='on'"),
        (lambda: ZeroStage2(hierarchical_partition=True), ValueError, "hierarchical_partition=True is not an option"),
    ]
    for make, err, match in cases:
        with pytest.raises(err, match=match):
            make()


def test_one_process_gather_is_the_dequantized_shard():
    x = torch.randn(1000) * 5
    full = torch.empty(1000)
    handles, keep, arrive = Quantization(weights=True, block_size=64).gather(full, x)
    for h in handles:
        h.wait()
    assert arrive() is full
    torch.testing.assert_close(full, dequantize_reference(*quantize_reference(x, 64), 64), rtol=0, atol=0)


def test_one_process_reduce_sums_the_dequantized_pieces():
    flat = torch.randn(300)
    handles, keep, summed = Quantization(gradients=True, block_size=32).reduce(flat, [(0, 300)], 0)
    for h in handles:
        h.wait()
    torch.testing.assert_close(summed(), dequantize_reference(*quantize_reference(flat, 32), 32), rtol=0, atol=0)
    assert sum(t.numel() * t.element_size() for t in keep[:2]) == wire_bytes([300], 32) == 300 + 4 * 10


def test_reduce_sums_into_out_and_reuses_its_pooled_buffers():
    """qgZ's sum lands in the caller's ``out`` (the gradient partition, when it is zeros), bit for
    bit what it gives without one; the int8 codes, scales and pieces go back to the pool once the
    work ran, so a second reduction of the same shape allocates nothing."""
    flat = torch.randn(300)
    quant = Quantization(gradients=True, block_size=32)
    handles, _, summed = quant.reduce(flat, [(0, 300)], 0)
    for h in handles:
        h.wait()
    expected = summed().clone()
    made = quant.pool.buffers()
    out = torch.full((300,), float("nan"))
    handles, _, summed = quant.reduce(flat, [(0, 300)], 0, out=out)
    for h in handles:
        h.wait()
    assert summed() is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert [t.data_ptr() for t in quant.pool.buffers()] == [t.data_ptr() for t in made]
    with pytest.raises(ValueError, match="valid: 300 torch.float32"):
        quant.reduce(flat, [(0, 300)], 0, out=torch.empty(300, dtype=torch.bfloat16))


def test_gather_reuses_its_pooled_buffers():
    quant = Quantization(weights=True, block_size=64)
    x, full = torch.randn(1000), torch.empty(1000)
    for step in range(3):
        handles, _, arrive = quant.gather(full, x)
        for h in handles:
            h.wait()
        arrive()
        if step == 0:
            made = [t.data_ptr() for t in quant.pool.buffers()]
    assert [t.data_ptr() for t in quant.pool.buffers()] == made and len(made) == 4  # codes, scales: mine and all


def test_pool_hands_back_a_buffer_of_the_same_shape_only():
    pool = SizedPool()
    cpu = torch.device("cpu")
    a = pool.take(10, torch.int8, cpu)
    pool.give(a)
    assert pool.take(10, torch.int8, cpu) is a  # reused
    b = pool.take(10, torch.float32, cpu)  # another dtype: a new one
    c = pool.take(10, torch.int8, cpu)  # `a` is in use again: a new one
    assert b is not a and c is not a and len(pool.buffers()) == 3
    pool.clear()
    assert pool.buffers() == []
