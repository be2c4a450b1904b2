"""Code shape limits (run by `make lint` and tests/test_code_shape.py).

No function or method over 80 lines in gateway/, worker/ and protocol/, and no
gateway module of 400 lines or more: past those sizes a unit stops having one job
(issue #15). Prints each violation; exit status 1 when there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
MAX_GATEWAY_MODULE_LINES = 399
PACKAGES = ("gateway", "worker", "protocol")


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            name = path.relative_to(root)
            lines = text.count("\n")
            if package == "gateway" and lines > MAX_GATEWAY_MODULE_LINES:
                found.append(f"{name}: {lines} lines (gateway modules: < 400)")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = (node.end_lineno or node.lineno) - node.lineno + 1
                    if size > MAX_FUNCTION_LINES:
                        found.append(f"{name}:{node.lineno}: {node.name} has {size} lines")
    return found


def main() -> int:
    found = violations()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
