"""A real TP2 pair (CPU, gloo, the follower a spawned process) under a configured cluster secret:
requests run on the launch's signed control stream; then a message with one payload byte
flipped, sent on the same gloo group with the next sequence number, makes the follower stop
with exactly one ERROR line saying why (no traceback) and exit CONTROL_REFUSED_EXIT, which rank
0's watch reports as a lost rank."""

from __future__ import annotations

import time

from splitserve.config.engine_config import EngineConfig
from splitserve.engine.model_runner import PrefillChunk
from splitserve.engine.offline import OfflineEngine
from splitserve.engine.parallel import destroy_tp
from splitserve.engine.tp_channel import HEADER, broadcast_frame
from splitserve.engine.tp_control import start_ranks
from splitserve.engine.tp_follower import CONTROL_REFUSED_EXIT
from splitserve.engine.tp_messages import encode_command
from splitserve.request.sampling_params import SamplingParams
from splitserve.service.credentials import CLUSTER_SECRET_ENV

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32]
DEATH_SEEN_WITHIN_S = 60.0  # one receive and the watcher's 0.2 s poll; wide for loaded 2-core CI


def _cfg(folder) -> EngineConfig:
    return EngineConfig(
        model_path=str(folder),
        device="cpu",
        cache={"num_blocks": 32, "block_size": 8},
        parallel={"tensor_parallel_size": 2},
    )


def test_follower_refuses_a_tampered_message_with_one_line(tiny_llama, capfd, monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_ENV, "a-test-cluster-secret-0123456789")  # derived key path
    ranks = start_ranks(_cfg(tiny_llama))
    deaths: list = []
    ranks.watch(lambda rank, code: deaths.append((rank, code)))
    try:
        engine = OfflineEngine(ranks.runner)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        [done] = engine.generate([PROMPT], [params])
        assert len(done.token_ids) == 4  # every step ran on both ranks: the stream verified
        engine.allocator.check_integrity()
        assert engine.allocator.num_free == engine.allocator.num_usable
        # the follower has taken every command (each ran a collective with it): the publisher
        # is idle, so this thread may use the group; the launch's key and next sequence number
        # make a frame the follower would accept, but for one flipped payload byte
        kind, payload = encode_command(("prefill", [PrefillChunk(PROMPT, 0, (1,))]))
        frame = bytearray(ranks.publisher.sender.sealer.seal(kind, payload))
        frame[HEADER.size + 9] ^= 0x40
        broadcast_frame(ranks.runner.tp, bytes(frame))
        deadline = time.monotonic() + DEATH_SEEN_WITHIN_S
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert deaths == [(1, CONTROL_REFUSED_EXIT)]
    finally:
        ranks.kill()
        destroy_tp(ranks.runner.tp)
    err = capfd.readouterr().err
    refused = [line for line in err.splitlines() if "refused a control message" in line]
    assert len(refused) == 1, err
    assert " ERROR tp1 " in refused[0] and refused[0].endswith(
        "tensor-parallel rank 1 refused a control message from rank 0 and stops: bad HMAC tag: "
        "the message was altered, or not signed with this launch's key"
    ), refused[0]
    assert "Traceback" not in err, err
