"""What a check reports: a problem names the field, the values and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


class InvalidJob(ValueError):
    """A job that cannot run; `problems` holds its errors (warnings are dropped)."""

    def __init__(self, problems: list[Problem]):
        self.problems = errors(problems)
        super().__init__("; ".join(str(p) for p in self.problems))


def counted(n: Any, noun: str) -> str:
    """`1 node`, `2 nodes`, `1 process`, `4 processes` (a count that is not one takes the plural)."""
    if n == 1 and not isinstance(n, bool):
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n} {noun}s"
