"""The demo: a byte-level GPT (gpt.py), its data (data.py), its TrainModule (gpt_module.py) and its
part of the command line (gpt_cli.py: the `_target_` that builds the GPTModule; the library never imports examples/)."""
