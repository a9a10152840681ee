"""The router's gRPC client as the CLI uses it (`splitserve generate`, `splitserve serve --prompt`):
sampling flags -> SamplingParams, one streamed Generate call, text or JSON on the terminal.

    add_sampling_arguments(parser)            --max-tokens --temperature --top-p --top-k --seed
                                              --stop (repeatable) --logprobs N --ignore-eos
    result = stream_to(out, address, prompt, args, tls=None, api_key=None)
                                              streams the text (or JSON) as it comes; TLS to the
                                              router with `tls` (service/tls.py), `api_key` sent
                                              as `authorization: Bearer` (cli/api_key.py)
    rpc_error_line(err)                       'UNAVAILABLE: <details>' (one line)

Errors are `GenerateError`s carrying one line with the gRPC status and message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import grpc

from splitserve.cli.api_key import API_KEY_ENV, grpc_metadata

if TYPE_CHECKING:
    from splitserve.service.tls import TlsClientConfig

DEFAULT_PORT = 50051  # `splitserve serve`'s router port
ADDRESS_ENV = "SPLITSERVE_ADDRESS"
FINISH = {0: None, 1: "stop", 2: "length", 3: "abort"}


class GenerateError(RuntimeError):
    """One line: the gRPC status and message (and a hint when the router is not reachable)."""


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or f"127.0.0.1:{DEFAULT_PORT}"


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int | None = 64) -> None:
    g = p.add_argument_group("sampling (the router checks ranges; a bad value is INVALID_ARGUMENT)")
    g.add_argument(
        "--max-tokens",
        type=_nonneg_int,
        default=max_tokens,
        help=f"tokens to generate (default {max_tokens})",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, help="nucleus mass in (0, 1]")
    g.add_argument(
        "--top-k", type=_nonneg_int, default=0, help="keep the k most likely tokens (0: off)"
    )
    g.add_argument(
        "--seed", type=_nonneg_int, help="per-request sampling seed (reproducible sampling)"
    )
    g.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    g.add_argument(
        "--logprobs",
        type=_nonneg_int,
        metavar="N",
        help="return each token's logprob and N alternatives",
    )
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    c = p.add_argument_group(
        "structured output (one; docs/structured_output.md)"
    ).add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="SCHEMA", help="a JSON Schema, or @FILE holding one")
    c.add_argument("--json-object", action="store_true", help="any JSON object")
    c.add_argument("--regex", help="a regular expression the whole output matches")
    c.add_argument("--choice", action="append", metavar="TEXT", help="an allowed output (repeat)")
    c.add_argument("--grammar", metavar="LARK", help="a Lark grammar, or @FILE holding one")
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="deadline of the whole call in seconds (default 120)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (text, token_ids, "
        "finish_reason, usage, ...) instead of streaming text",
    )
    g.add_argument(
        "--json-chunks", action="store_true", help="print one JSON object per streamed chunk"
    )


def sampling_from_args(args: argparse.Namespace):
    from splitserve.protos import generate_pb2

    sp = generate_pb2.SamplingParams(
        temperature=args.temperature, top_k=args.top_k, stop=args.stop, ignore_eos=args.ignore_eos
    )
    for name in ("max_tokens", "top_p", "seed", "logprobs"):
        if getattr(args, name) is not None:
            setattr(sp, name, getattr(args, name))
    for name in ("json_schema", "regex", "grammar"):
        value = getattr(args, name, None)
        if value is not None:
            setattr(sp, name, Path(value[1:]).read_text() if value.startswith("@") else value)
    if getattr(args, "json_object", False):
        sp.json_object = True
    if getattr(args, "choice", None):
        sp.choice.choices.extend(args.choice)
    return sp


def rpc_error_line(err: grpc.RpcError, address: str = "") -> str:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    details = " ".join(details.split())
    line = f"{code.name if code else 'ERROR'}: {details}"
    lower = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and ("ssl" in lower or "handshake" in lower):
        line += " (TLS: check --tls-ca-file, and that both ends use TLS)"
    elif code == grpc.StatusCode.UNAVAILABLE and address and "connect" in lower:
        line += f" (is `splitserve serve` running at {address}? set --address or {ADDRESS_ENV})"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        line += f" (pass --api-key or set ${API_KEY_ENV})"
    return line


@dataclass
class Result:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float | None = None
    e2e_s: float = 0.0

    def add(self, chunk) -> dict:
        """Folds one GenerateResponse in; returns the chunk as a JSON-able dict."""
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        lps = [
            {
                "token_id": lp.token_id,
                "logprob": lp.logprob,
                "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in lp.top_logprobs],
            }
            for lp in chunk.logprobs
        ]
        self.logprobs.extend(lps)
        d = {"request_id": chunk.request_id, "text": chunk.text, "token_ids": list(chunk.token_ids)}
        if lps:
            d["logprobs"] = lps
        if chunk.finish_reason:
            self.finish_reason = FINISH.get(chunk.finish_reason, str(chunk.finish_reason))
            which = (
                chunk.stop_reason.WhichOneof("reason") if chunk.HasField("stop_reason") else None
            )
            self.stop_reason = getattr(chunk.stop_reason, which) if which else None
            u = chunk.usage
            self.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_prompt_tokens": u.cached_prompt_tokens,
            }
            d.update(
                finish_reason=self.finish_reason, stop_reason=self.stop_reason, usage=self.usage
            )
        return d

    def as_json(self) -> dict:
        d = {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "usage": self.usage,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
        }
        if self.logprobs:
            d["logprobs"] = self.logprobs
        return d


def make_request(prompt: str | list[int], sampling, request_id: str = ""):
    from splitserve.protos import generate_pb2

    if isinstance(prompt, str):
        return generate_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling)
    return generate_pb2.GenerateRequest(
        request_id=request_id, token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling
    )


def generate(
    address: str,
    request,
    timeout: float | None,
    on_chunk=None,
    tls: TlsClientConfig | None = None,
    api_key: str | None = None,
) -> Result:
    """One Generate call; `on_chunk(result, chunk_dict)` after each chunk. GenerateError on failure.
    `tls`: TLS to the router (service/tls.py); None: plaintext. `api_key`: the router's API key
    (None: none sent)."""
    from splitserve.protos import generate_pb2_grpc
    from splitserve.service.grpc_service import channel_options
    from splitserve.service.tls import open_channel

    result = Result()
    t0 = time.monotonic()
    with open_channel(address, tls, channel_options(), aio=False) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        try:
            for chunk in stub.Generate(
                request, timeout=timeout, wait_for_ready=False, metadata=grpc_metadata(api_key)
            ):
                if result.ttft_s is None and (chunk.token_ids or chunk.text):
                    result.ttft_s = time.monotonic() - t0
                d = result.add(chunk)
                if on_chunk is not None:
                    on_chunk(result, d)
        except grpc.RpcError as err:
            raise GenerateError(rpc_error_line(err, address)) from None
    result.e2e_s = time.monotonic() - t0
    return result


def stream_to(
    out: TextIO,
    address: str,
    prompt: str | list[int],
    args: argparse.Namespace,
    err: TextIO | None = None,
    tls: TlsClientConfig | None = None,
    api_key: str | None = None,
) -> Result:
    """Runs the call and prints: streamed text (default), JSON lines per chunk (--json-chunks)
    or one JSON object (--json). A summary goes to `err` in text mode."""
    err = err or sys.stderr
    mode = "chunks" if args.json_chunks else "json" if args.json else "text"

    def on_chunk(_: Result, d: dict) -> None:
        if mode == "text" and d["text"]:
            out.write(d["text"])
            out.flush()
        elif mode == "chunks":
            out.write(json.dumps(d) + "\n")
            out.flush()

    result = generate(
        address,
        make_request(prompt, sampling_from_args(args)),
        args.timeout,
        on_chunk,
        tls,
        api_key,
    )
    if mode == "json":
        out.write(json.dumps(result.as_json()) + "\n")
    elif mode == "text":
        out.write("\n")
        for lp in result.logprobs:
            top = ", ".join(f"{t['token_id']}:{t['logprob']:.3f}" for t in lp["top"])
            err.write(
                f"  token {lp['token_id']:>6}  logprob {lp['logprob']:8.4f}{'  top ' + top if top else ''}\n"
            )
        u = result.usage
        rate = (
            f", {(len(result.token_ids) - 1) / (result.e2e_s - result.ttft_s):.1f} tok/s after the first"
            if result.ttft_s is not None
            and len(result.token_ids) > 1
            and result.e2e_s > result.ttft_s
            else ""
        )
        ttft = f", ttft {result.ttft_s * 1000:.0f} ms" if result.ttft_s is not None else ""
        err.write(
            f"[{u.get('completion_tokens', len(result.token_ids))} tokens, prompt {u.get('prompt_tokens', '?')}, "
            f"finish_reason={result.finish_reason}{ttft}{rate}]\n"
        )
    out.flush()
    return result
