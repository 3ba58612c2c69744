"""Short forms of the descriptive strings stored in traces (for table columns and plot labels)."""

from __future__ import annotations

import math


def short_label(text, default: str = "") -> str:
    """The part before the first parenthesis: ``"oag,ors (prefetch depth 1)"`` -> ``"oag,ors"``,
    ``"poll (Testsome ...)"`` -> ``"poll"``. None, NaN (a missing cell of a table) and an empty
    string give ``default``."""
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return default
    return str(text).split(" (")[0].strip() or default
