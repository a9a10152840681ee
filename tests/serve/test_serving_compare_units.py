"""benchmarks/serving_compare.py's logic without processes: the fair placement (both modes get the
same GPUs for N = 1, 2, 4; bad ratios are one clear error), the sweep's arithmetic on synthetic
points (median and spread over repeats, sustainable rate, when the sweep goes past its list, the
goals), --resume's merge and its refusal of a file measured differently, and the CLI's one-line
errors before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from bench_import import BENCHMARKS, bench_module

sw = bench_module("serving_sweep")
plan_placement = bench_module("serving_placement").plan_placement
Traffic = bench_module("serving_points").Traffic
point_seed = bench_module("serving_points").point_seed
load_resume = bench_module("serving_report").load_resume


@pytest.mark.parametrize(
    ("gpus", "prefill", "decode"),
    [(1, ["cuda:0"], ["cuda:0"]), (2, ["cuda:0"], ["cuda:1"]), (4, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])],
)  # fmt: skip
def test_both_modes_get_the_same_gpus(gpus, prefill, decode):
    plan = plan_placement(gpus)
    dis, col = plan["disaggregated"], plan["colocated"]
    want = [f"cuda:{i}" for i in range(gpus)]
    assert dis["devices"] == col["devices"] == want
    assert [d for w, d in dis["workers"].items() if w.startswith("prefill")] == prefill
    assert [d for w, d in dis["workers"].items() if w.startswith("decode")] == decode
    assert list(col["workers"]) == [f"decode-{i}" for i in range(gpus)]  # N replicas, one a GPU
    assert sorted(col["workers"].values()) == want
    assert "--colocated" in col["serve_flags"] and "--colocated" not in dis["serve_flags"]
    assert dis["env"] == col["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    assert dis["shared_gpu"] is (gpus == 1)  # one GPU: serve runs both roles under MPS
    assert col["shared_gpu"] is False


def test_pd_ratio_and_visible_devices():
    plan = plan_placement(4, "1:3", visible="2,3,5,7,9")
    dis = plan["disaggregated"]
    assert dis["workers"] == {
        "prefill-0": "cuda:0",
        "decode-0": "cuda:1",
        "decode-1": "cuda:2",
        "decode-2": "cuda:3",
    }
    assert dis["env"]["CUDA_VISIBLE_DEVICES"] == plan["colocated"]["env"]["CUDA_VISIBLE_DEVICES"]
    assert dis["env"]["CUDA_VISIBLE_DEVICES"] == "2,3,5,7"
    assert plan_placement(3)["disaggregated"]["serve_flags"][:4] == [
        "--num-prefill",
        "1",
        "--num-decode",
        "2",
    ]  # fmt: skip  (the default rule: P = N // 2, decode takes the odd GPU)
    cpu = plan_placement(1, device="cpu")
    assert cpu["disaggregated"]["workers"] == {"prefill-0": "cpu", "decode-0": "cpu"}
    assert cpu["colocated"]["env"] == {}


@pytest.mark.parametrize(
    ("gpus", "ratio", "says"),
    [
        (4, "2:1", "P + D = 4"),
        (2, "0:2", "at least one GPU"),
        (2, "1:x", "whole numbers"),
        (2, "12", "P:D"),
        (1, "1:2", "one GPU holds one prefill and one decode"),
        (0, None, "--gpus must be >= 1"),
    ],
)
def test_bad_placement_is_one_clear_error(gpus, ratio, says):
    with pytest.raises(ValueError, match=re.escape(says)) as err:
        plan_placement(gpus, ratio)
    assert "\n" not in str(err.value)


def test_too_few_visible_gpus_and_bad_device():
    with pytest.raises(ValueError, match="names only 1"):
        plan_placement(2, visible="3")
    with pytest.raises(ValueError, match="give cuda"):
        plan_placement(1, device="cuda:1")


def _point(mode, rate, repeat, attainment, ttft=10.0, itl=5.0, **extra):
    metrics = {f: 1.0 for f in sw.FIGURES} | {"failed": 0}
    metrics |= {"slo_attainment": attainment, "ttft_p99_ms": ttft, "itl_p99_ms": itl, **extra}
    metrics["goodput"] = rate * attainment
    return {"mode": mode, "rate": rate, "repeat": repeat, "metrics": metrics}


def test_point_metrics_counts_failures_as_misses():
    summary = {
        "goodput": 3.0,
        "good_requests": 9,
        "failed": 1,
        "ttft_ms": {"median": 5.0, "p99": 9.0},
        "itl_ms": {"median": 1.0, "p99": 2.0},
        "tpot_ms": {"median": 1.5, "p99": 3.0},
        "ttft_breakdown": {"router_queue": {"median": 0.1, "p99": 0.4}},
    }
    m = sw.point_metrics(summary, sent=10)
    assert m["slo_attainment"] == 0.9 and m["ttft_p99_ms"] == 9.0 and m["itl_p50_ms"] == 1.0
    assert m["ttft_breakdown"] == summary["ttft_breakdown"] and "token2_breakdown" not in m
    assert sw.point_metrics({"goodput": None, "good_requests": None}, 5)["slo_attainment"] == 0.0


def test_aggregate_takes_the_median_with_its_spread():
    parts = [{"prefill_compute": {"median": m, "p99": 2 * m}} for m in (1.0, 3.0, 2.0)]
    points = [
        _point("colocated", 8, r, a, ttft=t, ttft_breakdown=b)
        for r, (a, t, b) in enumerate(zip((0.95, 0.80, 0.99), (30.0, 90.0, 50.0), parts))
    ]
    [entry] = sw.aggregate(points)
    assert (entry["rate"], entry["mode"], entry["repeats"]) == (8.0, "colocated", 3)
    assert entry["slo_attainment"] == 0.95 and entry["ttft_p99_ms"] == 50.0
    assert entry["spread"]["ttft_p99_ms"] == {"min": 30.0, "max": 90.0}
    assert entry["ttft_breakdown"] == {"prefill_compute": {"median": 2.0, "p99": 4.0}}


def test_sustainable_rate_is_the_highest_swept_rate_holding_90_percent():
    held = {4: 1.0, 8: 0.97, 16: 0.85, 32: 0.91, 48: 0.5}  # a noisy dip at 16 still counts 32
    sweep = sw.aggregate(
        [_point("disaggregated", r, 0, a) for r, a in held.items()]
        + [_point("colocated", r, 0, a) for r, a in {4: 0.95, 8: 0.89}.items()]
    )
    assert sw.sustainable_rate(sweep, "disaggregated") == 32.0
    assert sw.sustainable_rate(sweep, "colocated") == 4.0
    never = sw.aggregate([_point("colocated", 4, 0, 0.5)])
    assert sw.sustainable_rate(never, "colocated") == 0.0


def test_the_sweep_continues_while_either_mode_holds():
    both_fell = sw.aggregate(
        [_point("disaggregated", 128, 0, 0.7), _point("colocated", 128, 0, 0.2)]
    )
    assert sw.next_rate(both_fell, max_rate=1024) is None
    one_holds = sw.aggregate(
        [_point("disaggregated", 128, 0, 0.93), _point("colocated", 128, 0, 0.2)]
    )
    assert sw.next_rate(one_holds, max_rate=1024) == 256.0
    assert sw.next_rate(one_holds, max_rate=200) is None
    assert sw.next_rate([], max_rate=1024) is None


def test_goals_pass_and_fail_on_the_figures():
    points = []
    for rate, (ad, ac) in {
        8: (1.0, 1.0),
        16: (0.99, 0.95),
        32: (0.95, 0.6),
        64: (0.5, 0.1),
    }.items():
        points.append(_point("disaggregated", rate, 0, ad, ttft=40.0, itl=4.0))
        points.append(_point("colocated", rate, 0, ac, ttft=30.0, itl=15.0))
    doc = sw.build_doc({}, 1, {}, {}, points)
    assert doc["sustainable_rate"] == {"disaggregated": 32.0, "colocated": 16.0}
    assert doc["rows_rate"] == 16.0
    assert doc["rows"]["itl_ms_p99"] == {"disaggregated": 4.0, "colocated": 15.0, "ratio": 3.75}
    assert [g["pass"] for g in doc["goals"]] == [True, True, True, True]
    points.append(_point("disaggregated", 8, 1, 1.0, ttft=400.0, itl=4.0))  # a stall at 8 req/s
    points.append(_point("disaggregated", 8, 2, 1.0, ttft=400.0, itl=4.0))
    doc = sw.build_doc({}, 1, {}, {}, points)
    assert [g["pass"] for g in doc["goals"]] == [True, True, True, False]
    assert "8: 13.33x" in doc["goals"][-1]["detail"]
    none = sw.build_doc(
        {}, 1, {}, {}, [_point("colocated", 4, 0, 0.1), _point("disaggregated", 4, 0, 0.1)]
    )
    assert not any(g["pass"] for g in none["goals"]) and none["rows_rate"] == 4.0
    assert len(none["goals"]) == 4  # no 1 req/s point: no low-load goal
    for dis_p50, verdict in ((11.5, True), (12.5, False)):  # colocated's p50 is 10 ms
        low = [
            _point("colocated", 1, 0, 1.0, ttft_p50_ms=10.0),
            _point("disaggregated", 1, 0, 1.0, ttft_p50_ms=dis_p50),
        ]
        last = sw.build_doc({}, 1, {}, {}, low)["goals"][-1]
        assert "TTFT p50 <= colocated + 2 ms" in last["name"] and last["pass"] is verdict


def test_merge_replaces_points_of_the_same_key():
    old = [_point("colocated", 4, 0, 0.5), _point("disaggregated", 4, 0, 0.9)]
    new = [_point("colocated", 4, 0, 1.0), _point("colocated", 8, 0, 0.7)]
    merged = sw.merge_points(old, new)
    assert [sw.point_key(p) for p in merged] == [
        ("colocated", 4.0, 0), ("disaggregated", 4.0, 0), ("colocated", 8.0, 0),
    ]  # fmt: skip
    assert merged[0]["metrics"]["slo_attainment"] == 1.0


def test_resume_refuses_a_file_measured_differently(tmp_path):
    import json

    config = {
        "gpus": 1,
        "pd_ratio": "1:1",
        "device": "cuda",
        "workload": "mixed",
        "slo": "ttft:300",
        "model_dir": "m",
        "seed": 0,
        "point_seconds": 10.0,
        "min_prompts": 100,
        "serve_args": "",
        "prefill_sm_share": None,
        "num_blocks": 16000,
        "max_model_len": 4096,
    }
    doc = sw.build_doc(
        config, 1, {}, {"colocated": {"prompts": 4}}, [_point("colocated", 4, 0, 1.0)]
    )
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    points, warmup = load_resume(str(path), config)
    assert len(points) == 1 and warmup == {"colocated": {"prompts": 4}}
    with pytest.raises(ValueError, match=r"measured with gpus=1, this run has 2"):
        load_resume(str(path), config | {"gpus": 2})
    with pytest.raises(ValueError, match=r"measured with point_seconds=10.0, this run has 6"):
        load_resume(str(path), config | {"point_seconds": 6})


def test_point_seeds_match_across_modes_and_differ_across_points():
    seeds = {point_seed(0, r, k) for r in (4, 8, 16, 32, 48, 64, 96, 128) for k in range(3)}
    assert len(seeds) == 24 and min(seeds) >= 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "serving_compare.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--gpus", "2", "--pd-ratio", "3:1"), "P + D = 2"),
        (("--rates", "4,x"), "--rates wants req/s"),
        (("--repeats", "2", "--repeat-index", "2"), "--repeat-index must lie in 0..1"),
        (("--modes", "both"), "--modes takes"),
        (("--slo", "ttft=3"), "--slo wants KEY:MS"),
        (("--model-dir", "/nonexistent"), "--model-dir /nonexistent: not a checkpoint folder"),
    ],
)
def test_cli_errors_are_one_line_before_anything_starts(tiny_llama, args, says):
    done = _cli("--model-dir", str(tiny_llama), "--workload", "mixed", *args)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert done.stdout == ""


def test_realistic_workload_is_what_bench_parses():
    import argparse

    from splitserve.cli.bench_cmd import add_arguments

    argv = Traffic(argparse.Namespace(workload="realistic"), BENCHMARKS).argv(40, 7)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    assert (args.traffic, args.num_prompts, args.seed) == ("realistic", 40, 7)


def test_plot_of_a_finished_sweep_or_one_line_without_matplotlib(tmp_path):
    import json

    points = [_point(m, r, 0, a) for r, a in ((8, 1.0), (16, 0.8)) for m in sw.MODES]
    src = tmp_path / "s.json"
    src.write_text(json.dumps(sw.build_doc({"slo": "ttft:300"}, 1, {}, {}, points)))
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "serving_plot.py"), str(src), str(tmp_path / "s.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert "pip install matplotlib" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
