"""Named fault points (`tierckptd.ops.faults`): the registry matches the calls in the
daemon's source, `TIERCKPT_FAULT` parses or is refused with the known names, and an armed
point kills, sleeps or raises as asked (at the Nth hit when told)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tierckptd.ops import faults
from tierckptd.ops.faults import POINTS, FaultSpecError, InjectedFault, fault, parse

DAEMON = Path(__file__).resolve().parents[3] / "server" / "tierckptd"


def _calls() -> dict[str, list[str]]:
    """Every `fault(...)` call in the daemon's source: {point or '<not a literal>': [where]}."""
    found: dict[str, list[str]] = {}
    for path in sorted(DAEMON.rglob("*.py")):
        if path.name == "faults.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name != "fault":
                continue
            arg = node.args[0] if node.args else None
            point = (
                arg.value
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                else "<not a literal>"
            )
            found.setdefault(point, []).append(f"{path.relative_to(DAEMON)}:{node.lineno}")
    return found


def test_every_registered_point_is_called_and_every_call_is_registered() -> None:
    calls = _calls()
    unknown = {p: where for p, where in calls.items() if p not in POINTS}
    assert not unknown, f"fault() calls naming no registered point (add them to POINTS): {unknown}"
    uncalled = sorted(set(POINTS) - set(calls))
    assert not uncalled, f"registered fault points never called in server/: {uncalled}"
    twice = {p: where for p, where in calls.items() if len(where) > 1}
    assert not twice, f"a fault point must name one moment, not several: {twice}"


def test_parse_accepts_actions_counts_and_lists() -> None:
    armed = parse(" commit.after_manifest:kill , drain.marker:delay=2.5,peer.push.chunk:error@3 ")
    assert {p: (s.action, s.seconds, s.at) for p, s in armed.items()} == {
        "commit.after_manifest": ("kill", 0.0, 0),
        "drain.marker": ("delay", 2.5, 0),
        "peer.push.chunk": ("error", 0.0, 3),
    }
    assert parse("") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("commit.after_manfest:kill", "unknown fault point 'commit.after_manfest'; known points"),
        ("commit.after_manifest", "is not POINT:ACTION"),
        ("commit.after_manifest:explode", "unknown action 'explode'"),
        ("commit.after_manifest:delay=soon", "delay=SECONDS needs a finite number"),
        ("commit.after_manifest:delay=-1", "delay=SECONDS needs a finite number"),
        ("commit.after_manifest:kill@0", "@N needs a whole number N >= 1"),
        ("save.begin:kill,save.begin:error", "named twice"),
    ],
)
def test_parse_refuses_with_the_fix(text: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message.replace("(", r"\(")):
        parse(text)


def test_inert_point_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_ARMED", {})
    fault("save.begin")
    monkeypatch.setattr(faults, "_ARMED", parse("save.reserve:error"))
    fault("save.begin")  # another point is armed: still nothing here


def test_error_raises_an_oserror_or_the_call_sites_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_ARMED", parse("save.begin:error,peer.publish:error"))
    with pytest.raises(InjectedFault, match="injected fault at save.begin") as info:
        fault("save.begin")
    assert isinstance(info.value, OSError)
    with pytest.raises(KeyError, match="peer"):
        fault("peer.publish", lambda: KeyError("peer"))


def test_at_n_fires_on_the_nth_hit_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_ARMED", parse("drain.upload:error@3"))
    fault("drain.upload")
    fault("drain.upload")
    with pytest.raises(InjectedFault):
        fault("drain.upload")
    fault("drain.upload")


def test_delay_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(faults, "_ARMED", parse("drain.marker:delay=2.5"))
    monkeypatch.setattr("tierckptd.ops.faults.time.sleep", slept.append)
    fault("drain.marker")
    fault("drain.marker")
    assert slept == [2.5, 2.5]


def _python(code: str, env_value: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, faults.ENV: env_value}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )


def test_kill_sigkills_the_process() -> None:
    code = "from tierckptd.ops.faults import fault; fault('save.begin'); print('survived')"
    proc = _python(code, "save.begin:kill")
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)
    assert "survived" not in proc.stdout
    assert "fault save.begin fires: kill" in proc.stderr  # the warning comes first


def test_daemon_refuses_a_typo_at_start() -> None:
    code = (
        "import runpy, sys; sys.argv = ['tierckptd', '--config', 'unused.toml']; "
        "runpy.run_module('tierckptd', run_name='__main__')"
    )
    proc = _python(code, "commit.after_manfest:kill")
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "tierckptd: TIERCKPT_FAULT: unknown fault point 'commit.after_manfest'" in proc.stderr
    assert "commit.after_manifest" in proc.stderr  # the known names, to fix the typo
