"""The decode engine's start-up, before SERVING (`DecodeEngine.warm_up`): the decode graphs and
the local prefill's piecewise graphs in one pool (CUDA with cuda_graph), every local-prefill
shape and first-token sampler variant (engine/prefill_warmup.py: recompute, colocated prompts),
the eager decode steps; only the null block is written, and the pool is zeroed after.

Eager decode steps: every batch size no captured graph serves (all of them with
--no-cuda-graph). A batch size can compile a kernel of its own: the decode
attention's split count (a constexpr planned from the batch size) and the small-M GEMV shape
class both depend on it, so each such size runs the step body once per variant before SERVING
(padding lanes on the null block, as graph capture's warm-up does). CUDA without tensor
parallelism only (followers replay rank 0's commands; capture is one of them, this is not)."""

from __future__ import annotations

import torch

from splitserve.decode_worker.config import capture_sizes
from splitserve.decode_worker.graph_runner import VARIANTS, GraphRunner
from splitserve.engine.prefill_graphs import capture_prefill_graphs
from splitserve.engine.prefill_warmup import warm_up_prefill


def warm_up(engine, zero: bool = True) -> list[int]:
    """Everything above for a DecodeEngine; returns the captured decode batch sizes. `zero`
    False leaves the zeroing of the pool to the start-up rehearsal (decode_worker/rehearsal.py)."""
    cfg, runner, graphs = engine.cfg, engine.runner, engine.graphs
    budget = cfg.engine.scheduler.max_num_batched_tokens
    if cfg.prefill_chunk_tokens:  # chunked prefill: no local prefill call is longer than a chunk
        budget = min(budget, cfg.prefill_chunk_tokens)
    if cfg.cuda_graph and runner.device.type == "cuda":
        sizes = capture_sizes(cfg, engine.max_batch_size, engine.allocator.num_usable)
        graphs.capture(sizes, cfg.warmup_steps)
        # the local prefill's pieces share the decode graphs' pool (one pool per worker)
        capture_prefill_graphs(runner, cfg.prefill_graph_sizes, budget, graphs.pool)
        if not runner.tp.enabled:  # first tokens of local prompts (engine/sampler_graphs.py)
            vocab = runner.model_config.vocab_size
            engine.sampler.capture_graphs(vocab, runner.device, graphs.pool)  # the one pool
    warm_up_prefill(runner, engine.sampler, budget, engine.max_batch_size)
    warm_eager_steps(graphs)
    if zero:
        runner.zero_kv()
    return graphs.captured_sizes


@torch.inference_mode()
def warm_eager_steps(graphs: GraphRunner) -> list[int]:
    """Runs the eager step body at each batch size without a graph; returns those sizes."""
    eager = [n for n in range(1, graphs.max_batch_size + 1) if not graphs.dispatch[n]]
    if graphs.device.type != "cuda" or graphs.runner.tp.enabled or not eager:
        return []
    graphs.bufs.reset()
    for n in eager:
        for variant in VARIANTS:
            graphs._body(n, variant)  # the step body the eager path runs (graph_runner.py)
    torch.cuda.synchronize(graphs.device)
    graphs.bufs.reset()
    graphs.sampling.reset()
    return eager
