"""Write tests/file_seconds.json, each test file's seconds (setup, call and teardown of its tests
summed) from a JUnit report of a whole run: `python -m pytest -n 2 --junitxml=REPORT` then
`python tests/file_seconds.py REPORT`. conftest.py hands the longest files out first."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def file_seconds(report: Path) -> dict[str, float]:
    """{tests/...py: seconds} from a pytest JUnit XML report (its classname is the dotted module path)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        while parts and not parts[-1].startswith("test_"):  # a test class's name follows its module
            parts.pop()
        if parts:
            seconds["/".join(parts) + ".py"] += float(case.get("time", 0.0))
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    out = Path(__file__).with_name("file_seconds.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in file_seconds(Path(sys.argv[1])).items()}, indent=1) + "\n")
    print(f"wrote {out}")
