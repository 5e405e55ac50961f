"""Skip marks for the tests that compare with an optional peer library (not a zerotrain dependency)."""
import importlib.util

import pytest

#: DeepSpeed 0.19.8 (zerotrain's `dev` extra): the tests that run it beside zerotrain skip without it
deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                               reason="deepspeed is not installed (zerotrain's `dev` extra); this compares against it")
