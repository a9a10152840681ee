"""PrefillWorker gRPC servicer: proto in, validation, engine call, proto out.

Every per-request failure is a `RequestError` turned into its status here; the engine
never sees an invalid request (validation runs before any allocation).
"""

from __future__ import annotations

import asyncio

import grpc

from splitserve.kvtransfer.descriptor import PoolSpec, make_handle, shard_map
from splitserve.prefill_worker.config import PrefillWorkerConfig
from splitserve.prefill_worker.engine import PrefillEngine
from splitserve.prefill_worker.leases import Lease
from splitserve.prefill_worker.request import PrefillResult
from splitserve.protos import generate_pb2, kv_pb2, worker_pb2, worker_pb2_grpc
from splitserve.request.errors import RequestError
from splitserve.service.proto_convert import (
    finish_reason_to_proto,
    logprob_to_proto,
    stop_reason_to_proto,
    validate_request,
)
from splitserve.service.request_ids import check_request_id


class PrefillWorkerServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        self.cfg = cfg
        self.engine: PrefillEngine | None = None  # set once the model is loaded and warm
        self.kv_port = 0  # the UCX listener's port, set when it starts
        self.kv_streaming = False  # its listener serves streamed hand-overs (kv_stream.py)
        self.shard_ports: list[int] | None = None  # tensor parallel: every rank's UCX port, by rank

    def _engine(self) -> PrefillEngine:
        if self.engine is None:
            raise RequestError.unavailable(
                "the prefill worker is still loading its model; "
                "retry when its health check says SERVING"
            )
        return self.engine

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context
    ) -> worker_pb2.PrefillResponse:
        try:
            engine = self._engine()
            check_request_id(request.request_id)
            params = validate_request(
                request.prompt_token_ids,
                request.sampling if request.HasField("sampling") else None,
                vocab_size=engine.vocab_size,
                max_model_len=engine.max_model_len,
            )
            ttl_s = self._lease_ttl_s(request.lease_ttl_ms)
            matcher = await engine.grammars.matcher(params.constraint)  # before any allocation
            result = await engine.prefill(
                request.request_id,
                request.prompt_token_ids,
                params,
                ttl_s,
                matcher,
                stream_token=request.kv_stream_token,
            )
            if delay := self.cfg.faults.reply_delay(request.request_id):  # tests only
                await asyncio.sleep(delay)
        except RequestError as err:
            if self.engine is not None and err.code != grpc.StatusCode.CANCELLED:
                self.engine.metrics.requests.labels(err.code.name.lower()).inc()
            await err.abort(context)
        return self._response(result)

    async def Abort(
        self, request: generate_pb2.AbortRequest, context
    ) -> generate_pb2.AbortResponse:
        engine = self.engine
        return generate_pb2.AbortResponse(
            found=engine is not None and engine.abort(request.request_id)
        )

    async def ReleaseLease(
        self, request: worker_pb2.ReleaseLeaseRequest, context
    ) -> worker_pb2.ReleaseLeaseResponse:
        try:
            released = self._engine().release_lease(request.lease_id, request.request_id)
        except RequestError as err:
            await err.abort(context)
        return worker_pb2.ReleaseLeaseResponse(released=released)

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.WorkerLoad:
        load = worker_pb2.WorkerLoad(role=generate_pb2.WORKER_ROLE_PREFILL)
        engine = self.engine
        if engine is None:
            return load
        limit = min(request.max_prefix_hashes, self.cfg.max_prefix_hashes)
        load.num_running = len(engine.scheduler.running)
        load.num_waiting = len(engine.scheduler.waiting)
        load.free_blocks = engine.allocator.num_free
        load.total_blocks = engine.allocator.num_usable
        load.block_size = engine.runner.block_size
        # 128-bit keys only: the deprecated 64-bit block_hashes stays empty
        load.prefix_cache.block_keys.extend(engine.cache.recent_keys(limit))
        load.prefix_cache.num_cached_blocks = engine.cache.num_cached_blocks
        load.leases_held = len(engine.leases)
        load.model_compat_hash = engine.runner.compat_hash
        if (
            self.kv_port
        ):  # the router dials it once: an unreachable advertised host fails at registration
            load.kv_address.CopyFrom(
                kv_pb2.UcxAddress(host=self.cfg.server.public_host, port=self.kv_port)
            )
            load.kv_streaming = self.kv_streaming
            load.kv_shards.extend(  # tensor parallel: where a stream finds each rank's heads
                shard_map(
                    engine.runner.model_config.num_key_value_heads,
                    self.cfg.server.public_host,
                    self.shard_ports,
                )
            )
        return load

    # ---- helpers ---------------------------------------------------------------------------
    def _lease_ttl_s(self, ttl_ms: int) -> float:
        if not ttl_ms:
            return self.cfg.lease_ttl_s
        if ttl_ms > self.cfg.max_lease_ttl_s * 1000:
            raise RequestError.invalid(
                f"lease_ttl_ms {ttl_ms} exceeds this worker's max_lease_ttl_s ({self.cfg.max_lease_ttl_s:g} s); "
                "ask for less, or 0 for the worker's default"
            )
        return ttl_ms / 1000

    def _response(self, r: PrefillResult) -> worker_pb2.PrefillResponse:
        resp = worker_pb2.PrefillResponse(
            request_id=r.request_id,
            first_token_id=r.first_token_id,
            finish_reason=finish_reason_to_proto(r.finish_reason),
            cached_prompt_tokens=r.num_cached_tokens,
            queue_time_ms=r.queue_time_s * 1000,
            compute_time_ms=r.compute_time_s * 1000,
            sampling_time_ms=r.sampling_time_s * 1000,
            handover_start_ms=r.handover_start_s * 1000,
        )
        if r.logprob is not None:
            resp.first_token_logprob.CopyFrom(logprob_to_proto(r.logprob))
        stop = stop_reason_to_proto(r.stop_reason)
        if stop is not None:
            resp.stop_reason.CopyFrom(stop)
        if r.lease is not None:
            resp.kv.CopyFrom(self.kv_handle(r.lease))
        return resp

    def kv_handle(self, lease: Lease) -> kv_pb2.KvHandle:
        runner = self._engine().runner
        spec = PoolSpec.of(
            runner.kv_cache, runner.compat_hash, runner.model_config.num_key_value_heads
        )
        handle = make_handle(
            spec,
            host=self.cfg.server.public_host,
            port=self.kv_port,
            lease_id=lease.lease_id,
            request_id=lease.request_id,
            num_blocks=len(lease.block_ids),
            num_tokens=lease.num_tokens,
            ttl_s=lease.ttl_s,
            shard_ports=self.shard_ports,
        )
        handle.expires_at_unix_ms = lease.expires_at_unix_ms
        return handle
