"""`--quick`, shared by every bench: the tiniest run that goes through the bench's code paths in
seconds, so that tests/test_bench_quick.py sees a bench break the day it breaks.

A quick run measures nothing worth reading (tiny models, one round, a shared CPU), so its exit
status says only that the code ran and its correctness checks held; its timing verdict is still
printed, marked as such, and never turned into a PASS it did not earn.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

HELP = "the tiniest sizes, one round: checks that the bench runs, measures nothing (seconds)"
NOTE = "quick run: tiny sizes, its numbers are not measurements; exit 0 because the code paths ran"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_text(*, quick: bool) -> list[str]:
    """The benches' corpus: the standard library's top-level *.py files; under `--quick` the few
    named a*.py, prepared in a blink."""
    return [str(STDLIB / ("a*.py" if quick else "*.py"))]


def parse(p: argparse.ArgumentParser, tiny: dict[str, object], argv: list[str] | None = None) -> argparse.Namespace:
    """Add `--quick` to `p` and parse; under `--quick` the `tiny` values replace the defaults
    (flags given explicitly still win)."""
    p.add_argument("--quick", action="store_true", help=HELP)
    if p.parse_known_args(argv)[0].quick:  # as argparse reads it (--qui too)
        p.set_defaults(**tiny)
    return p.parse_args(argv)


def exit_code(passed: bool, *, quick: bool, correct: bool = True) -> int:
    """0 when the bench passed; under `--quick`, 0 when its correctness checks held (timings at
    tiny sizes decide nothing), after saying so."""
    if quick:
        print(NOTE if correct else "quick run: a correctness check failed (see above)")
        return 0 if correct else 1
    return 0 if passed else 1
