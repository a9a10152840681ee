"""The worker-to-worker hand-over on a GPU: both pools in device memory, UCX moves the packed
KV GPU to GPU (cuda_ipc on one host), tokens equal single-process generation."""

from __future__ import annotations

import re
import urllib.request

import helpers_procs
import pytest
from test_handover_processes import PROMPTS, _all_free, _handover, _stubs, expected  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def test_gpu_handover_moves_device_memory(tiny_llama, expected, tmp_path):  # noqa: F811 - the fixture
    metrics = helpers_procs.free_port()
    with helpers_procs.ProcessGroup(tmp_path) as procs:
        p = procs.prefill_worker(
            tiny_llama, "--block-size", "4", "--num-blocks", "96", "--device", "cuda"
        )
        d = procs.decode_worker(
            tiny_llama,
            "--block-size",
            "4",
            "--num-blocks",
            "96",
            "--device",
            "cuda",
            "--metrics-port",
            str(metrics),
            "--kv-failure-policy",
            "fail",
        )
        prefill, decode = _stubs(p, d)
        for i in range(len(PROMPTS)):
            assert _handover(prefill, decode, i) == expected[i]
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        )
        received = float(
            re.search(r'kv_transfer_bytes_total\{direction="received"\} ([0-9.e+]+)', text).group(1)
        )
        assert received > 0
        transports = set(
            re.findall(r'splitserve_ucx_transport_available\{transport="([^"]+)"\} 1', text)
        )
        print("UCX transports:", sorted(transports))
        assert "cuda_ipc" in transports or "cuda_copy" in transports
        _all_free(prefill)
        _all_free(decode)
        assert p.stop() == 0 and d.stop() == 0
