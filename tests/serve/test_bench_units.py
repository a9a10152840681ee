"""The benchmark's pure parts: SLO parsing, arrival times, prompts, percentiles and goodput."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from splitserve.cli.bench.metrics import summarize
from splitserve.cli.bench.runner import RequestResult
from splitserve.cli.bench.workload import BenchConfig, arrival_offsets, make_prompts, parse_slo


def test_parse_slo():
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("e2e:2000") == {"e2el": 2000.0}
    for bad in ("ttft", "foo:1", "ttft:-1", "ttft:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY:MS"):
            parse_slo(bad)


def test_arrivals_poisson_rate_and_inf():
    assert not arrival_offsets(5, math.inf).any()
    t = arrival_offsets(4000, 20.0, seed=3)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert 4000 / t[-1] == pytest.approx(20.0, rel=0.1)
    assert np.array_equal(t, arrival_offsets(4000, 20.0, seed=3))


def test_prompts_random_and_file(tmp_path):
    cfg = BenchConfig(address="x:1", num_prompts=3, input_len=5, output_len=7, seed=1)
    ps = make_prompts(cfg, vocab_size=100)
    assert [p.known_input_len for p in ps] == [5, 5, 5] and all(max(p.prompt) < 100 for p in ps)
    assert ps == make_prompts(cfg, vocab_size=100)
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "hi"})
        + "\n\n"
        + json.dumps({"prompt_token_ids": [1, 2], "output_len": 3})
    )
    ps = make_prompts(BenchConfig(address="x:1", num_prompts=3, dataset=str(f), output_len=9), 100)
    assert [(p.prompt, p.output_len) for p in ps] == [("hi", 9), ((1, 2), 3), ("hi", 9)]
    f.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected"):
        make_prompts(BenchConfig(address="x:1", num_prompts=1, dataset=str(f)), 100)
    with pytest.raises(Exception, match="no such file"):
        BenchConfig(address="x:1", dataset=str(tmp_path / "nope.jsonl"))


def _res(i, ttft, e2e, n, itls=(), ok=True):
    return RequestResult(
        i,
        ok=ok,
        error=None if ok else "UNAVAILABLE: gone",
        input_len=4,
        output_len=n,
        ttft_s=ttft,
        itls_s=list(itls),
        e2e_s=e2e,
    )


def test_summary_stats_and_goodput():
    results = [
        _res(0, 0.1, 0.5, 5, [0.1] * 4),
        _res(1, 0.3, 1.1, 5, [0.2] * 4),
        _res(2, None, 0.2, 0, ok=False),
    ]
    s = summarize(results, 2.0, {"ttft": 200, "tpot": 150})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"UNAVAILABLE": 1})
    assert (
        s["total_output_tokens"] == 10
        and s["output_throughput"] == 5.0
        and s["request_throughput"] == 1.0
    )
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(
        200.0
    )
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 200) / 2)
    assert s["itl_ms"]["p99"] == pytest.approx(200.0)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5  # request 1 misses the TTFT SLO
    empty = summarize([], 1.0)
    assert empty["ttft_ms"]["mean"] is None and empty["goodput"] is None


def test_plot_needs_matplotlib_or_draws(tmp_path, capsys):
    from splitserve.cli import bench_cmd

    png = tmp_path / "cdf.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # one line, before any request is sent (nothing listens on port 1)
        assert bench_cmd.main(["--address", "127.0.0.1:1", "--plot", str(png)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--plot needs matplotlib" in err[0]
        return
    from splitserve.cli.bench.plot import plot_cdfs

    plot_cdfs(png, {"ttft": [1.0, 2.0], "tpot": [0.5], "itl": [], "e2el": [3.0, 4.0]}, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreachable_router_is_one_line(capsys):
    from splitserve.cli import bench_cmd

    assert bench_cmd.main(["--address", "127.0.0.1:1", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GetServerInfo on 127.0.0.1:1: UNAVAILABLE" in err[0], err
