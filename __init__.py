"""zerotrain: a Lightning-style Trainer whose strategies implement ZeRO 1/2/3, offload and
pipeline parallelism on torch.distributed."""
__version__ = "0.1.0"
