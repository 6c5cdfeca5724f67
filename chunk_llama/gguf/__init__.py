"""GGUF files: the tensor table read memory-mapped (`file.py`), weights kept in their
quantized blocks (`weights.py`), and a model loaded one tensor at a time (`load.py`)."""
