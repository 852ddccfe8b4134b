"""Command line: ``kvscope serve`` (the sidecar) and ``kvscope demo`` (the embedded default)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvscope import __version__
from kvscope.errors import ConfigError
from kvscope.explain import cli as explain
from kvscope.layout import dump as layout_dump
from kvscope.load import cli as loadgen
from kvscope.sidecar.config import ENV, from_sources
from kvscope.store import query, schema
from kvscope.twin.config import LAYOUTS, TwinConfig
from kvscope.whatif import cli as whatif


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint",
        dest="endpoints",
        action="append",
        help=f"ZMQ endpoint probes connect to, repeatable [{ENV['endpoints']}]",
    )
    p.add_argument("--host", help=f"HTTP bind address, default 127.0.0.1 [{ENV['host']}]")
    p.add_argument("--port", type=int, help=f"HTTP port, default 9477 [{ENV['port']}]")
    p.add_argument(
        "--health-timeout",
        dest="health_timeout_s",
        type=float,
        help=f"seconds without records or heartbeats before a probe is silent (/readyz "
             f"fails) [{ENV['health_timeout_s']}]",
    )
    p.add_argument(
        "--vllm-url", help=f"also scrape this vLLM server's /metrics [{ENV['vllm_url']}]"
    )
    p.add_argument(
        "--vllm-scrape-interval",
        dest="vllm_scrape_interval_s",
        type=float,
        help=f"seconds between scrapes of vLLM [{ENV['vllm_scrape_interval_s']}]",
    )
    p.add_argument("--token", help=f"bearer token for every route but /healthz and /readyz "
                                   f"[{ENV['token']}]")
    p.add_argument("--log-level", help=f"debug, info, warning or error [{ENV['log_level']}]")
    p.add_argument("--decision-log",
                   help=f"decision log file, '-' for stdout, 'off' [{ENV['decision_log']}]")
    p.add_argument("--clickhouse-dsn",
                   help=f"http(s)://..., chdb:///path or off; default embedded chDB in the "
                        f"data dir [{ENV['clickhouse_dsn']}]")
    p.add_argument("--clickhouse-ttl-days", type=int,
                   help=f"days ClickHouse keeps rows, default 30 [{ENV['clickhouse_ttl_days']}]")
    p.add_argument("--data-dir", help=f"embedded store and spool [{ENV['data_dir']}]")
    p.add_argument("--loki-url", help=f"also push decisions to this Loki [{ENV['loki_url']}]")
    p.add_argument("--loki-tenant", help=f"X-Scope-OrgID for Loki [{ENV['loki_tenant']}]")
    p.add_argument("--layout-interval", dest="layout_interval_s", type=float,
                   help=f"seconds between layout samples [{ENV['layout_interval_s']}]")
    p.add_argument("--tls-cert", help=f"PEM certificate: serve HTTPS [{ENV['tls_cert']}]")
    p.add_argument("--tls-key", help=f"PEM private key of --tls-cert [{ENV['tls_key']}]")
    p.add_argument("--hash-key-file",
                   help=f"secret keying prompt and API-key hashes [{ENV['hash_key_file']}]")
    p.add_argument("--probe-secret-file",
                   help=f"file holding the probe secret that tcp endpoints require (or set "
                        f"{ENV['probe_secret']}) [{ENV['probe_secret_file']}]")
    p.add_argument("--receive-buffer-bytes", type=int,
                   help=f"bytes of received frames held for ingestion, default 256 MiB "
                        f"[{ENV['receive_buffer_bytes']}]")
    p.add_argument("--decision-log-max-bytes", type=int,
                   help=f"rotate the decision log file at this size "
                        f"[{ENV['decision_log_max_bytes']}]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the sidecar: receive probe records, serve /metrics")
    _serve_args(serve)

    demo = sub.add_parser(
        "demo", help="every layer live in one command, no GPU: an engine, the probe, the "
                     "sidecar, clients through the SDK, findings at the end")
    demo.add_argument("--engine", choices=("twin", "vllm"), default="twin",
                      help="twin: vLLM's real scheduler in-process, no model (default); "
                           "vllm: a real vLLM server on the CPU with a tiny generated model")
    demo.add_argument("--port", type=int, default=9477, help="sidecar HTTP port (default 9477)")
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds, cutting the workload short if need be "
             "(default: run the workload, then serve until Ctrl-C)",
    )
    demo.add_argument(
        "--step-ms",
        type=float,
        default=10.0,
        help="pace of the twin's scheduler steps in ms; the workload's arrival waves are "
             "spaced in steps, so this also paces the clients (default 10)",
    )
    demo.add_argument("--requests", type=int, default=200,
                      help="requests the clients send, duplicates included (default 200)")
    demo.add_argument("--blocks", type=int, default=None,
                      help="KV blocks in the pool (default 64; 128 for full+sliding, 48 for "
                           "sliding)")
    demo.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    demo.add_argument("--layout", choices=LAYOUTS, default="full",
                      help="the model's KV layout, twin only (default full: one "
                           "full-attention group)")
    demo.add_argument("--sliding-window", type=int, default=TwinConfig.sliding_window,
                      metavar="TOKENS", help="window of the sliding-window layers "
                      f"(default {TwinConfig.sliding_window})")
    demo.add_argument("--async-scheduling", action="store_true",
                      help="vLLM's AsyncScheduler, one step in flight (the GPU default; "
                           "twin only)")
    demo.add_argument("--speculative-tokens", dest="num_speculative_tokens", type=int,
                      default=0, metavar="N", help="draft tokens per step of a "
                      "draft-model speculator, with N lookahead slots (twin only; default 0)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    demo.add_argument("--data-dir",
                      help="where the store, decision log and logs go (default: a new "
                           "temporary directory, kept after the demo)")
    whatif.add_parser(sub)
    loadgen.add_parser(sub)
    layout_dump.add_parser(sub)
    query.add_parser(sub)
    schema.add_parser(sub)
    explain.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "func"):  # commands registered with set_defaults(func=...)
        return int(args.func(args))
    if args.command == "serve":
        cli = {k: v for k, v in vars(args).items() if k != "command"}
        try:
            cfg = from_sources(cli)
        except ConfigError as exc:
            print(f"kvscope serve: {exc}", file=sys.stderr)
            return 2
        logging.basicConfig(
            level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        from kvscope.sidecar.server import Sidecar

        try:
            Sidecar(cfg).run()
        except Exception as exc:  # noqa: BLE001 - a clear line, not a traceback
            print(f"kvscope serve: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "demo":
        from kvscope.demo.run import run_demo

        return run_demo(args)
    if args.command == "whatif":
        return whatif.run(args)
    if args.command == "loadgen":
        return loadgen.run(args)
    if args.command == "layout":
        return layout_dump.run(args)
    if args.command == "query":
        return query.run(args)
    if args.command == "schema":
        return schema.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
