"""``zerotrain-train`` and ``zerotrain-tune`` (Hydra): the typed config (``config.py``), what Hydra
refuses, composed before its ``main`` runs (``compose_check.py``), the user's ``_target_`` modules
(``hydra_target.py``), the demo GPT's and a Hugging Face causal LM's parts (``demo_gpt.py``,
``causal_lm.py``), the tuner's search space (``tune_search.py``), its chart and the sweep table.

May import: trainer.api, trainer.errors, trainer.loop, trainer.settings, strategies."""
