"""Frameworks mlxd's processes hide from transformers (both entry points, one list).

transformers imports torch and scikit-learn whenever they are installed, though
tokenization needs neither: on the H200 machine's image they took 8.6 of
`import mlx_lm`'s 9.2 s, and a machine used for ML work often has them. The
gateway (`mlxd serve`) and the worker (`python -m worker`) call
`hide_unused_frameworks` first thing, before mlx-lm's first import.

Threading: call from the main thread at process start.
"""

from __future__ import annotations

import sys

UNUSED_FRAMEWORKS = ("torch", "sklearn")


def hide_unused_frameworks() -> None:
    """Make this process see UNUSED_FRAMEWORKS as not installed (a None entry in
    sys.modules: `importlib.util.find_spec` answers None and `import` fails), so
    transformers never imports them. A module already imported is left alone."""
    for name in UNUSED_FRAMEWORKS:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
