"""The grammar engines benchmark's cases (grammar_engines.py): the engines measured, the mid-size
JSON schema and its renamed variants, and the JSON Schema features each engine is checked on."""

from __future__ import annotations

import copy

ENGINES = {  # module -> the pip requirement measured
    "llguidance": "llguidance==1.9.1",
    "xgrammar": "xgrammar==0.2.8",
    "outlines_core": "outlines-core==0.2.14",
}

MID_SCHEMA = {  # mid-size: nested objects, arrays, enums, bounds, formats a form-filling app sends
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
        "status": {"enum": ["active", "inactive", "banned", "pending"]},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "DE", "FR", "JP", "BR"]},
            },
            "required": ["street", "city", "country"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "qty", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "email", "status", "address", "orders"],
    "additionalProperties": False,
}


def mid_schemas(n: int) -> list[dict]:
    """`MID_SCHEMA` and n-1 variants with every property renamed (`_1`, `_2`, ...) and the
    bounds shifted: the same shape, a different grammar text, so no compile cache hits."""

    def rename(node: object, i: int) -> object:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "properties":
                    out[k] = {f"{p}_{i}": rename(s, i) for p, s in v.items()}
                elif k == "required":
                    out[k] = [f"{p}_{i}" for p in v]
                elif k in ("maxLength", "maxItems") and isinstance(v, int):
                    out[k] = v + i
                else:
                    out[k] = rename(v, i)
            return out
        if isinstance(node, list):
            return [rename(x, i) for x in node]
        return node

    return [copy.deepcopy(MID_SCHEMA)] + [rename(MID_SCHEMA, i) for i in range(1, n)]


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props)}


# (feature, schema, valid instances, invalid instances: each breaks only that feature)
FEATURES = [
    (
        "nested objects",
        _obj({"a": _obj({"b": {"type": "integer"}, "c": _obj({"d": {"type": "boolean"}})})}),
        [{"a": {"b": 1, "c": {"d": True}}}],
        [{"a": {"b": "x", "c": {"d": True}}}, {"a": {"b": 1, "c": {}}}],
    ),
    (
        "array minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [[1, 2], [1, 2, 3]],
        [[1], [1, 2, 3, 4]],
    ),
    ("enum", {"enum": ["red", "green", 3]}, ["green", 3], ["blue", 4]),
    (
        "number minimum/maximum",
        _obj(
            {
                "i": {"type": "integer", "minimum": 10, "maximum": 20},
                "x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            }
        ),
        [{"i": 15, "x": 1.25}, {"i": 10, "x": -1.5}],
        [{"i": 21, "x": 0}, {"i": 9, "x": 0}, {"i": 15, "x": 3}, {"i": 15, "x": -2}],
    ),
    (
        "string pattern",
        {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
        ["abc-12"],
        ["abc-1x", "ab-12"],
    ),
    (
        "string minLength/maxLength",
        {"type": "string", "minLength": 2, "maxLength": 4},
        ["ab", "abcd"],
        ["a", "abcde"],
    ),
    (
        "anyOf",
        {"anyOf": [{"type": "integer"}, _obj({"k": {"type": "string"}})]},
        [5, {"k": "v"}],
        ["s", True, {"j": "v"}],
    ),
    (
        "$ref/$defs",
        {
            "$defs": {"pt": _obj({"x": {"type": "integer"}})},
            "type": "array",
            "items": {"$ref": "#/$defs/pt"},
            "maxItems": 3,
        },
        [[{"x": 1}, {"x": 2}]],
        [[{"y": 1}], [1]],
    ),
    (
        "additionalProperties false",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": False,
        },
        [{"a": 1}, {}],
        [{"a": 1, "b": 2}, {"b": 2}],
    ),
    ("const", _obj({"v": {"const": "fixed"}}), [{"v": "fixed"}], [{"v": "other"}]),
    (
        "format date-time",
        {"type": "string", "format": "date-time"},
        ["2024-01-02T03:04:05Z", "2024-01-02T03:04:05.5+02:00"],
        ["not a date", "2024-13-02T03:04:05Z"],
    ),
]
