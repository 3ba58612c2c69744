"""Output files: nothing is replaced unless the user asked for it."""

from __future__ import annotations

import os
from typing import Optional

from fourd_mpi.errors import ConfigError


def refuse_overwrite(path: Optional[str], force: bool, flag: str = "--force") -> None:
    """Raise :class:`ConfigError` when ``path`` exists and ``force`` is false (``path`` None: no output).

    Every command that writes a file checks this before it reads or computes anything, so a
    refused run costs nothing.
    """
    if path and os.path.exists(path) and not force:
        raise ConfigError(f"{path} already exists (use {flag} to replace it)")
