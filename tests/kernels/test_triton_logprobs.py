"""Raw logprobs on the device (kernels/triton_logprobs.py, under TRITON_INTERPRET=1 here) equal
the torch twin (engine/sampling_math.raw_logprobs): log-sum-exp, the sampled token's logprob,
the top N values and ids, over several chunks, with ties, on rows whose bound lists few
logits and on near-constant rows whose list overflows into the exact passes."""

from __future__ import annotations

import pytest
import torch

import splitserve.kernels.triton_logprobs as tlp
from splitserve.engine.sampling_math import raw_logprobs

N = 20


def device_logprobs(x: torch.Tensor, tokens: torch.Tensor):
    n = x.shape[0]
    sampled = torch.empty(n)
    top = torch.empty(n, N)
    ids = torch.empty(n, N, dtype=torch.int64)
    slots = torch.arange(n)
    tlp.raw_logprobs_device(x, tokens, sampled, top, ids, slots, torch.ones(n, dtype=torch.int32))
    return sampled, top, ids


def test_rows_that_ask_for_none_are_left_alone():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([1, 2, 3])
    sampled, top, ids = torch.full((3,), 7.0), torch.full((3, N), 7.0), torch.full((3, N), -1)
    wants = torch.tensor([0, 1, 0], dtype=torch.int32)
    tlp.raw_logprobs_device(x, tokens, sampled, top, ids, torch.tensor([2, 1, 0]), wants)
    want_s, want_top, want_ids = raw_logprobs(x, tokens, N)
    assert sampled[[0, 2]].tolist() == [7.0, 7.0] and (ids[[0, 2]] == -1).all()  # slots 2, 0
    assert torch.allclose(sampled[1], want_s[1], atol=1e-5)
    assert ids[1].tolist() == want_ids[1].tolist()


@pytest.mark.parametrize("chunk,sub,cap", [(64, 16, 256), (128, 32, 32), (512, 64, 1024)])
def test_device_logprobs_equal_the_twin(chunk, sub, cap, monkeypatch):
    monkeypatch.setattr(tlp, "CHUNK", chunk)
    monkeypatch.setattr(tlp, "SUB", sub)
    monkeypatch.setattr(tlp, "CAP", cap)
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(6, 300, generator=g) * torch.tensor([0.01, 0.5, 3.0, 8.0, 1.0, 0.2])[:, None]
    x[4, :] = 1.25  # constant row: the top N are ids 0..N-1
    x[5, 150:190] = 4.0  # 40 ties above the rest
    tokens = torch.randint(0, 300, (6,), generator=g)
    sampled, top, ids = device_logprobs(x, tokens)
    want_s, want_top, want_ids = raw_logprobs(x, tokens, N)
    assert torch.allclose(sampled, want_s, atol=1e-5)
    assert torch.allclose(top, want_top, atol=1e-5)
    for r in range(4):  # distinct values: the same ids in the same order
        assert ids[r].tolist() == want_ids[r].tolist()
    assert ids[4].tolist() == list(range(N))  # ties: lower id first
    assert ids[5].tolist() == list(range(150, 150 + N))


def test_fewer_logits_than_the_sub_blocks_need():
    """V = 24 < N sub-blocks: the bound is -inf and every logit is listed."""
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([0, 5, 23])
    sampled, top, ids = device_logprobs(x, tokens)
    want_s, want_top, want_ids = raw_logprobs(x, tokens, N)
    assert torch.allclose(sampled, want_s, atol=1e-5) and torch.allclose(top, want_top, atol=1e-5)
    assert ids.tolist() == want_ids.tolist()


@pytest.mark.gpu
def test_device_logprobs_on_the_gpu_at_llama_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (
        torch.randn(64, 128256, device="cuda", generator=g)
        * torch.rand(64, 1, device="cuda", generator=g)
        * 4
    )
    x[3] = 0.5  # near-constant rows overflow the list: the exact passes
    x[7, 1000:1100] = 9.0
    tokens = torch.randint(0, 128256, (64,), device="cuda", generator=g)
    sampled, top, ids = (
        torch.empty(64, device="cuda"),
        torch.empty(64, N, device="cuda"),
        torch.empty(64, N, dtype=torch.int64, device="cuda"),
    )
    slots, wants = torch.arange(64, device="cuda"), torch.ones(64, dtype=torch.int32, device="cuda")
    tlp.raw_logprobs_device(x, tokens, sampled, top, ids, slots, wants)
    want_s, want_top, want_ids = raw_logprobs(x, tokens, N)
    assert torch.allclose(sampled, want_s, atol=1e-4) and torch.allclose(top, want_top, atol=1e-4)
    assert ids[3].tolist() == list(range(N)) and ids[7].tolist() == list(range(1000, 1000 + N))
    distinct = [r for r in range(64) if r not in (3, 7)]
    assert ids[distinct].tolist() == want_ids[distinct].tolist()
