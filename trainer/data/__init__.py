"""The Trainer's data: each stage's loaders and the samplers put under them (``loaders.py``),
fit's training loaders (``fit.py``), the batch-transfer hooks (``batch_transfer.py``) and the dataset
indices of predict batches (``predict_indices.py``).

May import: trainer.api, trainer.compat.lightning, trainer.errors, trainer.launch, trainer.loop, trainer.utilities."""
