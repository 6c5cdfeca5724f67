"""Building and finding the native libraries: their declarations (`spec.py`), the
first-use build cached on disk (`jit.py`), the wheel's prebuilt ones (`native.py`), and
the C types their bindings pass (`c_types.py`). Standard library only (`spec.py` is also
loaded by `setup.py`, without torch)."""
