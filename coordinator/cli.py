"""The `pdserve` command line: `serve` (the disaggregated server), `generate` (offline, one engine), `bench`
(load-test an OpenAI-compatible endpoint) and `sweep` (pool-sizing experiments; both in benchclient/)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from coordinator.serve_config import ConfigError, load_serve_config
from engine import cli as engine_cli


def _serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API from Ray prefill/decode pools")
    serve.add_argument("config", help="YAML config, e.g. configs/default.yaml")
    serve.add_argument("--host", help="overrides server.host")
    serve.add_argument("--port", type=int, help="overrides server.port")
    serve.add_argument("--ray-address", help="'auto' to join the running Ray cluster; default: the config's")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["bench"], ["sweep"]):
        return _bench_main(argv)
    if argv[:1] != ["serve"]:
        return engine_cli.main(argv)
    parser = argparse.ArgumentParser(prog="pdserve")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("server.host", args.host), ("server.port", args.port),
                                   ("ray_address", args.ray_address)) if v is not None}
    try:
        config = load_serve_config(args.config, overrides)
    except ConfigError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    from coordinator.serve import ListenError, serve  # after validation: imports Ray and FastAPI
    try:
        asyncio.run(serve(config))
    except ListenError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 3
    return 0


def _bench_main(argv: list[str]) -> int:
    from benchclient import cli as bench_cli  # lazy: only the benchmark needs httpx (and matplotlib for sweeps)
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_bench_parser(sub)
    bench_cli.add_sweep_parser(sub)
    args = parser.parse_args(argv)
    return bench_cli.bench_main(args) if args.command == "bench" else bench_cli.sweep_main(args)


if __name__ == "__main__":
    sys.exit(main())
