"""Generate the gRPC modules from ``spececd.proto``, reproducibly:

    python -m spececd.transports.grpc_stubs

writes ``spececd_pb2.py``, ``spececd_pb2.pyi`` and ``spececd_pb2_grpc.py`` next to the
``.proto``. It runs protoc from grpcio-tools with fixed arguments, and only the pinned
grpcio-tools (``dev`` extra), so the same ``.proto`` always gives the same bytes; a test
regenerates them and compares. Generated code checks at import that the installed
grpcio and protobuf are at least the versions that generated it (see pyproject.toml).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PROTO = Path(__file__).with_name("spececd.proto")
GRPCIO_TOOLS = "1.85.1"  # keep equal to the pin in pyproject.toml's dev extra
OUTPUTS = ("spececd_pb2.py", "spececd_pb2.pyi", "spececd_pb2_grpc.py")


def installed_tools() -> str | None:
    try:
        return metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return None


def generate(folder: Path) -> list[Path]:
    """Write the generated modules into ``folder``; return their paths."""
    if installed_tools() != GRPCIO_TOOLS:
        raise RuntimeError(f"the stubs are generated with grpcio-tools=={GRPCIO_TOOLS}, "
                           f"found {installed_tools()}: pip install 'spececd[dev]'")
    from grpc_tools import protoc

    root = PROTO.parents[2]  # the folder holding the spececd package: imports stay absolute
    with tempfile.TemporaryDirectory() as tmp:
        status = protoc.main(["protoc", f"--proto_path={root}", f"--python_out={tmp}",
                              f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                              str(PROTO.relative_to(root))])
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit status {status})")
        built = Path(tmp) / PROTO.parent.relative_to(root)
        folder.mkdir(parents=True, exist_ok=True)
        return [Path(shutil.copyfile(built / name, folder / name)) for name in OUTPUTS]


def main() -> int:
    for path in generate(PROTO.parent):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
