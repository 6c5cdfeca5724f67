"""The CUDA kernels: the library's ctypes binding (`binding.py`), decode attention
(`decode.py`) and prefill through FlashAttention's varlen kernel (`prefill.py`)."""
