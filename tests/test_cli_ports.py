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


@pytest.mark.parametrize("command", ["generate", "health"])
def test_an_address_whose_port_is_out_of_range_is_refused(command, capsys):
    parser = build_parser()
    tail = ["hello"] if command == "generate" else []
    for bad, why in (("127.0.0.1:500926672", "a port is 0..65535, not 500926672"),
                     ("127.0.0.1:0", "port 0 in '127.0.0.1:0'"), ("localhost", "not HOST:PORT: 'localhost'"),
                     (":50050", "not HOST:PORT: ':50050'"), ("127.0.0.1:x", "not a port number: 'x'")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([command, "--addr", bad, *tail])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --addr" in err and why in err, err
    for good in ("127.0.0.1:50050", "[::1]:50050", "sd-specdec-gateway:50050", "unix:/tmp/gateway.sock",
                 "dns:///gateway:50050"):
        assert parser.parse_args([command, "--addr", good, *tail]).addr == good
