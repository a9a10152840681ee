"""What the router keeps of a prefill worker's GetLoad prefix keys (router/probing.py): exactly
the 16-byte ones. A key of any other length (a worker of another version, a corrupt reply) is
left out and logged once per worker, and never fails the probe or the prefix match."""

from __future__ import annotations

import logging

from splitserve.protos import worker_pb2
from splitserve.request.block_hash import block_keys
from splitserve.router.policies import cached_prefix_blocks
from splitserve.router.probing import valid_prefix_keys
from splitserve.router.worker_state import PREFILL, Worker

PROMPT = list(range(1, 42))  # 10 full blocks of 4


def _worker(address: str) -> Worker:
    # no channel or stubs: valid_prefix_keys reads only the worker's name and warned flag
    return Worker(PREFILL, address, True, None, None, None)


def _decoded_load(keys: list[bytes]) -> worker_pb2.WorkerLoad:
    """A GetLoad reply carrying `keys`, as the probe decodes it off the wire."""
    load = worker_pb2.WorkerLoad(role=PREFILL, block_size=4, free_blocks=9, total_blocks=9)
    load.prefix_cache.block_keys.extend(keys)
    load.prefix_cache.num_cached_blocks = len(keys)
    return worker_pb2.WorkerLoad.FromString(load.SerializeToString())


def test_malformed_keys_are_ignored_and_logged_once_per_worker(caplog):
    keys = block_keys(PROMPT, 4)
    sent = [keys[0][:8], keys[1], b"", keys[2] + b"\x00", keys[3], bytes(32)]
    load = _decoded_load(sent)
    w, other = _worker("10.0.0.1:50061"), _worker("10.0.0.2:50061")
    with caplog.at_level(logging.WARNING, logger="splitserve.router.probing"):
        first = valid_prefix_keys(w, load.prefix_cache.block_keys)
        second = valid_prefix_keys(w, load.prefix_cache.block_keys)  # the next poll: silent
        valid_prefix_keys(other, load.prefix_cache.block_keys)  # another worker: its own line
    assert first == second == {keys[1], keys[3]}
    lines = [r.getMessage() for r in caplog.records if r.name == "splitserve.router.probing"]
    assert len(lines) == 2, lines
    assert "10.0.0.1:50061" in lines[0] and "10.0.0.2:50061" in lines[1]
    assert "4 prefix-cache keys not 16 bytes long" in lines[0] and "\n" not in lines[0]
    # what is kept still routes: block 3's chained key names the whole 4-block prefix
    w.load, w.prefix_keys = load, first
    assert cached_prefix_blocks(w.view(), PROMPT) == 4


def test_only_malformed_or_no_keys_leave_an_empty_set_and_no_match(caplog):
    keys = block_keys(PROMPT, 4)
    w = _worker("10.0.0.3:50061")
    with caplog.at_level(logging.WARNING, logger="splitserve.router.probing"):
        assert valid_prefix_keys(w, _decoded_load([]).prefix_cache.block_keys) == frozenset()
        assert not w.keys_warned and not caplog.records  # nothing wrong, nothing logged
        truncated = [k[:8] for k in keys]  # what a 64-bit key would have carried
        w.prefix_keys = valid_prefix_keys(w, _decoded_load(truncated).prefix_cache.block_keys)
    assert w.prefix_keys == frozenset() and w.keys_warned
    w.load = _decoded_load(truncated)
    assert cached_prefix_blocks(w.view(), PROMPT) == 0
