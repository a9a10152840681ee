"""Where the HTTP front's Generate chunks go (Frontend.generate's ChunkSink, frontend.py).

`CollectedChunks` keeps them for one JSON body (stream: false); `EventStream` sends each as a
server-sent event, its headers with the first chunk so that a request refused before any token
still gets a real HTTP status, and ends with an error event or the usage chunk, then
`data: [DONE]`. Bodies come from openai_response.py. `ToolCallStream` holds a forced tool
call's text back and sends it as one `tool_calls` delta at the end.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from splitserve.protos import generate_pb2
from splitserve.router.openai_errors import OpenAIError
from splitserve.router.openai_response import ResponseBuilder
from splitserve.router.openai_structured import as_tool_call_delta


def json_bytes(body: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON, as every HTTP body and event is sent."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class CollectedChunks:
    """Sink of a non-streamed request: keeps the chunks."""

    def __init__(self) -> None:
        self.chunks: list[generate_pb2.GenerateResponse] = []

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None:
        self.chunks.append(chunk)

    def time_remaining(self) -> float | None:
        return None


class EventStream:
    """Sink of a streamed request: server-sent events, headers sent with the first chunk."""

    def __init__(self, request: web.Request, builder: ResponseBuilder) -> None:
        self.request = request
        self.builder = builder
        self.resp: web.StreamResponse | None = None
        self.usage: generate_pb2.Usage | None = None

    def time_remaining(self) -> float | None:
        return None

    async def send(self, body: dict[str, Any]) -> None:
        try:
            await self.resp.write(b"data: " + json_bytes(body) + b"\n\n")
        except ConnectionResetError as exc:  # aiohttp's ClientConnectionResetError is one
            # the client went away mid-stream: end the request as a client cancel does (the
            # generation cancels its worker calls and releases its lease), no traceback
            raise asyncio.CancelledError("the HTTP client disconnected") from exc

    async def start(self) -> None:
        self.resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": self.builder.id,
            }
        )
        await self.resp.prepare(self.request)
        if self.builder.kind == "chat":
            await self.send(self.builder.role_chunk())

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None:
        if self.resp is None:
            await self.start()
        if chunk.finish_reason:
            self.usage = chunk.usage
        body = self.builder.stream_chunk(chunk)
        if body is not None:
            await self.send(body)

    async def close(self, error: OpenAIError | None = None) -> web.StreamResponse:
        if self.resp is None:
            await self.start()
        if error is not None:
            await self.send(error.body())
        elif self.builder.include_usage and self.usage is not None:
            await self.send(self.builder.usage_chunk(self.usage))
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()
        return self.resp


class ToolCallStream(EventStream):
    """A forced tool call, streamed: the text is held back until the request ends, then one
    chunk carries the whole call as a `tool_calls` delta (finish_reason "tool_calls"), or the
    text as content when max_tokens cut it short ("length")."""

    def __init__(self, request: web.Request, builder: ResponseBuilder, forced: str) -> None:
        super().__init__(request, builder)
        self.forced, self.held = forced, generate_pb2.GenerateResponse()

    async def write(self, chunk: generate_pb2.GenerateResponse) -> None:
        if self.resp is None:
            await self.start()
        text = self.held.text + chunk.text
        self.held.MergeFrom(chunk)  # (repeated fields append: token ids, logprobs)
        self.held.text = text
        if not chunk.finish_reason:
            return
        self.usage = chunk.usage
        body = self.builder.stream_chunk(self.held)
        await self.send(as_tool_call_delta(body, self.forced))
