"""A one-node commit is rpc -> commit coordinator -> catalog (issue 23): the modules on
that path import nothing of the peer tier, so a node without peers neither imports nor
calls `tierckptd.peers`. Checked in a fresh interpreter (an import anywhere below the
two modules would pull the package into `sys.modules`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_PROBE = """
import json, sys
import tierckptd.commit, tierckptd.rpc.daemon_service
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[:2] == ["tierckptd", "peers"])))
"""


def _peer_modules_after(probe: str) -> list[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT / "server")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    found: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_the_single_node_commit_path_does_not_import_the_peer_tier() -> None:
    assert _peer_modules_after(_PROBE) == []


def test_the_probe_sees_the_peer_tier_when_it_is_imported() -> None:
    """Not vacuous: the same probe reports peers/ once something on the path imports it."""
    probe = _PROBE.replace("import tierckptd.commit,", "import tierckptd.peers.cluster,")
    assert "tierckptd.peers.cluster" in _peer_modules_after(probe)
