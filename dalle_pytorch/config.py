"""`flag`: a dataclass field with a help text, so a config dataclass is also its own command-line spec."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def flag(default: Any, help: str, choices: tuple | None = None) -> Any:
    meta = {"help": help} if choices is None else {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
