"""The code shape limits of tests/check_sizes.py hold: short functions, small gateway modules."""

from __future__ import annotations

from pathlib import Path

from tests.check_sizes import violations


def test_no_function_over_80_lines_and_no_gateway_module_over_400() -> None:
    assert violations() == []


def test_the_architecture_diagram_names_every_module() -> None:
    """docs/architecture.md's diagram matches the tree: every module and package is in it."""
    root = Path(__file__).resolve().parent.parent
    text = (root / "docs" / "architecture.md").read_text()
    start = text.index("```")
    diagram = text[start : text.index("```", start + 3)]
    missing = []
    for package in ("gateway", "worker", "protocol"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            folder = path.parent.relative_to(root).parts[-1] + "/"
            if path.name not in diagram or folder not in diagram:
                missing.append(str(path.relative_to(root)))
    assert missing == [], "not in docs/architecture.md's diagram"


def test_the_gateway_imports_no_mlx_before_it_starts_its_worker() -> None:
    """mlx-lm's import (transformers: 13 s on the H200 machine) happens beside the
    worker's start, not before it: importing the gateway's app must not pull it in."""
    import subprocess
    import sys

    code = (
        "import sys, gateway.cli, gateway.http.app\n"
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
