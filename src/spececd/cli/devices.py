"""``spececd devices``: the devices models can run on here, by backend, and what
``--device npu`` would use."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("devices", help="list the devices models can run on here, by backend")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


class ListDevices(argparse.Action):
    """``spececd --list-devices``: ``spececd devices``, then exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.exit(run(argparse.Namespace(json=False)))


def run(args: argparse.Namespace) -> int:
    from spececd.backends.devices import available_devices, is_npu

    devices = available_devices()
    npus = [d for d in devices if is_npu(d)]
    if args.json:
        print(json.dumps(devices))
        return 0
    print(f"{'device':<10} {'backend':<10} detail")
    for d in devices:
        print(f"{d['device']:<10} {d['backend']:<10} {d['detail']}")
    if npus:
        print("--device npu uses: " + ", ".join(f"{d['backend']} {d['device']}" for d in npus))
    else:
        print("--device npu: no NPU here (neither OpenVINO's NPU nor ONNX Runtime's QNN "
              "provider); models asked for one run on the cpu")
    return 0
