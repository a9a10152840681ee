"""The shipped clients against a real router that requires API keys (keys written by the real
`splitserve keygen`; real prefill and decode worker processes): `splitserve generate` and
`splitserve bench` (gRPC and `--backend openai`) send `--api-key` or the key from the
environment and get the same tokens as the single-process engine; without a key, or with a
wrong one, they end with one line naming the status and how to pass a key. A key never shows in
their output or in bench's JSON. Every test ends with all KV blocks free."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from helpers_procs import ProcessGroup, all_free, free_port
from serve_helpers import ENGINE_FLAGS, MAX_MODEL_LEN, cli, make_oracle

from splitserve.protos import worker_pb2_grpc

KEY_ENVS = ("SPLITSERVE_API_KEY", "OPENAI_API_KEY", "SPLITSERVE_API_KEYS", "SPLITSERVE_ADMIN_KEYS")
PROMPT, N = "Hello, splitserve", 6


@dataclass
class Keyed:
    router: str
    base_url: str
    prefill: str
    decode: str
    key: str
    admin_key: str

    def assert_free(self) -> None:
        for address, stub in (
            (self.prefill, worker_pb2_grpc.PrefillWorkerStub),
            (self.decode, worker_pb2_grpc.DecodeWorkerStub),
        ):
            with grpc.insecure_channel(address) as ch:
                all_free(stub(ch))


def run(subcommand: str, *args: str, env: dict[str, str] | None = None):
    """`splitserve SUBCOMMAND ARGS` with no key in its environment but those in `env`."""
    base = {k: v for k, v in os.environ.items() if k not in KEY_ENVS}
    return subprocess.run(
        [*cli(subcommand), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**base, "UCX_WARN_UNUSED_ENV_VARS": "n", **(env or {})},
    )


@pytest.fixture(scope="module")
def keyed(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clients_api_key")
    secrets_dir = tmp / "secrets"  # keygen makes it
    made = run("keygen", str(secrets_dir / "api-keys"), str(secrets_dir / "admin-keys"))
    assert made.returncode == 0, made.stderr
    key, admin_key = (
        (secrets_dir / name).read_text().strip() for name in ("api-keys", "admin-keys")
    )
    assert key not in made.stdout and admin_key not in made.stdout
    with ProcessGroup(tmp / "logs") as procs:
        prefill = procs.prefill_worker(tiny_llama, *ENGINE_FLAGS, wait=False)
        decode = procs.decode_worker(tiny_llama, *ENGINE_FLAGS, wait=False)
        prefill.wait_serving()
        decode.wait_serving()
        http_port = free_port()
        router = procs.router(
            tiny_llama,
            *("--prefill", prefill.address, "--decode", decode.address),
            *("--max-model-len", str(MAX_MODEL_LEN), "--http-port", str(http_port)),
            *("--api-keys-file", str(secrets_dir / "api-keys")),
            *("--admin-keys-file", str(secrets_dir / "admin-keys")),
        )
        yield Keyed(
            router.address,
            f"http://127.0.0.1:{http_port}/v1",
            prefill.address,
            decode.address,
            key,
            admin_key,
        )
        assert router.stop() == 0, router.log()
        for secret in (key, admin_key):
            assert secret not in router.log()


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    return make_oracle(tiny_llama)


def _one_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_generate_sends_the_key_from_the_flag_or_the_environment(keyed, oracle):
    want = oracle(PROMPT, N)
    common = (PROMPT, "--address", keyed.router, "--max-tokens", str(N))
    missing = run("generate", *common)
    wrong = run("generate", *common, "--api-key", "not-the-key-" + "x" * 20)
    by_flag = run("generate", *common, "--api-key", keyed.key)
    by_env = run("generate", *common, "--json", env={"SPLITSERVE_API_KEY": keyed.admin_key})

    assert missing.returncode == wrong.returncode == 1
    for done, reason in ((missing, "API key is required"), (wrong, "not valid")):
        line = _one_line(done)
        assert "UNAUTHENTICATED" in line and reason in line and "--api-key" in line, line
    assert by_flag.returncode == 0, by_flag.stderr
    assert by_flag.stdout == want.text + "\n"
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["token_ids"] == want.token_ids
    for done in (missing, wrong, by_flag, by_env):
        assert keyed.key not in done.stdout + done.stderr
        assert keyed.admin_key not in done.stdout + done.stderr
    keyed.assert_free()


def _bench(keyed, out: Path, *extra: str, env: dict[str, str] | None = None):
    return run(
        "bench",
        *extra,
        *("--num-prompts", "4", "--input-len", "12", "--output-len", "5"),
        *("--max-concurrency", "2", "--no-progress", "--json-out", str(out)),
        env=env,
    )


def test_bench_grpc_and_openai_send_the_key(keyed, tmp_path):
    grpc_out, http_out = tmp_path / "grpc.json", tmp_path / "http.json"
    by_grpc = _bench(
        keyed, grpc_out, "--address", keyed.router, env={"SPLITSERVE_API_KEY": keyed.key}
    )
    # --backend openai falls back on $OPENAI_API_KEY, as OpenAI's own clients do
    by_http = _bench(
        keyed,
        http_out,
        *("--backend", "openai", "--base-url", keyed.base_url),
        env={"OPENAI_API_KEY": keyed.key},
    )
    refused_grpc = _bench(keyed, tmp_path / "no.json", "--address", keyed.router)
    refused_http = _bench(
        keyed, tmp_path / "no2.json", "--backend", "openai", "--base-url", keyed.base_url
    )

    for done, out in ((by_grpc, grpc_out), (by_http, http_out)):
        assert done.returncode == 0, done.stderr
        text = out.read_text()
        doc = json.loads(text)
        assert doc["completed"] == 4 and doc["failed"] == 0, doc
        assert doc["total_output_tokens"] == 4 * 5
        # a plain key sees no worker addresses, but the roles and health still count
        assert doc["server"]["healthy_workers"] == {"prefill": 1, "decode": 1}
        assert keyed.key not in text + done.stdout + done.stderr
    assert refused_grpc.returncode != 0 and refused_http.returncode != 0
    assert "UNAUTHENTICATED" in _one_line(refused_grpc)
    assert "HTTP 401" in _one_line(refused_http)
    keyed.assert_free()
