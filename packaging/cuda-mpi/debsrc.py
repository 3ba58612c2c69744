"""Print ``deb-src`` lines (one-line format) for every ``deb`` entry of the system's apt configuration.

Usage: python3 debsrc.py /etc/apt/sources.list /etc/apt/sources.list.d

Reads one-line ``*.list`` files and deb822 ``*.sources`` files; keeps each entry's ``signed-by``.
build.sh feeds the result to a private apt configuration, so the system's own is never changed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def one_line(text: str):
    """``deb [opts] URI SUITE COMP...`` lines -> ``deb-src`` lines."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] == "deb":
            yield "deb-src " + " ".join(words[1:])


def deb822(text: str):
    """deb822 stanzas whose Types include ``deb`` -> one ``deb-src`` line per URI and suite."""
    for stanza in text.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[0].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        options = f"[signed-by={fields['signed-by']}] " if fields.get("signed-by", "").startswith("/") else ""
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                yield f"deb-src {options}{uri} {suite} {fields.get('components', '')}".rstrip()


def main(paths) -> int:
    seen = []
    for path in map(Path, paths):
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            if not f.is_file():
                continue
            if f.suffix == ".list" or f.name == "sources.list":
                seen += one_line(f.read_text())
            elif f.suffix == ".sources":
                seen += deb822(f.read_text())
    print("\n".join(dict.fromkeys(seen)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
