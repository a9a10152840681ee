"""Pieces of tensor parallelism that need no second process: the shard map of a handle and the
pull plan, rank slices of the weights, the lease mirror that followers serve pulls from."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors import safe_open

from splitserve.config.engine_config import ParallelConfig
from splitserve.config.hf_config import load_model_config
from splitserve.engine.model import CausalLM
from splitserve.engine.parallel import TPGroup
from splitserve.engine.weights import load_weights
from splitserve.kvtransfer.descriptor import PoolSpec, make_handle
from splitserve.kvtransfer.server import LeaseLookupError
from splitserve.kvtransfer.shards import shard_sources
from splitserve.prefill_worker.tp_follower import MirroredLeaseTable, MirrorLeaseSource


def _handle(ports):
    spec = PoolSpec(3, 4, 16, 4, torch.float32, "h")
    return make_handle(
        spec,
        host="h0",
        port=ports[0],
        lease_id="L",
        request_id="R",
        num_blocks=2,
        num_tokens=8,
        ttl_s=5,
        shard_ports=ports,
    )


def test_shard_map_and_pull_order():
    h = _handle([1001, 1002, 1003, 1004])
    assert [(s.tp_rank, s.kv_head_start, s.kv_head_end, s.address.port) for s in h.shards] == [
        (0, 0, 1, 1001),
        (1, 1, 2, 1002),
        (2, 2, 3, 1003),
        (3, 3, 4, 1004),
    ]
    plan = shard_sources(h)
    assert [s.tp_rank for s in plan] == [1, 2, 3, 0]  # rank 0's delivery releases the lease: last
    assert not _handle([1001]).shards
    assert [(s.port, s.head_start, s.head_end) for s in shard_sources(_handle([1001]))] == [
        (1001, 0, 4)
    ]
    gap = _handle([1001, 1002])
    gap.shards[1].kv_head_start = 3
    with pytest.raises(ValueError, match="do not cover the KV heads"):
        shard_sources(gap)
    short = _handle([1001, 1002])
    short.shards[1].kv_head_end = 3
    with pytest.raises(ValueError, match="end at KV head 3"):
        shard_sources(short)
    blind = _handle([1001, 1002])
    blind.shards[1].address.port = 0
    with pytest.raises(ValueError, match=r"shards\[rank 1\].address"):
        shard_sources(blind)


def test_each_rank_loads_its_slices(tiny_qwen2):
    cfg = load_model_config(tiny_qwen2)
    with safe_open(str(tiny_qwen2 / "model.safetensors"), framework="pt") as f:
        q, k = (
            f.get_tensor("model.layers.1.self_attn.q_proj.weight"),
            f.get_tensor("model.layers.1.self_attn.k_proj.weight"),
        )
        kb, o = (
            f.get_tensor("model.layers.1.self_attn.k_proj.bias"),
            f.get_tensor("model.layers.1.self_attn.o_proj.weight"),
        )
        up, down = (
            f.get_tensor("model.layers.1.mlp.up_proj.weight"),
            f.get_tensor("model.layers.1.mlp.down_proj.weight"),
        )
    for rank in range(2):
        model = CausalLM(cfg, torch.float32, "cpu", TPGroup(rank, 2))
        load_weights(model, tiny_qwen2)
        layer = model.layers[1]
        qs, ks, inter = (
            32,
            16,
            88,
        )  # 2 of 4 q heads, 1 of 2 KV heads (head_dim 16), 88 of 176 columns
        torch.testing.assert_close(layer.qkv_weight[:qs], q[rank * qs : (rank + 1) * qs])
        torch.testing.assert_close(layer.qkv_weight[qs : qs + ks], k[rank * ks : (rank + 1) * ks])
        torch.testing.assert_close(layer.qkv_bias[qs : qs + ks], kb[rank * ks : (rank + 1) * ks])
        torch.testing.assert_close(layer.o_weight, o[:, rank * qs : (rank + 1) * qs])
        torch.testing.assert_close(
            layer.gate_up_weight[inter:], up[rank * inter : (rank + 1) * inter]
        )
        torch.testing.assert_close(layer.down_weight, down[:, rank * inter : (rank + 1) * inter])
        assert model.embed.shape == (
            cfg.vocab_size // 2,
            cfg.hidden_size,
        )  # vocab rows: test_tp_vocab.py


def test_parallel_config_refuses_bad_sizes(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="intermediate_size"):
        load_model_config(tiny_llama).model_copy(
            update={"num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 170}
        ).check_tensor_parallel(4)


def test_lease_mirror_follows_rank0_and_holds_pulled_blocks():
    sent = []
    table = MirroredLeaseTable(sent.append)
    a = table.grant("ra", (3, 4), 8, 30)
    b = table.grant("rb", (5,), 4, 30)
    mirror = MirrorLeaseSource()
    for cmd in sent:
        (mirror.grant if cmd[0] == "lease_grant" else mirror.drop)(*cmd[1:])
    assert asyncio.run(mirror.begin_pull(a.lease_id, "ra")) == [3, 4]  # pinned by the pull
    with pytest.raises(LeaseLookupError, match="another request"):
        asyncio.run(mirror.begin_pull(b.lease_id, "ra"))
    sent.clear()
    table.pop(a.lease_id)
    table.pop_request("rb")
    assert sent == [("lease_drop", [a.lease_id]), ("lease_drop", [b.lease_id])]
    for cmd in sent:
        mirror.drop(*cmd[1:])
    with pytest.raises(LeaseLookupError, match="no such lease"):  # dropped: fails at once, no wait
        asyncio.run(mirror.begin_pull(b.lease_id, "rb"))
    assert mirror._zombies == {a.lease_id}  # no forward may reuse its blocks while it is read
    mirror.end_pull(a.lease_id, True)
    mirror.wait_quiet()  # returns: nothing pinned any more
