"""Generated JSON schemas for the structured-output tests, every one bounded (maxLength,
maxItems, number ranges, enums) so that a random-weight model ends inside max_tokens, and
a check that an instance validates (jsonschema, with a format checker off)."""

from __future__ import annotations

import random

import jsonschema

MAX_TOKENS = 160  # enough for every generated schema's longest instance at the tiny vocab


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["int", "num", "str", "enum", "bool"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "num":
        # multipleOf bounds the decimals: a plain number may never stop adding digits
        return {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", 'x"y', "ü"], rng.randint(1, 4))}
    return {"type": "boolean"}


def _node(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth >= 2 or r < 0.35:
        return _leaf(rng)
    if r < 0.55:
        return {"type": "array", "items": _node(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    props = {f"k{i}": _node(rng, depth + 1) for i in range(rng.randint(1, 3))}
    required = sorted(rng.sample(list(props), rng.randint(0, len(props))))
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def schemas(seed: int, count: int) -> list[dict]:
    """`count` object schemas: nested objects, arrays, enums, bounded numbers and strings."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        props = {f"f{i}": _node(rng, 1) for i in range(rng.randint(1, 3))}
        out.append(
            {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        )
    return out


def check_instance(value: object, schema: dict) -> None:
    jsonschema.validate(value, schema)


def features(schema: dict) -> set[str]:
    """What a generated schema exercises: "nested object", "array", "enum", "bounded number",
    "bounded string", "boolean", "optional field" (every object requires a subset of its
    fields; the top level all of them)."""
    found: set[str] = set()

    def walk(node: dict, depth: int) -> None:
        kind = node.get("type")
        if kind == "object":
            if depth:
                found.add("nested object")
            if set(node["properties"]) - set(node["required"]):
                found.add("optional field")
            for child in node["properties"].values():
                walk(child, depth + 1)
        elif kind == "array":
            found.add("array")
            walk(node["items"], depth + 1)
        elif "enum" in node:
            found.add("enum")
        elif kind in ("integer", "number"):
            found.add("bounded number")
        elif kind == "string":
            found.add("bounded string")
        elif kind == "boolean":
            found.add("boolean")

    walk(schema, 0)
    return found
