"""`splitserve bench --backend openai`: the same requests through the router's OpenAI-compatible
HTTP API (or any OpenAI-compatible server), streamed /v1/completions over aiohttp.

    client = await OpenAIClient.connect(base_url)     GET /v1/models (+ /health when the server has one)
                                                       (https: connect(base_url, ssl_context); a
                                                       router with keys: api_key, every request)
    await send_one(client, cfg, prompt, i, t0)         one streamed completion -> RequestResult

Per request, as the gRPC runner: TTFT at the first event carrying text, one ITL per later
event carrying text, E2E at [DONE]; the output length is usage.completion_tokens
(stream_options.include_usage), falling back to the number of text events. Token-id prompts
go as token ids, so both backends run the same workload.
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from splitserve.cli.api_key import http_headers
from splitserve.cli.bench.runner import RUN_ID, BenchError, RequestResult
from splitserve.cli.bench.workload import BenchConfig, BenchPrompt


@dataclass
class OpenAIClient:
    session: aiohttp.ClientSession
    base_url: str  # ends in /v1
    model: str
    max_model_len: int
    vocab_size: int | None
    workers: dict[str, int] = field(default_factory=dict)

    @classmethod
    async def connect(
        cls, base_url: str, ssl_context: ssl.SSLContext | None = None, api_key: str | None = None
    ) -> OpenAIClient:
        """`ssl_context`: whom an https:// base_url is trusted by (None: the system's CAs).
        `api_key`: sent as `Authorization: Bearer` with every request (None: none)."""
        base_url = base_url.rstrip("/")
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None),
            connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context or True),
            headers=http_headers(api_key),
        )
        try:
            async with session.get(
                f"{base_url}/models", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.status != 200:
                    raise BenchError(
                        f"GET {base_url}/models: HTTP {resp.status}: {(await resp.text())[:200]}"
                    )
                card = (await resp.json())["data"][0]
            workers: dict[str, int] = {}
            root = base_url.removesuffix("/v1")
            async with session.get(
                f"{root}/health", timeout=aiohttp.ClientTimeout(total=10)
            ) as resp:
                if resp.content_type == "application/json":
                    health = await resp.json()
                    workers = {
                        "prefill": health.get("healthy_prefill", 0),
                        "decode": health.get("healthy_decode", 0),
                    }
        except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError) as exc:
            await session.close()
            raise BenchError(
                f"cannot reach an OpenAI-compatible server at {base_url} ({type(exc).__name__}: "
                f"{exc}); start `splitserve serve` or pass --base-url"
            ) from None
        except BaseException:
            await session.close()
            raise
        return cls(
            session,
            base_url,
            card["id"],
            int(card.get("max_model_len") or 0),
            card.get("vocab_size"),
            workers,
        )

    async def close(self) -> None:
        await self.session.close()


def _body(client: OpenAIClient, cfg: BenchConfig, prompt: BenchPrompt) -> dict[str, Any]:
    # the request's own sampling fields: OpenAI's names (temperature, top_p, seed, presence /
    # frequency penalty) and vLLM's extra ones (top_k, min_p, repetition_penalty), which our
    # HTTP front takes like vLLM's
    fields = prompt.sampling if prompt.sampling is not None else {"temperature": cfg.temperature}
    return {
        "model": client.model,
        "prompt": prompt.prompt if isinstance(prompt.prompt, str) else list(prompt.prompt),
        "max_tokens": prompt.output_len,
        **fields,
        "ignore_eos": cfg.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_one(
    client: OpenAIClient,
    cfg: BenchConfig,
    prompt: BenchPrompt,
    index: int,
    t0: float,
    tag: str = "bench",
) -> RequestResult:
    res = RequestResult(index, input_len=prompt.known_input_len or 0, kind=prompt.kind)
    res.text = "" if cfg.save_outputs else None
    start = time.perf_counter()
    res.start_s = start - t0
    last, events = start, 0
    headers = {"X-Request-Id": f"{tag}-{RUN_ID}-{index}"}
    try:
        async with client.session.post(
            f"{client.base_url}/completions",
            json=_body(client, cfg, prompt),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        ) as resp:
            if resp.status != 200:
                text = await resp.text()
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                raise BenchError(f"HTTP {resp.status}: {' '.join(str(text).split())}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise BenchError(f"stream error: {event['error'].get('message')}")
                now = time.perf_counter()
                if res.text is not None:
                    res.text += "".join(c.get("text") or "" for c in event.get("choices", ()))
                if any(c.get("text") for c in event.get("choices", ())):
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itls_s.append(now - last)
                    last = now
                    events += 1
                if event.get("usage"):
                    res.output_len = event["usage"]["completion_tokens"]
                    res.input_len = event["usage"]["prompt_tokens"] or res.input_len
        res.output_len = res.output_len or events
        res.e2e_s = time.perf_counter() - start
        res.ok = res.ttft_s is not None
        res.error = None if res.ok else "stream ended without text"
    except (BenchError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        res.e2e_s = time.perf_counter() - start
        res.error = str(exc) if isinstance(exc, BenchError) else f"{type(exc).__name__}: {exc}"
    return res
