"""Port arguments are checked when parsed: gRPC took 500926672 as 500926672
mod 65536 and bound that port, while `specdec serve` printed the one asked for."""
from __future__ import annotations

import pytest

from specdec.cli import build_parser

FLAGS = [("scorer", "--port"), ("scorer", "--metrics-port"), ("proposer", "--port"), ("gateway", "--port"),
         ("gateway", "--http-port"), ("serve", "--port"), ("serve", "--http-port")]


@pytest.mark.parametrize("command,flag", FLAGS, ids=[f"{c}{f}" for c, f in FLAGS])
def test_a_port_outside_0_to_65535_is_refused_naming_the_flag(command, flag, capsys):
    parser = build_parser()
    for bad, why in (("65536", "a port is 0..65535, not 65536"), ("500926672", "not 500926672"),
                     ("-1", "not -1"), ("http", "not a port number: 'http'")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([command, flag, bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and why in err, err
    for good in ("0", "65535", "50051"):
        assert getattr(parser.parse_args([command, flag, good]), flag[2:].replace("-", "_")) == int(good)
