"""The timings of `benchmarks/decode.py` (and `benchmarks/decode_tp.py`): the CUDA-graph decode
step against the same step run eagerly, the serving loop's wall time per step, and the device
copy bandwidth that sets the roofline; on CPU (a smoke test) the timers fall back to wall clock.
"""

from __future__ import annotations

import time


def time_ms(torch, fn, steps: int) -> float:
    """Mean ms per call of fn over `steps` calls: CUDA events on the GPU, wall clock on CPU."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def copy_bandwidth(torch, device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    time_ms(torch, lambda: dst.copy_(src), 3)
    secs = time_ms(torch, lambda: dst.copy_(src), 10) / 1e3
    src = dst = None  # free the buffers now (the closures above hold the names)
    return 2 * nbytes / secs


def fake_sequences(engine, batch: int, context: int, room: int):
    """`batch` sequences of `context` tokens whose KV blocks exist (values do not matter)."""
    from splitserve.decode_worker.sequence import DecodeSequence
    from splitserve.request.sampling_params import SamplingParams
    from splitserve.request.stop_checker import StopChecker

    params = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)
    per_seq = -(-(context + room + 1) // engine.runner.block_size)
    seqs = []
    for i in range(batch):
        got = engine.allocator.allocate(per_seq)
        if got is None:
            raise MemoryError(
                "KV pool too small for this batch; lower --context or the batch sizes"
            )
        stop = StopChecker(params, (), engine.runner.max_model_len, context)
        seqs.append(
            DecodeSequence(
                f"b{i}",
                [1] * context,
                params,
                stop,
                lambda out: None,
                [5],
                list(got.block_ids),
            )
        )
    return seqs


def kernel_times(torch, engine, eager_runner, batch: int, args) -> dict:
    from splitserve.decode_worker.graph_runner import GREEDY

    seqs = fake_sequences(engine, batch, args.context, 3 * args.steps + 8)
    g = engine.graphs
    size = g.dispatch[batch]
    out = {"graph_size": size}
    with torch.inference_mode():
        g.read(
            g.launch(seqs, changed=True)
        )  # full prepare; positions then advance inside the graph
        if size:
            graph = g._graphs[size, GREEDY]
            time_ms(torch, graph.replay, 3)
            out["graph_step_ms"] = time_ms(torch, graph.replay, args.steps)
        for s in seqs:
            s.in_flight = 0
        eager_runner.read(eager_runner.launch(seqs, changed=True))
        time_ms(torch, lambda: eager_runner._body(batch), 3)
        out["eager_step_ms"] = time_ms(torch, lambda: eager_runner._body(batch), args.steps)
    for s in seqs:
        engine.allocator.free(s.block_ids)
    return out


def engine_time(engine, batch: int, args, params_of=None, prefix: str = "e") -> float:
    """Wall ms per step of the serving loop (admit with KV present, fixed length); request i
    samples with params_of(i) (default greedy)."""
    from splitserve.decode_worker.sequence import DecodeInput
    from splitserve.request.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    for i in range(batch):
        got = engine.allocator.allocate(-(-args.context // engine.runner.block_size))
        params = greedy if params_of is None else params_of(i)
        engine.admit(
            DecodeInput(f"{prefix}{i}", [1] * args.context, 5, params),
            list(got.block_ids),
            lambda out: None,
        )
    engine.step()  # admission (slot fills) + full prepare
    t0 = time.perf_counter()
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    assert engine.allocator.num_free == engine.allocator.num_usable
    return (time.perf_counter() - t0) * 1e3 / max(steps, 1)
