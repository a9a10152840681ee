"""TLS everywhere, with real processes: a prefill and a decode worker that require mutual TLS,
and a `splitserve router` serving TLS on its gRPC port and HTTPS on its OpenAI front, calling
the workers with its client certificate (all set by flags). Requests go end to end and match
the single-process oracle; a wrong CA, plaintext and a caller without the client certificate
are refused; a bad certificate file stops the router at start with one line."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
from helpers_procs import ProcessGroup, all_free, cli_command, free_port
from helpers_tls import Pki, make_pki
from router_helpers import MAX_MODEL_LEN, worker_flags

from splitserve.cli import health_cmd
from splitserve.protos import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from splitserve.request.sampling_params import SamplingParams
from splitserve.router.registration import keep_registered
from splitserve.service.grpc_service import channel_options
from splitserve.service.tls import TlsClientConfig, client_ssl_context, open_channel

PROMPT = "The quick brown fox"
MAX_TOKENS = 8


@dataclass
class TlsStack:
    pki: Pki
    prefill: str
    decode: str
    router: str
    https: str  # base URL of the OpenAI front
    mutual: TlsClientConfig  # the router's identity towards the workers
    trusting: TlsClientConfig  # a client of the router: trusts the CA, shows no certificate

    def assert_free(self) -> None:
        """Every block free and no lease on both workers, asked over mutual TLS."""
        for address, stub in (
            (self.prefill, worker_pb2_grpc.PrefillWorkerStub),
            (self.decode, worker_pb2_grpc.DecodeWorkerStub),
        ):
            with open_channel(address, self.mutual, aio=False) as channel:
                all_free(stub(channel))


@pytest.fixture(scope="module")
def tls_stack(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls_stack")
    pki = make_pki(d / "pki")
    mutual = TlsClientConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    trusting = TlsClientConfig(ca_file=pki.ca)
    serve_tls = ["--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key]
    worker_tls = [*serve_tls, "--tls-client-ca-file", pki.ca]
    with ProcessGroup(d) as procs:
        prefill = procs.prefill_worker(
            tiny_llama, *worker_flags(), *worker_tls, wait=False, tls=mutual
        )
        decode = procs.decode_worker(
            tiny_llama,
            *worker_flags(),
            "--max-batch-size",
            "8",
            *worker_tls,
            wait=False,
            tls=mutual,
        )
        prefill.wait_serving()
        decode.wait_serving()
        http_port = free_port()
        router = procs.router(
            tiny_llama,
            *("--prefill", prefill.address, "--decode", decode.address),
            *serve_tls,  # also the HTTP front's (no http.tls of its own)
            *("--workers-tls-ca-file", pki.ca, "--workers-tls-cert-file", pki.client_cert),
            *("--workers-tls-key-file", pki.client_key, "--http-port", str(http_port)),
            *("--model-name", "tiny", "--max-model-len", str(MAX_MODEL_LEN)),
            *("--poll-interval-s", "0.2"),
            tls=trusting,  # SERVING = both workers healthy, i.e. probed over mutual TLS
        )
        yield TlsStack(
            pki,
            prefill.address,
            decode.address,
            router.address,
            f"https://127.0.0.1:{http_port}/v1",
            mutual,
            trusting,
        )
        assert router.stop() == 0, router.log()
        log = router.log()
        assert "over TLS" in log and f"https://127.0.0.1:{http_port}/v1" in log, log
        assert "Traceback" not in log, log
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()
        assert "over TLS (mutual" in decode.log(), decode.log()


def _generate(address: str, tls: TlsClientConfig | None) -> list[int]:
    with open_channel(address, tls, channel_options(), aio=False) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        request = generate_pb2.GenerateRequest(
            text=PROMPT, sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        )
        return [t for c in stub.Generate(request, timeout=60) for t in c.token_ids]


def _post_completion(url: str, context: ssl.SSLContext | None) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(
        f"{url}/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60, context=context) as resp:
        assert resp.status == 200
        return json.load(resp)


def test_requests_go_end_to_end_over_tls_and_mutual_tls(tls_stack, oracle):
    want = oracle(
        oracle.tokenizer.encode(PROMPT), SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    assert _generate(tls_stack.router, tls_stack.trusting) == want.token_ids
    got = _post_completion(tls_stack.https, client_ssl_context(tls_stack.trusting))
    assert got["choices"][0]["text"] == want.text
    tls_stack.assert_free()


def test_the_router_refuses_a_wrong_ca_and_plaintext(tls_stack):
    stranger = TlsClientConfig(ca_file=tls_stack.pki.other_ca)
    for tls in (stranger, None):
        with pytest.raises(grpc.RpcError) as err:
            _generate(tls_stack.router, tls)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(urllib.error.URLError) as err:
        _post_completion(tls_stack.https, client_ssl_context(stranger))
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to the HTTPS port
        _post_completion(tls_stack.https.replace("https://", "http://"), None)
    tls_stack.assert_free()


def test_workers_refuse_callers_without_a_certificate_from_their_client_ca(tls_stack):
    pki = tls_stack.pki
    callers = {
        "no certificate": tls_stack.trusting,
        "certificate of another CA": TlsClientConfig(
            ca_file=pki.ca, cert_file=pki.other_client_cert, key_file=pki.other_client_key
        ),
        "plaintext": None,
    }
    workers = {
        tls_stack.prefill: worker_pb2_grpc.PrefillWorkerStub,
        tls_stack.decode: worker_pb2_grpc.DecodeWorkerStub,
    }
    for address, stub_class in workers.items():
        for name, tls in callers.items():
            with open_channel(address, tls, aio=False) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    stub_class(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (address, name)
    tls_stack.assert_free()  # the router's certificate is let in


def test_registration_sidecar_and_health_command_speak_tls(tls_stack, caplog, capsys):
    async def register() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            keep_registered(
                tls_stack.router, "decode", tls_stack.decode, stop, tls=tls_stack.mutual
            )
        )
        for _ in range(600):  # RegisterWorker answered (or the task failed): at most 60 s
            if task.done() or "registered decode worker" in caplog.text:
                break
            await asyncio.sleep(0.1)
        stop.set()
        await task

    with caplog.at_level(logging.INFO, logger="splitserve.registration"):
        asyncio.run(register())
    assert f"registered decode worker {tls_stack.decode} with router" in caplog.text

    def health(*flags: str) -> int:
        args = [tls_stack.router, "--service", "splitserve.v1.GenerateService", *flags]
        p = argparse.ArgumentParser()
        health_cmd.add_arguments(p)
        return health_cmd.run(p.parse_args(args))

    assert health("--tls-ca-file", tls_stack.pki.ca) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    assert health() == 1  # plaintext to a TLS port
    assert "UNAVAILABLE" in capsys.readouterr().err
    tls_stack.assert_free()


def test_a_bad_certificate_file_stops_the_router_with_one_line(tiny_llama, tmp_path):
    pki = make_pki(tmp_path)
    done = subprocess.run(
        [
            *cli_command("router"),
            *("--model", str(tiny_llama), "--port", "0"),
            *("--tls-cert-file", pki.server_cert, "--tls-key-file", pki.client_key),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("splitserve router: error: server.tls: "), done.stderr
    assert "are not a certificate and its unencrypted private key" in last
    assert "Traceback" not in done.stderr
