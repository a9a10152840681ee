"""The router's private control listener (`--control-port`) over TLS, with real processes: a
`splitserve router` serving TLS (`--tls-cert-file`, also its control listener's) with a cluster
secret, the session's prefill worker static and no decode worker. A registration that trusts
another CA, or speaks plaintext, never reaches RouterControl (the handshake fails, nothing is
registered); one with the right CA but a wrong secret is refused by the secret check; the
registration sidecar's loop with the right CA and secret registers the decode worker, after
which the router serves a request over TLS, token for token the oracle's, and every block is
free."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets

import grpc
from helpers_procs import ProcessGroup, health_status
from helpers_tls import make_pki
from router_helpers import MAX_MODEL_LEN, SERVING, greedy, ids_request, wait_until

from splitserve.protos import generate_pb2, generate_pb2_grpc, router_pb2, router_pb2_grpc
from splitserve.request.sampling_params import SamplingParams
from splitserve.router.registration import keep_registered
from splitserve.service.grpc_service import channel_options
from splitserve.service.tls import TlsClientConfig, open_channel

PROMPT = [1, 44, 45, 46, 200, 201, 202]
CONTROL = "splitserve.v1.RouterControl"
GENERATE = "splitserve.v1.GenerateService"
DECODE = generate_pb2.WORKER_ROLE_DECODE


def _register_once(address: str, tls: TlsClientConfig | None, secret: str, worker: str):
    """One RegisterWorker call; the grpc.RpcError it raised, or None."""
    request = router_pb2.RegisterWorkerRequest(role=DECODE, address=worker)
    with open_channel(address, tls, channel_options(), aio=False) as channel:
        try:
            router_pb2_grpc.RouterControlStub(channel).RegisterWorker(
                request, metadata=(("authorization", f"Bearer {secret}"),), timeout=30
            )
        except grpc.RpcError as err:
            return err
    return None


def test_control_listener_serves_registration_over_tls(cluster, oracle, tmp_path, caplog):
    with ProcessGroup(tmp_path / "logs") as procs:
        _run(cluster, oracle, procs, tmp_path, caplog)


def _run(cluster, oracle, procs, tmp_path, caplog) -> None:
    pki = make_pki(tmp_path / "pki")
    trusting = TlsClientConfig(ca_file=pki.ca)
    secret = secrets.token_urlsafe(24)
    (tmp_path / "cluster-secret").write_text(secret)
    router = procs.router(
        cluster.model,
        *("--prefill", cluster.prefill, "--max-model-len", str(MAX_MODEL_LEN)),
        *("--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key),
        *("--control-host", "127.0.0.1", "--control-port", "0"),
        *("--cluster-secret-file", str(tmp_path / "cluster-secret"), "--poll-interval-s", "0.2"),
        wait=False,
        tls=trusting,
    )

    async def started() -> bool:  # the start-up line names the control listener (port 0)
        assert router.alive(), router.log()
        return "worker registration on " in router.log()

    asyncio.run(wait_until(started, 90, "the router's start-up line"))
    control = re.search(r"worker registration on (\S+?),", router.log())[1]
    assert health_status(control, CONTROL, tls=trusting) == SERVING
    assert health_status(control, CONTROL) is None  # plaintext gets no answer at all

    # a stranger's CA and plaintext: no handshake, so no RouterControl call at all
    for tls in (TlsClientConfig(ca_file=pki.other_ca), None):
        err = _register_once(control, tls, secret, cluster.decode)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, (tls, err)
    # the right CA, a wrong secret: the handshake succeeds, the secret check refuses
    err = _register_once(control, trusting, secrets.token_urlsafe(24), cluster.decode)
    assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    assert health_status(router.address, GENERATE, tls=trusting) != SERVING  # no decode worker
    # the public port does not serve RouterControl, TLS or not
    err = _register_once(router.address, trusting, secret, cluster.decode)
    assert err is not None and err.code() == grpc.StatusCode.UNIMPLEMENTED, err

    async def register_and_generate() -> list[int]:
        stop = asyncio.Event()
        task = asyncio.create_task(
            keep_registered(
                control, "decode", cluster.decode, stop, worker_wait_s=0,
                secret=secret.encode(), tls=trusting,
            )
        )  # fmt: skip

        async def ready() -> bool:
            assert not task.done(), task.exception()
            return health_status(router.address, GENERATE, tls=trusting) == SERVING

        try:
            await wait_until(ready, 60, "the router SERVING once the decode worker registered")
            async with open_channel(router.address, trusting, channel_options()) as ch:
                stub = generate_pb2_grpc.GenerateServiceStub(ch)
                chunks = [
                    c async for c in stub.Generate(ids_request(PROMPT, greedy(6)), timeout=60)
                ]
        finally:
            stop.set()
            await task
        await cluster.assert_free()
        return [t for c in chunks for t in c.token_ids]

    with caplog.at_level(logging.INFO, logger="splitserve.registration"):
        got = asyncio.run(register_and_generate())
    assert f"registered decode worker {cluster.decode} with router {control}" in caplog.text
    want = oracle(PROMPT, SamplingParams(temperature=0, max_tokens=6)).token_ids
    assert got == want
    assert router.stop() == 0, router.log()
    log = router.log()
    assert f"worker registration on {control}" in log and "Traceback" not in log, log
    assert secret not in log
