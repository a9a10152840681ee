"""Routing policies as pure functions of load snapshots, and the router config's refusals."""

from __future__ import annotations

import pytest

from splitserve.config.files import ConfigError
from splitserve.request.block_hash import block_keys
from splitserve.router.config import PrefixPolicyConfig, RouterConfig
from splitserve.router.policies import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    WorkerView,
    cached_prefix_blocks,
    make_policy,
)

PROMPT = list(range(1, 42))  # 41 tokens: 10 full blocks of 4


def view(
    address: str,
    running=0,
    waiting=0,
    free=100,
    total=100,
    in_flight=0,
    cached_blocks=0,
    block_size=4,
    keys=None,
) -> WorkerView:
    if keys is None:
        keys = block_keys(PROMPT, block_size)[:cached_blocks]
    return WorkerView(
        address, running, waiting, free, total, block_size, frozenset(keys), in_flight
    )


def test_round_robin_cycles_in_address_order_whatever_the_input_order():
    rr = RoundRobin()
    views = [view("c:1"), view("a:1"), view("b:1")]
    assert [rr.choose(views).address for _ in range(6)] == ["a:1", "b:1", "c:1"] * 2
    assert rr.choose([view("z:1")]).address == "z:1"
    with pytest.raises(ValueError, match="no worker"):
        rr.choose([])


def test_least_loaded_prefers_short_queues_then_free_kv():
    ll = LeastLoaded()
    assert ll.choose([view("a:1", running=3), view("b:1", running=1, waiting=1)]).address == "b:1"
    # equal queues: the larger free fraction wins, whatever the pool sizes
    assert (
        ll.choose([view("a:1", free=50, total=100), view("b:1", free=30, total=40)]).address
        == "b:1"
    )
    # the router's own in-flight count beats a stale poll that still says idle
    assert ll.choose([view("a:1", in_flight=4), view("b:1", running=2)]).address == "b:1"
    # a full tie goes to the first address (stable)
    assert ll.choose([view("b:1"), view("a:1")]).address == "a:1"


def test_prefix_aware_follows_the_longest_cached_prefix():
    pa = PrefixAware()
    views = [view("a:1", cached_blocks=2), view("b:1", cached_blocks=7), view("c:1")]
    assert pa.choose(views, PROMPT).address == "b:1"
    # equal matches: the less loaded one
    views = [view("a:1", cached_blocks=5, running=2), view("b:1", cached_blocks=5, running=1)]
    assert pa.choose(views, PROMPT).address == "b:1"
    # nothing cached anywhere: least loaded
    assert pa.choose([view("a:1", running=2), view("b:1", running=1)], PROMPT).address == "b:1"
    # another prompt's blocks do not count
    other = block_keys(list(range(500, 541)), 4)
    assert pa.choose([view("a:1", keys=other, running=1), view("b:1")], PROMPT).address == "b:1"


def test_prefix_aware_gives_way_to_load_when_queues_are_clearly_unbalanced():
    pa = PrefixAware(PrefixPolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    hot = view("a:1", cached_blocks=10, running=8, waiting=2)
    idle = view("b:1", running=1)
    assert pa.choose([hot, idle], PROMPT).address == "b:1"  # 10 - 1 > 4 and 10 > 1.5 x 1
    mild = view("a:1", cached_blocks=10, running=4)
    assert pa.choose([mild, idle], PROMPT).address == "a:1"  # 4 - 1 <= 4: the cache wins
    assert pa.unbalanced([hot, idle]) and not pa.unbalanced([mild, idle])


def test_prefix_match_uses_each_workers_block_size_and_a_capped_summary():
    # a summary capped to the most recent keys may lack the first blocks: the chained key
    # of block 6 still names the whole 7-block prefix
    capped = view("a:1", keys=block_keys(PROMPT, 4)[6:7])
    assert cached_prefix_blocks(capped, PROMPT) == 7
    big_blocks = view("b:1", block_size=8, keys=block_keys(PROMPT, 8)[:5])
    assert cached_prefix_blocks(big_blocks, PROMPT) == 5
    busy_big = view("b:1", block_size=8, keys=block_keys(PROMPT, 8)[:5], running=1)
    assert PrefixAware().choose([view("c:1"), busy_big], PROMPT).address == "b:1"
    assert (
        PrefixAware(PrefixPolicyConfig(min_match_blocks=6))
        .choose([view("c:1"), busy_big], PROMPT)
        .address
        == "c:1"
    )  # 5 blocks are not worth it here
    assert cached_prefix_blocks(view("d:1", block_size=0, keys=[bytes(16)]), PROMPT) == 0


def test_prefix_match_compares_all_16_bytes_of_a_key():
    # keys that agree in their first 8 bytes (all a 64-bit key would hold) but not after are
    # different prefixes: a worker reporting only such twins has nothing of this prompt
    keys = block_keys(PROMPT, 4)
    twins = [k[:8] + bytes(b ^ 0xFF for b in k[8:]) for k in keys]
    assert all(len(t) == 16 and t != k for t, k in zip(twins, keys))
    assert cached_prefix_blocks(view("a:1", keys=twins), PROMPT) == 0
    assert cached_prefix_blocks(view("a:1", keys=[k[:8] for k in keys]), PROMPT) == 0
    assert cached_prefix_blocks(view("a:1", keys=keys[:3] + twins[3:]), PROMPT) == 3
    views = [view("a:1", keys=twins), view("b:1", cached_blocks=2, running=1)]
    assert PrefixAware().choose(views, PROMPT).address == "b:1"  # the real prefix, though busier


def test_make_policy_and_config_refusals(tmp_path):
    assert {make_policy(n).name for n in ("round_robin", "least_loaded", "prefix_aware")} == {
        "round_robin",
        "least_loaded",
        "prefix_aware",
    }
    base = {"model_path": str(tmp_path)}
    cases = [
        ({"routing": {"decode_policy": "prefix_aware"}}, "decode workers report no prefix cache"),
        ({"routing": {"prefill_policy": "fastest"}}, "routing.prefill_policy"),
        ({"workers": {"prefill": ["nohost"]}}, "not host:port"),
        (
            {"workers": {"prefill": ["h:1"], "decode": ["h:1"]}},
            "both a prefill and a decode worker",
        ),
        ({"workers": {"decode": ["h:1", "h:1"]}}, "lists an address twice"),
        (
            {"registry": {"heartbeat_interval_s": 2, "heartbeat_timeout_s": 1}},
            "must exceed heartbeat_interval_s",
        ),
        ({"max_request_bytes": 2**30}, "exceeds server.max_message_mb"),
        ({"bogus": 1}, "bogus: Extra inputs are not permitted"),
    ]
    for extra, fragment in cases:
        with pytest.raises(ConfigError) as err:
            RouterConfig.load(None, {**{k: v for k, v in base.items()}, **_dotted(extra)})
        assert fragment in str(err.value) and "\n" not in str(err.value), (extra, str(err.value))
    yaml = tmp_path / "router.yaml"
    yaml.write_text("workers: {prefill: ['p:1']}\nrouting: {decode_policy: round_robin}\n")
    cfg = RouterConfig.load(yaml, {"model_path": str(tmp_path), "workers.decode": ["d:1"]})
    assert (cfg.workers.prefill, cfg.workers.decode, cfg.routing.decode_policy) == (
        ("p:1",),
        ("d:1",),
        "round_robin",
    )


def _dotted(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out |= _dotted(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
