"""The process model: local multi-process launch (``launcher.py``), joining the job and sharing data
over it (``job.py``), elastic restarts (``elastic.py``), the progress watchdog (``watchdog.py``),
SIGTERM/SIGUSR1 saves (``signals.py``) and a stopped rank 0 (``stopped_parent.py``). Nothing here
knows the loop.

May import: trainer.errors, trainer.utilities, strategies."""
