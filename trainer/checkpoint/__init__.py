"""Checkpoints: what a save writes beside the tensors and how a load restores it (``protocol.py``);
the sharded directory format (``directory.py``) and the checks a load makes before trusting one
(``checks.py``), single files in Lightning's layout (``single_file.py``), weights-only files
(``weights_only.py``), tensors streamed one at a time (``tensor_files.py``), resharding to another
world size or strategy (``reshard.py``), one plain state dict from shards (``consolidate.py``), URLs
and remote file systems (``url.py``, ``fs.py``).

May import: trainer.api, trainer.errors, trainer.launch, trainer.loop, trainer.version, strategies."""
