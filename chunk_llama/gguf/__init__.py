"""GGUF files: the tensor table read memory-mapped (`file.py`), weights kept in their
quantized blocks (`weights.py`) by the modules of `modules.py`, a model loaded one tensor at a
time (`load.py`), and transformers' read of the metadata done once per load (`metadata.py`)."""
