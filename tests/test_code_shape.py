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


def _fake_framework(site: Path, name: str, marker: Path) -> None:
    """An installed-looking package whose import leaves a marker file (and then
    fails, as a framework that cannot load would)."""
    pkg = site / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\nraise ImportError('fake')\n"
    )
    info = site / f"{name}-2.9.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.9.0\n")


def test_mlxd_processes_never_import_torch_or_sklearn(tmp_path: Path) -> None:
    """transformers imports torch and scikit-learn when they are installed (8.6 s
    of `import mlx_lm` on the H200 machine); the worker's and the gateway's entry
    points hide them before mlx-lm's first import. Control: without the hiding,
    the same imports do reach the fake packages."""
    import os
    import subprocess
    import sys

    site, marker = tmp_path / "site", tmp_path / "imported"
    for name in ("torch", "sklearn"):
        _fake_framework(site, name, marker)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{root}"}
    tokenizer_stack = "import mlx_lm.tokenizer_utils, mlx_lm.generate"
    runs = {
        "control": "import contextlib\n"
        f"with contextlib.suppress(Exception):\n    {tokenizer_stack}",
        # Each process's real entry point (stopped at once by a bad argument),
        # then what that process imports later.
        "worker": "from worker.proc import main\nassert main(['--no-such-flag']) == 78\n"
        f"import worker.core\n{tokenizer_stack}",
        "gateway": "from gateway.cli import main\n"
        "assert main(['serve', '--config', '/no/such/mlxd.toml']) == 78\n"
        "from gateway.serving import tokenizer\ntokenizer.preload()",
    }
    seen = {}
    for what, code in runs.items():
        marker.unlink(missing_ok=True)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert out.returncode == 0, out.stderr[-2000:]
        seen[what] = sorted(set(marker.read_text().split())) if marker.exists() else []
    assert seen["control"], "transformers did not reach the fake torch: the test measures nothing"
    assert seen["worker"] == [] and seen["gateway"] == []
