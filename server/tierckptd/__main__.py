"""`tierckptd` (the console script) and `python -m tierckptd`.

The daemon's own libraries are the `daemon` extra, not the base install (a training
process needs only the client): on a node installed with plain `pip install tierckpt`
this says which are missing and how to add them, instead of a traceback.
"""

from __future__ import annotations

import importlib.util
import sys

# The top-level modules of the `daemon` extra's distributions (pyproject.toml).
DAEMON_EXTRA = {
    "grpc_health": "grpcio-health-checking",
    "prometheus_client": "prometheus-client",
    "s3fs": "s3fs",
    "zstandard": "zstandard",
}
INSTALL_HINT = "pip install 'tierckpt[daemon]'"


def missing_extras() -> list[str]:
    """The distributions of the `daemon` extra whose module cannot be found here."""
    return [
        dist for module, dist in DAEMON_EXTRA.items() if importlib.util.find_spec(module) is None
    ]


def _refusal(missing: list[str]) -> str:
    return (
        f"tierckptd: the daemon's libraries are not installed ({', '.join(missing)}): "
        f"run `{INSTALL_HINT}` (a training process needs only `pip install tierckpt`)"
    )


def main(argv: list[str] | None = None) -> int:
    """Checks the `daemon` extra, then runs `tierckptd.main.main`."""
    missing = missing_extras()
    if missing:
        print(_refusal(missing), file=sys.stderr)
        return 2
    from tierckptd.main import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
