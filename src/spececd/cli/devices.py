"""``spececd devices``: the devices models can run on here, by backend."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("devices", help="list the devices models can run on here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from spececd.backends.registry import available_devices

    devices = available_devices()
    if args.json:
        print(json.dumps(devices))
    else:
        for d in devices:
            print(f"{d['device']:<10} {d['backend']:<6} {d['detail']}")
    return 0
