"""docs/configuration.md is generated from the pydantic models and must be current."""

from __future__ import annotations

from splitserve.cli import config_reference


def test_configuration_reference_is_current():
    assert config_reference.main(["--check"]) == 0, "run: python -m splitserve.cli.config_reference"


def test_reference_lists_nested_keys_with_defaults_and_limits():
    text = config_reference.render()
    for key in (
        "engine.cache.block_size",
        "kv_transfer.failure_policy",
        "routing.prefill_policy",
        "lease_ttl_s",
    ):
        assert f"| `{key}` |" in text, key
    assert "| `engine.cache.block_size` | `int` | `16` |" in text
