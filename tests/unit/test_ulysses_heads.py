"""How Ulysses fits KV heads to a sequence group (strategies/parallel/ulysses.py repeat_kv_for):
no repetition where they divide, the fewest repeats that divide otherwise (the repeated count,
lcm(KV heads, sp), always divides the query heads), and a clear error where the query heads cannot
split over the group or the KV heads do not divide them."""
import pytest

from zerotrain.strategies.parallel import repeat_kv_for


@pytest.mark.parametrize("heads, kv, sp, repeat", [
    (4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (6, 3, 2, 2), (8, 2, 4, 2), (4, 1, 4, 4), (12, 6, 4, 2), (8, 8, 1, 1)])
def test_fewest_repeats(heads, kv, sp, repeat):
    assert repeat_kv_for(heads, kv, sp) == repeat
    assert (kv * repeat) % sp == 0 and heads % (kv * repeat) == 0


@pytest.mark.parametrize("heads, kv, sp, text", [
    (6, 6, 4, "6 query heads do not divide over a sequence group of 4"),
    (4, 3, 2, "3 KV heads for 4 query heads; valid: a divisor of 4"),
    (4, 0, 2, "0 KV heads"),
])
def test_refusals(heads, kv, sp, text):
    with pytest.raises(ValueError, match=text):
        repeat_kv_for(heads, kv, sp)
