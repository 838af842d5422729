"""A TOML writer for the plain data the launcher writes (tables, arrays of tables,
strings, numbers, booleans, arrays of scalars); tomllib reads but does not write."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["dumps"]


def dumps(table: Mapping[str, Any]) -> str:
    lines: list[str] = []
    _write_table(lines, table, ())
    return "\n".join(lines).lstrip("\n") + "\n"


def _write_table(lines: list[str], table: Mapping[str, Any], path: tuple[str, ...]) -> None:
    nested = {}
    for key, value in table.items():
        if isinstance(value, Mapping) or (_is_array_of_tables(value)):
            nested[key] = value
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in nested.items():
        header = ".".join(_key(part) for part in (*path, key))
        if isinstance(value, Mapping):
            lines += ["", f"[{header}]"]
            _write_table(lines, value, (*path, key))
        else:
            for item in value:
                lines += ["", f"[[{header}]]"]
                _write_table(lines, item, (*path, key))


def _is_array_of_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, Mapping) for item in value)


def _key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key)
    return key if bare else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
