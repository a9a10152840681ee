"""Prefill-worker config from YAML + CLI flags (cli/prefill_worker_cmd.py): --no-cuda-graph and
--prefill-graph-sizes land in the worker's config (flags over YAML, YAML kept where no flag is
given); bad sizes are refused with one error line naming the flag or the field."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from splitserve.cli import prefill_worker_cmd
from splitserve.cli.worker_args import config_overrides
from splitserve.prefill_worker.config import PrefillWorkerConfig


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    prefill_worker_cmd.register(sub)
    return parser.parse_args(["prefill-worker", *argv])


def _load(argv: list[str]) -> PrefillWorkerConfig:
    args = _parse(argv)
    return PrefillWorkerConfig.load(
        args.config, config_overrides(args, prefill_worker_cmd._OVERRIDES)
    )


def test_graph_flags_map_into_the_config(tmp_path):
    default = _load(["--model", "/m"])
    assert default.cuda_graph is True and default.prefill_graph_sizes is None
    cfg = _load(["--model", "/m", "--no-cuda-graph", "--prefill-graph-sizes", "16,64,256"])
    assert cfg.cuda_graph is False and cfg.prefill_graph_sizes == (16, 64, 256)
    # spaces and a trailing comma are fine; counts above the step budget load (capture caps
    # them: engine/prefill_graph_sizes.graph_sizes)
    cfg = _load(
        ["--model", "/m", "--max-num-batched-tokens", "512", "--prefill-graph-sizes", "16, 4096,"]
    )
    assert (
        cfg.prefill_graph_sizes == (16, 4096) and cfg.engine.scheduler.max_num_batched_tokens == 512
    )
    path = tmp_path / "prefill.yaml"
    path.write_text("engine: {model_path: /m}\ncuda_graph: false\nprefill_graph_sizes: [32, 128]\n")
    from_yaml = _load(["--config", str(path)])  # no flag: the YAML's values stay
    assert from_yaml.cuda_graph is False and from_yaml.prefill_graph_sizes == (32, 128)
    on_top = _load(["--config", str(path), "--prefill-graph-sizes", "8,24"])
    assert on_top.cuda_graph is False and on_top.prefill_graph_sizes == (8, 24)
    graphs_on = tmp_path / "on.yaml"
    graphs_on.write_text("engine: {model_path: /m}\ncuda_graph: true\n")
    assert _load(["--config", str(graphs_on), "--no-cuda-graph"]).cuda_graph is False


@pytest.mark.parametrize("sizes", [[0, 16], [], [16, -4]])
def test_bad_sizes_name_the_field_in_one_line(sizes):
    with pytest.raises(ValueError) as exc:
        PrefillWorkerConfig.load(None, {"engine.model_path": "/m", "prefill_graph_sizes": sizes})
    assert "prefill_graph_sizes" in str(exc.value) and "\n" not in str(exc.value)


def test_the_flag_refuses_what_is_not_a_list_of_counts():
    with pytest.raises(SystemExit):
        _parse(["--model", "/m", "--prefill-graph-sizes", "16,sixty"])


@pytest.mark.parametrize(
    "value, names, whole",
    [
        ("0,16", ("prefill_graph_sizes", "0, 16"), True),  # the config's validator
        (",", ("prefill_graph_sizes", "non-empty"), True),
        ("-16,32", ("prefill_graph_sizes", "-16"), True),
        ("16,1x", ("--prefill-graph-sizes", "'16,1x'"), False),  # argparse: usage, then the error
    ],
)
def test_cli_refuses_bad_sizes_with_one_error_line(tmp_path, value, names, whole):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli.prefill_worker_cmd",
            "--model",
            str(tmp_path),
            f"--prefill-graph-sizes={value}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert errors == lines[-1:], res.stderr  # one error line, the last
    assert all(n in errors[0] for n in names) and errors[0].startswith("splitserve prefill-worker")
    if whole:  # nothing else printed: no usage, no traceback
        assert len(lines) == 1, res.stderr
