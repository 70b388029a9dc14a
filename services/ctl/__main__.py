"""`nextstate`: the operator's command line.

Each subcommand lives in its own module exposing `register(subparsers)`; this file only
assembles them, loads settings (environment, then `--redis-url` / `--prefix` flags) and
turns known errors into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.errors import NextstateError

COMMANDS = (
    "services.ctl.tail",
    "services.ctl.status",
    "services.ctl.dlq",
    "services.ctl.rollback",
    "services.ctl.importer",
    "services.ctl.up",
    "services.ctl.demo",
    "services.ctl.evals",
    "services.ctl.envs",
    "services.ctl.compose",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nextstate", description="Operate a nextstate deployment: streams, dead letters, the local stack."
    )
    parser.add_argument("--redis-url", help="overrides NEXTSTATE_REDIS__URL")
    parser.add_argument("--prefix", help="stream prefix; overrides NEXTSTATE_REDIS__PREFIX")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except NextstateError as exc:
        print(f"nextstate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
