"""LoRA adapter names, as every service checks them.

An adapter's name travels in requests (GenerationInput.lora_adapter), publishes, replica
status maps and the engine's version stamp: it is kept to a safe alphabet so that it can sit
in any of those (and in a folder name) unquoted.
"""

from __future__ import annotations

import re

from primerl_common.errors import InvalidArgument

__all__ = ["ADAPTER_NAME_PATTERN", "CAPABILITY_LORA", "adapter_name_problem", "check_adapter_name"]

# What an inference replica's GetServiceInfo lists when it loads LoRA adapters.
CAPABILITY_LORA = "lora"
ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None when it can."""
    if not name:
        return "must be set"
    if ADAPTER_NAME_PATTERN.fullmatch(name) is None:
        return f"{name!r} is not an adapter name: 1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"
    return None


def check_adapter_name(name: str, *, field: str) -> None:
    """InvalidArgument naming `field` unless `name` may name an adapter."""
    if (problem := adapter_name_problem(name)) is not None:
        raise InvalidArgument(problem, field=field)
