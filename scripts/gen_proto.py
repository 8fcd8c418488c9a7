"""Generate fastpersist/_proto/ from proto/fastpersist.proto.

    python scripts/gen_proto.py           # rewrite the committed stubs
    python scripts/gen_proto.py --check   # exit 1 if they differ (tests/test_proto.py)

The stubs are committed so that installing fastpersist needs no protoc; the
check keeps them honest. protoc's gRPC module imports its message module as a
top-level name; it is rewritten to a relative import so the stubs live inside
the package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "fastpersist.proto"
OUT = ROOT / "fastpersist" / "_proto"
GENERATED = ("fastpersist_pb2.py", "fastpersist_pb2.pyi", "fastpersist_pb2_grpc.py")


def generate() -> dict[str, bytes]:
    from grpc_tools import protoc  # grpcio-tools: a test dependency only

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={tmp}",
            f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {PROTO} (exit {rc})")
        out = {name: (Path(tmp) / name).read_bytes() for name in GENERATED}
    out["fastpersist_pb2_grpc.py"] = out["fastpersist_pb2_grpc.py"].replace(
        b"\nimport fastpersist_pb2 as", b"\nfrom . import fastpersist_pb2 as"
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args()
    fresh = generate()
    if args.check:
        stale = [n for n, data in fresh.items()
                 if not (OUT / n).exists() or (OUT / n).read_bytes() != data]
        if stale:
            print(f"stale stubs in {OUT}: {', '.join(stale)}; run scripts/gen_proto.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for name, data in fresh.items():
        (OUT / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
