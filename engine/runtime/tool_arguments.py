"""A tool call's argument values read as the types the tool's JSON schema declares: a model writes each
qwen_xml parameter as plain text, and "3" must reach the tool as 3 where the schema says integer."""

from __future__ import annotations

import json
import math


def parameter_schemas(tools: list | None) -> dict[str, dict[str, dict]]:
    """Each tool's parameter schemas by tool and parameter name, from OpenAI-style specs; other entries skipped."""
    schemas = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = (
            {key: schema for key, schema in properties.items() if isinstance(schema, dict)}
            if isinstance(properties, dict)
            else {}
        )
    return schemas


def declared_types(schema: dict | None) -> list[str]:
    """The JSON-schema types a parameter's schema allows: its type, a list of types, or its anyOf/oneOf options'
    types; [] when it declares none."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    options = schema.get("anyOf") or schema.get("oneOf")
    return (
        [option["type"] for option in options if isinstance(option, dict) and isinstance(option.get("type"), str)]
        if isinstance(options, list)
        else []
    )


def json_text(value) -> str:
    """value as JSON text, non-ASCII kept as it is."""
    return json.dumps(value, ensure_ascii=False)


def json_value(text: str, otherwise=None):
    """The value text holds as JSON, or `otherwise` when it is not JSON (or nests too deeply to read)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return otherwise


_NOT_THAT_TYPE = object()


def _as_type(value: str, kind: str):
    """value read as a JSON-schema type, or _NOT_THAT_TYPE when it does not read as one."""
    text = value.strip()
    if kind == "string":
        return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NOT_THAT_TYPE)
    parsed = json_value(text, _NOT_THAT_TYPE)
    if isinstance(parsed, float) and not math.isfinite(parsed):  # json.loads reads NaN, which JSON cannot hold
        return _NOT_THAT_TYPE
    is_number = isinstance(parsed, (int, float)) and not isinstance(parsed, bool)
    if kind == "integer" and is_number and float(parsed).is_integer():
        return int(parsed)
    if kind == "number" and is_number:
        return parsed
    wanted = {"object": dict, "array": list, "null": type(None)}.get(kind)
    return parsed if wanted is not None and isinstance(parsed, wanted) else _NOT_THAT_TYPE


def convert_value(value: str, types: list[str]):
    """value as the first declared type it reads as (string tried last); the string itself when none fits."""
    for kind in sorted(types, key=lambda kind: kind == "string"):
        converted = _as_type(value, kind)
        if converted is not _NOT_THAT_TYPE:
            return converted
    return value
