"""strategies/zero/hostmem.py: huge-page advice for buffers gathered afresh every step, and the pool
of short-lived buffers by shape."""
import pytest
import torch

from zerotrain.strategies.zero import hostmem
from zerotrain.strategies.zero.hostmem import HUGE_PAGE, SizedPool, advise_huge_pages, huge_pages_enabled


def test_advice_covers_the_whole_huge_pages_inside_the_buffer_and_keeps_its_values():
    t = torch.empty(16 << 20, dtype=torch.uint8)  # 16 MiB, not yet written
    advised = advise_huge_pages(t)
    if not huge_pages_enabled():
        assert advised == 0
        pytest.skip("no transparent huge pages here (off Linux, or THP 'never')")
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    # every advised byte lies inside the buffer, in whole 2 MiB pages: at least 14 of its 16 MiB
    assert advised % HUGE_PAGE == 0 and 14 << 20 <= advised <= end - start
    t.fill_(7)
    assert int(t.min()) == int(t.max()) == 7


def test_small_buffers_and_other_devices_are_left_alone():
    assert advise_huge_pages(torch.empty(1000)) == 0  # under one huge page
    assert advise_huge_pages(torch.empty(1 << 20, device="meta")) == 0


def test_the_switch_is_read_and_validated(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_HUGE_PAGES", "0")
    assert not huge_pages_enabled() and advise_huge_pages(torch.empty(4 << 20)) == 0
    monkeypatch.setenv("ZEROTRAIN_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match=r"ZEROTRAIN_HUGE_PAGES='yes': valid choices: 0 \(off\), 1"):
        huge_pages_enabled()


def test_pool_hands_back_a_buffer_of_the_same_shape_only():
    pool = SizedPool()
    a = pool.take(10, torch.int8, torch.device("cpu"))
    pool.give(a)
    assert pool.take(10, torch.int8, torch.device("cpu")) is a  # reused
    b = pool.take(10, torch.float32, torch.device("cpu"))  # another dtype: a new one
    c = pool.take(10, torch.int8, torch.device("cpu"))  # `a` is in use again: a new one
    assert b is not a and c is not a and len(pool.buffers()) == 3
    pool.clear()
    assert pool.buffers() == [] and hostmem.SizedPool().buffers() == []
