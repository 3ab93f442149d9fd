"""Per-test durations of a pytest run, from its JUnit XML: every test's time (setup, call
and teardown together), slowest first, into a table file; prints the slowest tests and
the slowest files, so CI shows where the suite's time goes.

Usage: durations.py JUNIT_XML TABLE [--top N]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_id(classname: str, name: str, root: Path) -> str:
    """pytest's node id back from JUnit's dotted classname (module path, then classes)."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        module = "/".join(parts[:i]) + ".py"
        if (root / module).is_file():
            return "::".join([module, *parts[i:], name])
    return f"{classname}::{name}"


def durations(junit: Path, root: Path) -> list[tuple[float, str, str]]:
    """(seconds, outcome, test id) for every test case in the report, slowest first."""
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        test = test_id(case.get("classname", ""), case.get("name", ""), root)
        rows.append((float(case.get("time", 0.0)), outcome, test))
    return sorted(rows, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path)
    parser.add_argument("table", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    if not args.junit.is_file():
        print(f"durations: no {args.junit} (pytest did not get to write it)", file=sys.stderr)
        return 1
    rows = durations(args.junit, Path.cwd())
    total = sum(seconds for seconds, _, _ in rows)
    args.table.write_text(
        f"# {len(rows)} tests, {total:.1f} s in all (setup + call + teardown each)\n"
        + "".join(f"{seconds:9.2f}  {outcome:8}  {test}\n" for seconds, outcome, test in rows)
    )
    by_file: dict[str, float] = defaultdict(float)
    for seconds, _, test in rows:
        by_file[test.split("::", 1)[0]] += seconds
    print(f"\n{len(rows)} tests, {total:.1f} s summed; every test's time: {args.table}")
    print(f"slowest {args.top} tests:")
    for seconds, outcome, test in rows[: args.top]:
        print(f"{seconds:9.2f}  {outcome:8}  {test}")
    print(f"slowest {min(args.top, 10)} files:")
    for name, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[: min(args.top, 10)]:
        print(f"{seconds:9.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
