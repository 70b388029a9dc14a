"""Each test module's seconds in a run, from pytest's JUnit XML, into tests/durations.json
(which tests/conftest.py orders the parallel groups by):

    python -m tests.support.durations run.xml [--out tests/durations.json] [--table]

`--table`: the modules and groups by time instead, the heaviest first.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_of(classname: str) -> str:
    """A JUnit classname (the module's dotted path, then any test class) -> the module's file."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (REPO / path).is_file():
            return path
    return classname


def seconds_by_module(junit: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = module_of(case.get("classname", ""))
        out[module] = out.get(module, 0.0) + float(case.get("time", 0) or 0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("junit", type=Path)
    p.add_argument("--out", type=Path, default=REPO / "tests" / "durations.json")
    p.add_argument("--table", action="store_true")
    a = p.parse_args()
    seconds = seconds_by_module(a.junit)
    if a.table:
        for module, took in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"{took:8.1f}  {module}")
        print(f"{sum(seconds.values()):8.1f}  in all ({len(seconds)} modules)")
        return
    a.out.write_text(json.dumps({m: round(t, 1) for m, t in sorted(seconds.items())}, indent=1) + "\n")
    print(f"{a.out}: {len(seconds)} modules, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main()
