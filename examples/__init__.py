"""The demo: a byte-level GPT (gpt.py), its data (data.py) and its TrainModule (gpt_module.py)."""
