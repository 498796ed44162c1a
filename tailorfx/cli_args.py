"""Argument types and the parser class of the command line (`tailorfx` and `tailorfx demo`): a bad
argument is one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import sys


class ArgParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit code 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value
