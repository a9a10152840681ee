"""UCX buffer views of the KV payload (kvtransfer/buffers.py): the slab and piece views cover
exactly the bytes the framing names, and a device view states UCX's interface without a tensor
per piece."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.kvtransfer.buffers import (
    DeviceBytes,
    byte_views,
    piece_views,
    plan_messages,
    slab_views,
)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("b0, n, pieces_per_slab", [(0, 4, 1), (3, 5, 1), (2, 8, 4), (7, 1, 2)])
def test_slab_views_are_each_layer_kv_run_in_order(b0, n, pieces_per_slab):
    layers, blocks = 3, 16
    kv = torch.randn(layers, 2, blocks, 4, 2, 8).to(torch.bfloat16)
    views = slab_views(kv, b0, n, 2 * layers * pieces_per_slab)
    assert len(views) == 2 * layers * pieces_per_slab
    want = b"".join(
        _bytes(kv[layer, side, b0 : b0 + n]) for layer in range(layers) for side in (0, 1)
    )
    assert b"".join(v.tobytes() for v in views) == want
    assert len({v.nbytes for v in views}) == 1  # even pieces: the receiver sizes its own alike
    views[0][:] = 0  # views, not copies: a receive lands in the pool itself
    assert not kv[0, 0, b0 : b0 + n].reshape(-1).view(torch.uint8)[: views[0].nbytes].any()


@pytest.mark.parametrize("num_messages", [1, 3, 7, 64])
def test_piece_views_cover_the_payload_with_an_uneven_tail(num_messages):
    payload = torch.randn(5, 7, 3).to(torch.bfloat16)
    views = piece_views(payload, num_messages)
    assert 1 <= len(views) <= num_messages
    assert b"".join(v.tobytes() for v in views) == _bytes(payload)


def test_plan_and_framing_agree_for_large_slabs():
    layers = 4
    payload = 2 * layers * (3 << 20)
    k = plan_messages(payload, layers, 1 << 20)
    assert k == 2 * layers * 3


def test_device_bytes_states_the_cuda_interface_ucx_reads():
    from ucxx._lib.arr import Array

    owner = torch.arange(64, dtype=torch.uint8)
    view = DeviceBytes(owner, 16, 8)
    iface = view.__cuda_array_interface__
    assert iface["data"] == (owner.data_ptr() + 16, False)
    assert iface["shape"] == (8,) and iface["typestr"] == "|u1" and iface["strides"] is None
    array = Array(view)  # no CUDA call: UCX only reads the interface here
    assert array.cuda and array.nbytes == 8 and array.shape == (8,)
    assert view.tensor().tolist() == list(range(16, 24))


def test_byte_views_refuse_a_strided_tensor():
    t = torch.zeros(4, 4)[:, :2]
    with pytest.raises(ValueError, match="contiguous"):
        byte_views(t, [(0, 8)])
    flat = byte_views(torch.zeros(4, 4), [(0, 8), (8, 56)])
    assert [v.nbytes for v in flat] == [8, 56] and all(isinstance(v, np.ndarray) for v in flat)
