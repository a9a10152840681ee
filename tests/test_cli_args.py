"""Port flags reject out-of-range values with argparse's one-line error, for every service."""

from __future__ import annotations

import pytest

from splitserve.cli.main import build_parser


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "--http-port", "-1"],
        ["router", "--port", "x"],
        ["prefill-worker", "--metrics-port", "65536"],
        ["decode-worker", "--port", "99999"],
    ],
)
def test_bad_port_is_a_one_line_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "port" in err and ("0..65535" in err or "not a port number" in err)
    assert build_parser().parse_args([argv[0], argv[1], "0"]) is not None
