"""Prometheus metrics of one prefill worker, in a registry of its own (several workers can
share a test process; the server exports this registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TOKENS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.queue_length = Gauge(
            "splitserve_prefill_queue_length", "requests waiting for admission", registry=r
        )
        self.running = Gauge(
            "splitserve_prefill_running_requests", "requests admitted, prompt not done", registry=r
        )
        self.batch_tokens = Histogram(
            "splitserve_prefill_batch_tokens",
            "prompt tokens computed per step",
            buckets=_TOKENS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "splitserve_prefill_step_seconds",
            "model time per prefill step",
            buckets=_LATENCY,
            registry=r,
        )
        self.step_thread_seconds = Histogram(
            "splitserve_prefill_step_thread_seconds",
            "a prefill step as its thread runs it: the model's launches, and for a step that "
            "ends a prompt its first tokens' sampling, which waits for the device; the rest of "
            "splitserve_prefill_step_seconds is the event loop's hop to and from that thread",
            buckets=_LATENCY,
            registry=r,
        )
        self.sampling_seconds = Histogram(
            "splitserve_prefill_sampling_seconds",
            "first-token sampling per step that finished prompts (device time)",
            buckets=(0.0001, 0.00025, 0.0005, *_LATENCY),
            registry=r,
        )
        self.handover_wait_seconds = Histogram(
            "splitserve_prefill_handover_wait_seconds",
            "lease grant to the first pull of its KV (the decode side's call, reservation, "
            "connect)",
            buckets=_LATENCY,
            registry=r,
        )
        self.stream_attach_wait_seconds = Histogram(
            "splitserve_prefill_stream_attach_wait_seconds",
            "streamed hand-over: how long a prompt's computed KV waited for its decode worker "
            "to attach (its block reservation: backpressure from a full decode pool; 0 when it "
            "attached before the first chunk was computed)",
            buckets=_LATENCY,
            registry=r,
        )
        self.grammar_compile_seconds = Histogram(
            "splitserve_prefill_grammar_compile_seconds",
            "Time to compile a structured-output constraint (cache misses only)",
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "splitserve_prefill_queue_seconds", "arrival to admission", buckets=_LATENCY, registry=r
        )
        self.ttft_seconds = Histogram(
            "splitserve_prefill_ttft_seconds",
            "the prefill worker's part of TTFT: arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "splitserve_prefill_prompt_tokens", "prompt tokens of finished prefills", registry=r
        )
        self.cached_tokens = Counter(
            "splitserve_prefill_cached_prompt_tokens",
            "prompt tokens served from the prefix cache",
            registry=r,
        )
        self.cached_ratio = Gauge(
            "splitserve_prefill_cached_token_ratio",
            "cached / total prompt tokens since start",
            registry=r,
        )
        self.requests = Counter(
            "splitserve_prefill_requests",
            "finished Prefill calls by outcome",
            ["outcome"],
            registry=r,
        )
        self.leases_held = Gauge(
            "splitserve_kv_leases_held", "KV leases held for decode workers", registry=r
        )
        self.lease_expired = Counter(
            "splitserve_kv_lease_expired", "leases that nobody released in time", registry=r
        )
        self.blocks_free = Gauge(
            "splitserve_kv_blocks_free",
            "free KV blocks (evictable cached ones included)",
            registry=r,
        )
        self.blocks_used = Gauge(
            "splitserve_kv_blocks_used", "KV blocks with a reference", registry=r
        )
        self.cached_blocks = Gauge(
            "splitserve_prefix_cache_blocks", "blocks with a prefix-cache hash", registry=r
        )

        self._totals = [0, 0]  # prompt, cached: the ratio gauge's source

    def count_prompt(self, num_tokens: int, num_cached: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.cached_tokens.inc(num_cached)
        self._totals[0] += num_tokens
        self._totals[1] += num_cached
        self.cached_ratio.set(self._totals[1] / self._totals[0])
