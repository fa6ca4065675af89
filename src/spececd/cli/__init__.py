"""The ``spececd`` command line. It owns the terminal: library code only logs.

    spececd demo                     the default pair, in-process, on built-in prompts
    spececd generate ...             one prompt, streamed or as JSON (--json); in-process,
                                     or against a server with --server URL (ws, grpc, http)
    spececd chat --server ...        an interactive chat, streaming the replies
    spececd api ...                  an OpenAI-compatible API and a playground page
    spececd serve ...                the verifier server (the cloud side)
    spececd bench ...                measurements, side by side
    spececd convert ...              a transformers folder to GGUF
    spececd devices                  the devices this machine can run models on

One module per command, each with ``add_parser`` and ``run``; the arguments the edge
commands share are in :mod:`spececd.cli.options`, what they print in
:mod:`spececd.cli.output`. Importing the command line imports no model runtime: torch,
transformers or llama.cpp load with the model that needs them.

Errors a user can cause print one line, ``spececd: error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from spececd.backends.startup import skip_unused_imports
from spececd.cli import api, bench, chat, convert, demo, devices, generate, serve
from spececd.cli.output import JsonLines
from spececd.errors import InputError, SpecECDError
from spececd.processes import exit_now
from spececd.protocol.errors import AuthFailed, IncompatibleModels, Unsupported, VersionMismatch

USER_ERRORS = (InputError, IncompatibleModels, AuthFailed, VersionMismatch, Unsupported)
COMMANDS = (demo, generate, chat, api, serve, bench, convert, devices)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spececd", description="Lossless speculative decoding: a small draft model "
        "proposes, a large target model verifies.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    parser.add_argument("--list-devices", action=devices.ListDevices,
                        help="list the devices models can run on here and exit "
                        "(= spececd devices)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def command() -> NoReturn:
    """The ``spececd`` command (and ``python -m spececd``): :func:`main` on the process's
    arguments, then an exit that skips the interpreter's teardown
    (:func:`spececd.processes.exit_now`). An error :func:`main` does not answer still
    ends the process the usual way, with its traceback."""
    exit_now(main())


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="spececd: %(message)s")
    if getattr(args, "log_format", "text") == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonLines())
    if not args.verbose:  # the hub client retries loudly when it cannot connect
        for name in ("huggingface_hub", "httpx", "transformers", "websockets"):
            logging.getLogger(name).setLevel(logging.ERROR)
    skip_unused_imports()
    try:
        return int(args.run(args))
    except USER_ERRORS as exc:
        print(f"spececd: error: {exc}", file=sys.stderr)
        return 2
    except SpecECDError as exc:
        print(f"spececd: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
