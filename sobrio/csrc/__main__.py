"""`python -m sobrio.csrc`: build the C++ operators now (make install runs it), say whether they load."""

from sobrio.csrc import load

print("sobrio C++ operators:", "built" if load() is not None else "unavailable (PyTorch path in use)")
