"""Decode-worker config from YAML + CLI flags; bad values are one line naming the field."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from splitserve.cli import decode_worker_cmd
from splitserve.cli.worker_args import config_overrides
from splitserve.decode_worker.config import load


def _parse(argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    decode_worker_cmd.register(sub)
    return parser.parse_args(["decode-worker", *argv])


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "decode.yaml"
    path.write_text(
        "engine:\n  model_path: /m\n  scheduler: {max_batch_size: 64}\n"
        "server: {port: 7000}\ncuda_graph_sizes: [1, 2, 4]\n"
    )
    args = _parse(
        [
            "--config",
            str(path),
            "--port",
            "7001",
            "--no-cuda-graph",
            "--cuda-graph-sizes",
            "1,8,16",
            "--block-size",
            "8",
        ]
    )
    cfg = load(args.config, config_overrides(args, decode_worker_cmd._OVERRIDES))
    assert cfg.engine.scheduler.max_batch_size == 64 and cfg.server.port == 7001
    assert (
        cfg.cuda_graph is False
        and cfg.cuda_graph_sizes == (1, 8, 16)
        and cfg.engine.cache.block_size == 8
    )
    plain = _parse(["--model", "/m"])
    cfg = load(None, config_overrides(plain, decode_worker_cmd._OVERRIDES))
    assert cfg.cuda_graph is True and cfg.cuda_graph_sizes is None


@pytest.mark.parametrize(
    "override, field",
    [
        ({"cuda_graph_sizes": [0, 4]}, "cuda_graph_sizes"),
        ({"engine.cache.block_size": 12}, "block_size"),
        ({"server.port": 70000}, "server.port"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError) as exc:
        load(None, {"engine.model_path": "/m", **override})
    assert field in str(exc.value) and "\n" not in str(exc.value)


def test_cli_error_is_one_line(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli.decode_worker_cmd",
            "--model",
            str(tmp_path),
            "--block-size",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "block_size" in res.stderr
