"""`decode.py --sampling`: engine ms per decode step for the sampling parameters users send,
each mode divided by greedy measured in the same run (issue 30's table).

Modes (every row of the batch in that mode; "mixed": a quarter each of the four non-greedy):

    greedy          temperature 0
    temp_top_p      temperature 0.7, top_p 0.9
    seeded_top_k    seed per request, top_k 50, temperature 1
    penalties       repetition 1.1, frequency 0.5, presence 0.5, temperature 1
    logprobs5       temperature 1, logprobs 5
    mixed           the four above, a quarter each

Each figure is the median of --repeats rounds (greedy and every mode timed in each round).
"""

from __future__ import annotations

import statistics

from decode_timing import engine_time

MODES = ("greedy", "temp_top_p", "seeded_top_k", "penalties", "logprobs5", "mixed")


def mode_params(mode: str, i: int, max_tokens: int):
    from splitserve.request.sampling_params import SamplingParams

    base = {"max_tokens": max_tokens, "ignore_eos": True}
    if mode == "mixed":
        mode = MODES[1 + i % 4]
    extra = {
        "greedy": {"temperature": 0.0},
        "temp_top_p": {"temperature": 0.7, "top_p": 0.9},
        "seeded_top_k": {"seed": 1000 + i, "top_k": 50},
        "penalties": {
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.5,
        },
        "logprobs5": {"logprobs": 5},
    }[mode]
    return SamplingParams(**base, **extra)


def engine_step_ms(engine, batch: int, mode: str, args) -> float:
    """Wall ms per step of the serving loop, every request in `mode`."""
    return engine_time(engine, batch, args, lambda i: mode_params(mode, i, args.steps + 1), mode)


def sampling_results(engine, sizes, modes, args, log) -> list[dict]:
    """Per batch size: `args.repeats` rounds, each timing greedy and then every mode (so slow
    drift of the machine reaches all modes alike); a mode's figure is its median over rounds."""
    rows = []
    repeats = max(1, getattr(args, "repeats", 3))
    for b in sizes:
        engine_step_ms(engine, b, "greedy", args)  # warm the loop at this size
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode in modes:
                times[mode].append(engine_step_ms(engine, b, mode, args))
        greedy = statistics.median(times["greedy"])
        for mode in modes:
            ms = statistics.median(times[mode])
            row = {"batch": b, "mode": mode, "engine_step_ms": ms, "ratio_to_greedy": ms / greedy}
            log(f"  batch={b} mode={mode} engine_step_ms={ms:.3f} ratio={ms / greedy:.3f}")
            rows.append(row)
    return rows
