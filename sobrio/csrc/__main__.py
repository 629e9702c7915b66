"""`python -m sobrio.csrc`: build the C++ operators into this environment now (make install runs it).

Prints where the library lives, or why the PyTorch path is in use (with the compiler's output); exits 0
either way so an install without a compiler still completes.
"""

import logging

from sobrio.csrc import load


def main() -> None:
    """Build or load once, with the build's progress (and any failure in full) on stderr."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("sobrio.csrc").setLevel(logging.DEBUG)
    module = load()
    print("sobrio C++ operators:", f"built, {module.__file__}" if module is not None
          else "unavailable (PyTorch path in use)")


main()
