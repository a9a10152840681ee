"""`splitserve serve` with different TP sizes for prefill and decode: the flags parse, each size
defaults to --tensor-parallel-size, and on CUDA each worker gets its own GPU range (prefill first,
decode after), refused before anything starts when the GPUs are too few. No process starts here:
the launch plan (each child's argv) is read off the launcher."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from splitserve.cli.launcher import Launcher
from splitserve.cli.serve_args import add_arguments
from splitserve.cli.serve_children import build
from splitserve.cli.serve_placement import worker_flags


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--port", "0", *argv])


def _plan(
    tmp_path: Path, args, num_prefill: int, num_decode: int, gpus: int
) -> dict[str, list[str]]:
    launcher = Launcher(tmp_path)
    build(
        launcher,
        args,
        tmp_path,
        num_prefill,
        num_decode,
        placement=worker_flags(args, num_prefill, num_decode, gpu_count=gpus),
    )
    return {c.name: (c.args() if callable(c.args) else c.args) for c in launcher.children}


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_worker_gets_its_own_gpus(tmp_path):
    args = _args(
        "--device",
        "cuda",
        "--prefill-tensor-parallel-size",
        "2",
        "--decode-tensor-parallel-size",
        "1",
        "--num-decode",
        "2",
    )
    plan = _plan(tmp_path, args, 1, 2, gpus=4)
    got = {
        name: (_flag(a, "--device"), _flag(a, "--tensor-parallel-size"))
        for name, a in plan.items()
        if name != "router"
    }
    assert got == {
        "prefill-0": ("cuda:0", "2"),
        "decode-0": ("cuda:2", None),
        "decode-1": ("cuda:3", None),
    }
    assert (
        _flag(plan["router"], "--device") is None
        and _flag(plan["router"], "--tensor-parallel-size") is None
    )


def test_sizes_default_to_tensor_parallel_size_and_start_at_device_index(tmp_path):
    plan = _plan(tmp_path, _args("--device", "cuda:2", "--tensor-parallel-size", "2"), 1, 1, gpus=6)
    assert [
        (_flag(plan[n], "--device"), _flag(plan[n], "--tensor-parallel-size"))
        for n in ("prefill-0", "decode-0")
    ] == [("cuda:2", "2"), ("cuda:4", "2")]
    plan = _plan(
        tmp_path,
        _args(
            "--device", "cuda", "--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"
        ),
        1,
        1,
        gpus=3,
    )
    assert (
        _flag(plan["decode-0"], "--device") == "cuda:2"
        and "--tensor-parallel-size" not in plan["decode-0"]
    )


def test_too_few_gpus_is_refused_naming_the_sizes():
    with pytest.raises(
        ValueError,
        match=r"1 prefill worker\(s\) x TP2 \+ 1 decode worker\(s\) x TP2 need 4 GPUs "
        r"from cuda:0 \(each worker its own\), but 2 are visible",
    ):
        worker_flags(_args("--device", "cuda", "--tensor-parallel-size", "2"), 1, 1, gpu_count=2)
    with pytest.raises(ValueError, match="need 3 GPUs from cuda:0"):
        worker_flags(
            _args("--device", "cuda", "--prefill-tensor-parallel-size", "2"), 1, 1, gpu_count=2
        )
    with pytest.raises(ValueError, match="--decode-tensor-parallel-size must be >= 1"):
        worker_flags(_args("--decode-tensor-parallel-size", "0"), 1, 1)


def test_tp1_workers_share_one_gpu_as_before_and_cpu_is_unchanged(tmp_path):
    prefill, decode = worker_flags(
        _args("--device", "cuda", "--num-decode", "2"), 1, 2, gpu_count=1
    )
    assert prefill == [["--device", "cuda"]] and decode == [["--device", "cuda"]] * 2
    prefill, decode = worker_flags(
        _args("--device", "cpu", "--prefill-tensor-parallel-size", "2"), 1, 1
    )
    assert prefill == [["--device", "cpu", "--tensor-parallel-size", "2"]] and decode == [
        ["--device", "cpu"]
    ]
    colocated = _plan(
        tmp_path, _args("--colocated", "--decode-tensor-parallel-size", "2"), 0, 1, gpus=0
    )
    assert (
        set(colocated) == {"decode-0", "router"}
        and _flag(colocated["decode-0"], "--tensor-parallel-size") == "2"
    )
    assert _flag(colocated["decode-0"], "--device") is None  # the workers' own default (auto)
