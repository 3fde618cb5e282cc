"""Generated protobuf code is checked in and must match protos/ (`make protos-check`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "protos"))
import generate  # noqa: E402  (protos/generate.py, not a package)


def test_checked_in_code_matches_protos():
    result = subprocess.run(
        [sys.executable, "protos/generate.py", "check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "generated files match protos/" in result.stdout


def test_check_reports_drift(tmp_path, capsys):
    copy = tmp_path / "services"
    shutil.copytree(ROOT / "services", copy, ignore=shutil.ignore_patterns("__pycache__"))
    drifted = copy / "resolver" / "v1" / "resolver_pb2.py"
    drifted.write_text(drifted.read_text() + "\n# hand edit\n")
    (copy / "certs" / "v1" / "certs_pb2.pyi").unlink()
    assert generate.check(copy) == 1
    err = capsys.readouterr().err
    assert "differs from protos/: services/resolver/v1/resolver_pb2.py" in err
    assert "missing: services/certs/v1/certs_pb2.pyi" in err


def test_every_service_proto_package_is_importable():
    from waygate.certs.v1 import certs_pb2_grpc
    from waygate.resolver.v1 import resolver_pb2_grpc
    from waygate.tunnel.v1 import tunnel_pb2

    assert certs_pb2_grpc.CertsStub and resolver_pb2_grpc.ResolverStub
    assert tunnel_pb2.DESCRIPTOR.package == "waygate.tunnel.v1"
    assert tunnel_pb2.PacketType.Name(tunnel_pb2.WINDOW_UPDATE) == "WINDOW_UPDATE"
