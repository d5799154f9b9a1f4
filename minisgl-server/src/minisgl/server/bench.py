"""``minisgl bench``: placeholder, filled in by the benchmark module."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("bench", help="benchmarks (minisgl vs HF)")
    p.set_defaults(func=lambda args: 0)
