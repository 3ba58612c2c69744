"""Exact sums for the performance model (pure, no MPI, no array library).

A model whose blocks are all alike prices one block and counts it ``L`` times. Summing ``L`` equal floats
one after the other and multiplying one of them by ``L`` round differently; both are exact here: an
:class:`ExactSum` keeps its terms as floats whose sum is the exact sum of everything added (a term added
``n`` times is ``x * n`` rounded plus its exact rounding error), and its value is that sum correctly rounded
(:func:`math.fsum`). A prediction that adds one block's terms ``L`` times is therefore bit for bit the
prediction that adds every layer's, in whatever order.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Dict, Hashable, Iterable, List

#: terms an :class:`ExactSum` holds before it folds them into the few floats of their exact sum
_FOLD_AT = 4096


def expansion(values: Iterable[float]) -> List[float]:
    """A few floats whose exact sum is the exact sum of ``values`` (finite floats); the largest first. Each
    pass takes the correctly rounded sum of what is left (:func:`math.fsum`); a sum of floats is a dyadic
    number, so what is left reaches 0 after a handful of passes (53 bits each)."""
    values = list(values)
    out: List[float] = []
    for _ in range(64):
        s = math.fsum(values + [-p for p in out])
        if s == 0.0 or not math.isfinite(s):
            break
        out.append(s)
    else:  # not reached for finite floats (their sum spans at most about 2,100 bits)
        out = [math.fsum(values)]
    return out


class ExactSum:
    """The exact sum of floats added one by one or ``n`` at a time; ``float(s)`` is it correctly rounded."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: List[float] = []

    def add(self, x: float) -> None:
        self.parts.append(x)
        if len(self.parts) > _FOLD_AT:
            self._fold()

    def extend(self, xs: Iterable[float]) -> None:
        self.parts.extend(xs)
        if len(self.parts) > _FOLD_AT:
            self._fold()

    def add_times(self, x: float, n: int) -> None:
        """``x`` added ``n`` times (``n >= 0``; an integer below 2**53): ``x * n`` and its exact rounding error."""
        if n == 0 or x == 0.0:
            return
        hi = x * n
        if not math.isfinite(hi):
            self.parts.append(hi)
            return
        lo = float(Fraction(x) * n - Fraction(hi))  # exactly a float: a multiple of x's ulp below hi's
        self.parts.append(hi)
        if lo:
            self.parts.append(lo)

    def _fold(self) -> None:
        if all(math.isfinite(p) for p in self.parts):
            self.parts = expansion(self.parts)
        else:
            self.parts = [math.fsum(self.parts)]

    def __float__(self) -> float:
        return math.fsum(self.parts)


class Sums:
    """``key -> ExactSum`` in the order keys were first added; :meth:`floats` is the plain dict of their
    values (that order kept: a later ``sum(d.values())`` adds them in it)."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: Dict[Hashable, ExactSum] = {}

    def _of(self, key: Hashable) -> ExactSum:
        s = self.sums.get(key)
        if s is None:
            s = self.sums[key] = ExactSum()
        return s

    def add(self, key: Hashable, x: float) -> None:
        s = self.sums.get(key)
        if s is None:
            s = self.sums[key] = ExactSum()
        parts = s.parts  # ExactSum.add, inlined: a timeline adds here for every transfer it serves
        parts.append(x)
        if len(parts) > _FOLD_AT:
            s._fold()

    def add_times(self, key: Hashable, x: float, n: int) -> None:
        self._of(key).add_times(x, n)

    def extend(self, key: Hashable, xs: Iterable[float]) -> None:
        self._of(key).extend(xs)

    def floats(self) -> Dict[Hashable, float]:
        return {k: float(s) for k, s in self.sums.items()}
