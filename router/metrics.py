"""Prometheus metrics of the router, in a registry of its own (tests run several routers in
one process; the server exports this registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_E2E = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


# why the router stopped sending a worker requests (registry.py)
EVICTION_REASONS = (
    "probe_timeout",
    "refused",
    "not_serving",
    "wrong_role",
    "probe_error",
    "heartbeat_silence",
    "kv_unreachable",
    "request_unavailable",
    "removed",
)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.ttft_seconds = Histogram(
            "splitserve_router_ttft_seconds",
            "arrival to the first token's chunk (the prefill path)",
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft_component_seconds = Histogram(
            "splitserve_router_ttft_component_seconds",
            "TTFT and the first inter-token gap in parts (router/request_timings.py). TTFT: "
            "router_queue (arrival to the Prefill, colocated the Decode, sent), prefill_queue "
            "(arrival to admission on the prefill worker; colocated: the decode worker's queue), "
            "prefill_compute (admission to first token; colocated: the decode worker's own "
            "prefill), prefill_sampling (the first token's sampling, part of prefill_compute), "
            "first_token_delivery (the rest: network, reply handling). Gap to the second token: "
            "handover (KV hand-over not hidden behind the prefill), first_decode_step (decode "
            "admission request to its first token), second_token_delivery (the Decode call's "
            "network and handling). As the decode worker reports them: transfer (its KV pull), "
            "transfer_streamed (a streamed pull, overlapping the prefill), decode_queue "
            "(admission request to its first token)",
            ["component"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl_seconds = Histogram(
            "splitserve_router_itl_seconds",
            "time between streamed token chunks",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "splitserve_router_e2e_seconds",
            "arrival to the last chunk of a finished request",
            buckets=_E2E,
            registry=r,
        )
        self.requests = Counter(
            "splitserve_router_requests",
            "Generate calls by outcome (finish reason or status)",
            ["outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "splitserve_router_requests_in_flight", "Generate calls in progress", registry=r
        )
        self.prompt_tokens = Counter(
            "splitserve_router_prompt_tokens", "prompt tokens of routed requests", registry=r
        )
        self.completion_tokens = Counter(
            "splitserve_router_completion_tokens", "tokens streamed to clients", registry=r
        )
        self.stream_fallbacks = Counter(
            "splitserve_router_kv_stream_fallbacks",
            "streamed hand-overs that fell back to the pull after the prefill, by reason",
            ["reason"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "splitserve_router_prefill_retries",
            "prefills retried on another worker after UNAVAILABLE",
            registry=r,
        )
        self.leases_released = Counter(
            "splitserve_router_leases_released",
            "prefill leases the router released (the decode side had not)",
            ["reason"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "splitserve_router_worker_healthy",
            "1 when the worker receives requests",
            ["role", "address"],
            registry=r,
        )
        self.worker_queue = Gauge(
            "splitserve_router_worker_queue",
            "waiting + running requests (last GetLoad)",
            ["role", "address"],
            registry=r,
        )
        self.worker_free_blocks = Gauge(
            "splitserve_router_worker_free_blocks",
            "free KV blocks (last GetLoad)",
            ["role", "address"],
            registry=r,
        )
        self.http_requests = Counter(
            "splitserve_router_http_requests",
            "OpenAI HTTP API requests by route and status code (499: client gone)",
            ["route", "status"],
            registry=r,
        )
        # by role and reason, not address: the series outlive a removed worker (pod churn must
        # not grow them, and "removed" must stay visible); per-worker health is worker_healthy
        self.worker_evictions = Counter(
            "splitserve_router_worker_evictions",
            "healthy -> evicted transitions and removals of workers, by reason (EVICTION_REASONS)",
            ["role", "reason"],
            registry=r,
        )

    def evictions(self, role: str) -> dict[str, int]:
        """reason -> evictions of `role` workers so far (reasons never seen left out)."""
        out = {}
        for metric in self.worker_evictions.collect():
            for sample in metric.samples:
                if (
                    sample.name.endswith("_total")
                    and sample.labels["role"] == role
                    and sample.value
                ):
                    out[sample.labels["reason"]] = int(sample.value)
        return out

    def forget_worker(self, role: str, address: str) -> None:
        for metric in (self.worker_healthy, self.worker_queue, self.worker_free_blocks):
            try:
                metric.remove(role, address)
            except KeyError:
                pass
