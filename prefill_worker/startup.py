"""The prefill engine's start-up and its counterpart at stop: piecewise prefill graphs
(engine/prefill_graphs.py) and the first token's sampling graphs (engine/sampler_graphs.py),
then every prefill shape and sampler variant (engine/prefill_warmup.py), all into the null
block, then the KV pool zeroed."""

from __future__ import annotations

from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.prefill_graphs import capture_prefill_graphs
from splitserve.engine.prefill_warmup import warm_up_prefill
from splitserve.engine.sampler import Sampler
from splitserve.prefill_worker.config import PrefillWorkerConfig


def warm_up(
    cfg: PrefillWorkerConfig, runner: ModelRunner, sampler: Sampler, zero: bool = True
) -> None:
    """Runs in the step thread before SERVING; `zero` False leaves the zeroing of the pool to
    the caller (after the start-up rehearsal, engine.start)."""
    sc = cfg.engine.scheduler
    if cfg.cuda_graph:
        graphs = capture_prefill_graphs(runner, cfg.prefill_graph_sizes, sc.max_num_batched_tokens)
        if graphs is not None:  # (this is the step thread: its dense attention's plans here)
            graphs.prepare_dense_here()
        if not runner.tp.enabled:  # the first token's sampling (engine/sampler_graphs.py)
            pool = runner.prefill_graphs.pool if runner.prefill_graphs is not None else None
            sampler.capture_graphs(runner.model_config.vocab_size, runner.device, pool)
    warm_up_prefill(runner, sampler, sc.max_num_batched_tokens, sc.max_batch_size)
    if zero:
        runner.zero_kv()


def release_graphs(runner: ModelRunner, sampler: Sampler) -> None:
    """Drops the prefill and sampling graphs (the runner may serve another engine later:
    benchmarks)."""
    sampler.release_graphs()
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.release()
        runner.prefill_graphs = None
