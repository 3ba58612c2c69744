"""Typed values from text: the parsers behind command-line options and spec values.

Each parser takes the text a user wrote and returns the value, or raises
:class:`argparse.ArgumentTypeError` whose message says what was expected and what
came (argparse prints it as is; :meth:`fourd_mpi.run.options.Option.parse` turns it
into a :class:`~fourd_mpi.errors.ConfigError`). Pure: no MPI, no I/O.
"""

from __future__ import annotations

import argparse
from typing import Callable, List


def int_at_least(minimum: int) -> Callable[[str], int]:
    """A parser of integers ``>= minimum`` whose message says so."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = "positive_int" if minimum == 1 else f"int_at_least_{minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def int_in(minimum: int, maximum: int, what: str = "") -> Callable[[str], int]:
    """A parser of integers in ``[minimum, maximum]`` whose message names both bounds (and, when
    given, ``what`` the bound is about)."""
    base = int_at_least(minimum)

    def parse(text: str) -> int:
        value = base(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum:,} to {maximum:,}"
                                             f"{' (' + what + ')' if what else ''}, got {value:,}")
        return value

    parse.__name__ = f"int_in_{minimum}_{maximum}"
    return parse


#: the most ranks the model, the tuner and the planners accept: 2^24 = 16,777,216, about 400 times
#: the GPU count of the largest machine of today's TOP500 (the enumeration of grids is then bounded)
MAX_RANKS = 1 << 24
rank_count = int_in(1, MAX_RANKS, "the most ranks the model plans for")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def number(text: str) -> float:
    """Any float (``--lr``)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def integer(text: str) -> int:
    """Any integer (``--seed``)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_list(text: str) -> List[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]``."""
    out: List[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 0-3,8, got {text!r}") from None
    return out


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024 ** 2, "mib": 1024 ** 2, "mb": 1000 ** 2,
               "g": 1024 ** 3, "gib": 1024 ** 3, "gb": 1000 ** 3, "t": 1024 ** 4, "tib": 1024 ** 4, "tb": 1000 ** 4}


def byte_size(text: str) -> int:
    """Bytes from ``"3.5GiB"``, ``"800M"``, ``"2GB"`` or ``"1073741824B"`` (K/M/G/T and KiB..TiB are
    powers of 1024, KB..TB of 1000, B bytes); ``0``; a unit is required otherwise (a bare ``40``
    could mean bytes or, as for ``tune --memory-limit``, GiB)."""
    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS or (unit == "" and float(match.group(1)) != 0):
        raise argparse.ArgumentTypeError(f"expected a size with a unit such as 3.5GiB, 800M or 2GB (or 0), "
                                         f"got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])
