"""Writes the configuration reference (docs/configuration.md) from the pydantic models, so the
docs cannot drift from the code: `python -m splitserve.cli.config_reference [--check]`.

Every key is a dotted path usable in a service's YAML (`--config`) or as its override."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _models() -> list[tuple[str, type[BaseModel]]]:
    from splitserve.decode_worker.config import DecodeWorkerConfig
    from splitserve.prefill_worker.config import PrefillWorkerConfig
    from splitserve.router.config import RouterConfig

    return [
        ("splitserve router", RouterConfig),
        ("splitserve prefill-worker", PrefillWorkerConfig),
        ("splitserve decode-worker", DecodeWorkerConfig),
    ]


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def _optional_section(annotation) -> type[BaseModel] | None:
    """M for a field typed `M | None` with M a model (a section that is off when unset)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0]
    return None


def _rows(model: type[BaseModel], prefix: str = "", within: str = "") -> list[str]:
    """One row per key; an optional section (`server.tls`) gets its own row, then its keys',
    whose "required" holds only when the section is set."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _rows(ann, key + ".", within)
            continue
        section = _optional_section(ann)
        if section is not None:
            desc = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{key}` | `{section.__name__} | None` | `None` |  | {desc} |")
            rows += _rows(section, key + ".", key)
            continue
        default = (
            (f"required when `{within}` is set" if within else "required")
            if field.is_required()
            else f"`{field.get_default(call_default_factory=True)!r}`"
        )
        limits = ", ".join(f"`{m!r}`" for m in field.metadata)
        desc = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{key}` | `{_type_name(ann)}` | {default} | {limits} | {desc} |")
    return rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the pydantic models by `python -m splitserve.cli.config_reference`; "
        "a test fails when it is stale. Each service loads YAML with `--config FILE` and its flags "
        "override single keys; unknown keys and out-of-range values fail at start with one line "
        "naming the key.",
        "",
    ]
    for title, model in _models():
        out += [
            f"## `{title}` ({model.__name__})",
            "",
            "| key | type | default | limits | meaning |",
            "| --- | --- | --- | --- | --- |",
            *_rows(model),
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--check", action="store_true", help="exit 1 when docs/configuration.md is stale"
    )
    args = p.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is stale: run python -m splitserve.cli.config_reference", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
