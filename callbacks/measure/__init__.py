"""Callbacks that measure: communication bytes against the strategy's formula (``comms.py``), FLOPs
and MFU (``flops.py``), time and memory per phase (``resources.py``), learning rates and throughput
(``monitors.py``)."""
