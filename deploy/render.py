"""Render mlxd's service templates for the current user (stdlib only).

    python deploy/render.py {launchd|systemd} [--config PATH] [--out PATH]

Fills the placeholders of deploy/com.mlxd.server.plist.in (launchd) or
deploy/mlxd.service.in (systemd) and writes the result to --out (atomically,
creating its directory) or to stdout:

    @MLXD@          absolute path of the venv's `mlxd` script
    @CONFIG@        absolute path of the TOML config (default ~/.config/mlxd/mlxd.toml)
    @WORKDIR@       the service's working directory (default: this checkout)
    @HOME@          the user's home directory
    @LOGDIR@        launchd's log directory (default ~/Library/Logs/mlxd)
    @PATH@          PATH for launchd: the venv's bin, then the usual system dirs
    @STOP_TIMEOUT@  seconds from SIGTERM to SIGKILL: the gateway's graceful stop
                    (shutdown_grace_s + 2 x worker_stop_grace_s, read from the
                    config when it sets them) plus a margin

Values are escaped for their format (XML for the plist; quoting, `%` and `$`
for systemd), so paths with spaces work.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import tomllib
from pathlib import Path
from xml.sax.saxutils import escape as xml_escape

DEPLOY_DIR = Path(__file__).resolve().parent
ROOT = DEPLOY_DIR.parent
TEMPLATES = {
    "launchd": DEPLOY_DIR / "com.mlxd.server.plist.in",
    "systemd": DEPLOY_DIR / "mlxd.service.in",
}
DEFAULT_CONFIG = Path("~/.config/mlxd/mlxd.toml")
DEFAULT_LOG_DIR = Path("~/Library/Logs/mlxd")
SYSTEM_PATH = ("/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin")

# gateway/config.py's defaults (tests/test_deploy.py keeps them in step).
SHUTDOWN_GRACE_S = 30.0
WORKER_STOP_GRACE_S = 5.0
STOP_MARGIN_S = 20  # cancelling leftover handlers, closing the frontend and tracer

PLACEHOLDER = re.compile(r"@[A-Z_]+@")


class RenderError(Exception):
    """A problem the user must fix; printed as one line."""


def find_mlxd() -> Path:
    """The venv's `mlxd`: this interpreter's venv, else the checkout's .venv."""
    candidates = []
    if sys.prefix != sys.base_prefix:
        candidates.append(Path(sys.prefix) / "bin" / "mlxd")
    candidates.append(ROOT / ".venv" / "bin" / "mlxd")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path.absolute()
    raise RenderError(f"no mlxd script at {candidates[-1]}; run `make setup` first")


def stop_timeout_s(config: Path) -> int:
    """Seconds the service manager should wait after SIGTERM before SIGKILL."""
    grace, stop = SHUTDOWN_GRACE_S, WORKER_STOP_GRACE_S
    if config.is_file():
        try:
            data = tomllib.loads(config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            warn(f"cannot read {config} ({e}); assuming default grace periods")
            data = {}
        try:
            grace = float(data.get("shutdown_grace_s", grace))
            stop = float(data.get("worker_stop_grace_s", stop))
        except (TypeError, ValueError):
            warn(f"{config}: a grace period is not a number; assuming the defaults")
            grace, stop = SHUTDOWN_GRACE_S, WORKER_STOP_GRACE_S
    return math.ceil(grace + 2 * stop) + STOP_MARGIN_S


def systemd_arg(value: str) -> str:
    """One ExecStart= word: `%` and `$` escaped, quoted when it needs to be."""
    if any(c.isspace() or c in "\"'\\;" for c in value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value.replace("%", "%%").replace("$", "$$")


def systemd_path(value: str) -> str:
    """A path setting such as WorkingDirectory=: only specifiers need escaping."""
    return value.replace("%", "%%")


def values(kind: str, mlxd: Path, config: Path, workdir: Path, log_dir: Path) -> dict[str, str]:
    """The placeholder values, escaped for the template's format."""
    home = Path.home()
    path = os.pathsep.join(dict.fromkeys([str(mlxd.parent), *SYSTEM_PATH]))
    raw = {
        "MLXD": str(mlxd),
        "CONFIG": str(config),
        "WORKDIR": str(workdir),
        "HOME": str(home),
        "LOGDIR": str(log_dir),
        "PATH": path,
        "STOP_TIMEOUT": str(stop_timeout_s(config)),
    }
    if kind == "launchd":
        return {k: xml_escape(v) for k, v in raw.items()}
    args = {"MLXD", "CONFIG"}
    return {k: systemd_arg(v) if k in args else systemd_path(v) for k, v in raw.items()}


def render(
    kind: str,
    config: Path | None = None,
    *,
    mlxd: Path | None = None,
    workdir: Path | None = None,
    log_dir: Path | None = None,
) -> str:
    """The rendered template text."""
    config = (config or DEFAULT_CONFIG).expanduser().absolute()
    if not config.is_file():
        warn(
            f"{config} does not exist: `mlxd serve` exits 78 until it does "
            "(start from deploy/mlxd.toml.example)"
        )
    mlxd = (mlxd or find_mlxd()).expanduser().absolute()
    if not (mlxd.is_file() and os.access(mlxd, os.X_OK)):
        raise RenderError(f"{mlxd} is not an executable file")
    subst = values(
        kind,
        mlxd,
        config,
        (workdir or ROOT).expanduser().absolute(),
        (log_dir or DEFAULT_LOG_DIR).expanduser().absolute(),
    )
    text = TEMPLATES[kind].read_text()

    def fill(m: re.Match[str]) -> str:
        name = m.group(0).strip("@")
        if name not in subst:
            raise RenderError(f"{TEMPLATES[kind].name}: unknown placeholder {m.group(0)}")
        return subst[name]

    return PLACEHOLDER.sub(fill, text)


def write(text: str, out: Path) -> None:
    """Replace `out` atomically (mode 0644), creating its directory."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def warn(msg: str) -> None:
    print(f"render.py: warning: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render mlxd's launchd or systemd service file.")
    p.add_argument("kind", choices=sorted(TEMPLATES))
    p.add_argument("--config", type=Path, help=f"TOML config (default {DEFAULT_CONFIG})")
    p.add_argument("--out", type=Path, help="write here instead of stdout")
    p.add_argument("--mlxd", type=Path, help="the mlxd script (default: the venv's)")
    p.add_argument("--workdir", type=Path, help=f"working directory (default {ROOT})")
    p.add_argument(
        "--log-dir", type=Path, help=f"launchd log directory (default {DEFAULT_LOG_DIR})"
    )
    args = p.parse_args(argv)
    try:
        text = render(
            args.kind, args.config, mlxd=args.mlxd, workdir=args.workdir, log_dir=args.log_dir
        )
        if args.out is None:
            sys.stdout.write(text)
        else:
            write(text, args.out.expanduser())
            print(f"wrote {args.out}", file=sys.stderr)
    except (RenderError, OSError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
