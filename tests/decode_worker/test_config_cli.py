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


def test_prefill_chunk_tokens_flag_and_serve_pass_it_to_decode_workers(tmp_path):
    from splitserve.cli.launcher import Launcher
    from splitserve.cli.serve_args import add_arguments as serve_arguments
    from splitserve.cli.serve_children import build

    args = _parse(["--model", "/m", "--prefill-chunk-tokens", "64"])
    cfg = load(None, config_overrides(args, decode_worker_cmd._OVERRIDES))
    assert cfg.prefill_chunk_tokens == 64
    default = load(None, config_overrides(_parse(["--model", "/m"]), decode_worker_cmd._OVERRIDES))
    assert default.prefill_chunk_tokens == 512
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        load(None, {"engine.model_path": "/m", "prefill_chunk_tokens": -1})
    p = argparse.ArgumentParser()
    serve_arguments(p)
    serve = p.parse_args(["--port", "0", "--device", "cpu", "--colocated"])
    for chunk, want in ((None, 512), (0, 0), (128, 128)):
        serve.prefill_chunk_tokens = chunk
        launcher = Launcher(tmp_path / "logs")
        build(launcher, serve, tmp_path, 0, 2)
        for child in launcher.children:
            if child.name.startswith("decode-"):
                argv = child.args() if callable(child.args) else child.args
                parsed = argparse.ArgumentParser()
                decode_worker_cmd.add_arguments(parsed)
                got = load(
                    None, config_overrides(parsed.parse_args(argv), decode_worker_cmd._OVERRIDES)
                )
                assert got.prefill_chunk_tokens == want, (chunk, child.name)
