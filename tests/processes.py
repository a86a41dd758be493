"""The processes a test may have left behind, found by what their command lines mention (Linux /proc)."""

from __future__ import annotations

from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """"PID: command line" of every process whose command line contains `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(f"{cmdline.parent.name}: {args}")
    return found
