"""A stand-in for the `docker` CLI, for testing the sandbox's docker backend where no Docker
engine runs (tests/unit/test_sandbox_docker.py). Standard library only: it is run as a
script by the path of a wrapper that sets FAKE_DOCKER_STATE (the backend hands the CLI
only PATH, HOME and DOCKER_* of the worker's environment).

Every call is appended to `$FAKE_DOCKER_STATE/calls.jsonl` (its argv). Then:

    info ...               prints a server version
    run [--opt=value|--flag]... IMAGE ARGV...
                           image `fake/no-such-image`: docker's own error, exit 125; else
                           it becomes the "container": chdir to --workdir, environment from
                           the --env options only, exec ARGV (no isolation at all: tests
                           run only harmless commands through it)
    rm --force NAMES...    exit 0;   ps ...   prints nothing
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    state = os.environ["FAKE_DOCKER_STATE"]
    with open(os.path.join(state, "calls.jsonl"), "a") as f:
        f.write(json.dumps(argv) + "\n")
    if not argv:
        return 1
    if argv[0] == "info":
        print("99.0.0-fake")
        return 0
    if argv[0] in ("rm", "ps"):
        return 0
    if argv[0] != "run":
        print(f"fake docker: {argv[0]} is not faked", file=sys.stderr)
        return 1
    args = argv[1:]
    i = 0
    opts: list[str] = []
    while i < len(args) and args[i].startswith("-"):
        opts.append(args[i])
        i += 1
    image, command = args[i], args[i + 1:]
    if image == "fake/no-such-image":
        print(f"docker: Error response from daemon: pull access denied for {image}.", file=sys.stderr)
        return 125
    values = [o.split("=", 1) for o in opts if "=" in o]
    workdir = next(v for k, v in values if k == "--workdir")
    env = dict(v.split("=", 1) for k, v in values if k == "--env")
    os.chdir(workdir)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
