"""The CPU kernels: the instruction-set variant (`isa.py`), the library's ctypes binding
(`binding.py`), attention (`attention.py`), and the linear layers on float32 or 16-bit
weights (`linear.py`) and on GGUF blocks (`quant_linear.py`)."""
