"""Prometheus metrics of a decode worker, on a registry of its own (one per engine, so tests
can run several engines in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    1.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram(
            "splitserve_decode_step_seconds",
            "Wall time of one decode step (schedule, launch, read of the previous)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "splitserve_decode_batch_size",
            "Sequences in a decode step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.graph_replays = Counter(
            "splitserve_decode_graph_replays", "Decode steps run as a CUDA graph replay", registry=r
        )
        self.eager_steps = Counter(
            "splitserve_decode_eager_steps",
            "Decode steps run eagerly (CPU, graphs off, or no graph covers the batch)",
            registry=r,
        )
        self.itl_seconds = Histogram(
            "splitserve_decode_itl_seconds",
            "Inter-token latency per sequence",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.kv_blocks_free = Gauge(
            "splitserve_decode_kv_blocks_free", "Free KV blocks", registry=r
        )
        self.kv_blocks_used = Gauge(
            "splitserve_decode_kv_blocks_used", "KV blocks held by requests", registry=r
        )
        self.running = Gauge(
            "splitserve_decode_running", "Sequences in the running batch", registry=r
        )
        self.waiting = Gauge(
            "splitserve_decode_waiting", "Sequences queued for admission", registry=r
        )
        self.kv_reserve_waits = Counter(
            "splitserve_decode_kv_reserve_waits_total",
            "streamed hand-overs that found the pool short and waited for blocks (backpressure)",
            registry=r,
        )
        self.kv_reserve_wait_seconds = Histogram(
            "splitserve_decode_kv_reserve_wait_seconds",
            "streamed hand-over: time to reserve the prompt's blocks (waits while the pool is full)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "splitserve_decode_preemptions", "Sequences preempted for recompute", registry=r
        )
        self.mask_seconds = Histogram(  # its count: the steps with a constrained row
            "splitserve_decode_mask_seconds",
            "Host time filling and copying structured-output token masks, per masked step",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.grammar_compile_seconds = Histogram(
            "splitserve_decode_grammar_compile_seconds",
            "Time to compile a structured-output constraint (cache misses only)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "splitserve_decode_recomputed_tokens",
            "Tokens re-prefilled locally (preemption or no KV handle)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "splitserve_decode_prompt_tokens",
            "Prompt tokens prefilled here for requests that had no prefill (colocated)",
            registry=r,
        )
        self.finished = Counter(
            "splitserve_decode_requests_finished",
            "Finished requests by reason",
            ["reason"],
            registry=r,
        )
