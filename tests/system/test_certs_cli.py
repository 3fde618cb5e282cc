"""`waygate certs serve` as a real process, driven by `waygate cert ...` subprocesses.

Covers: issue (key generated locally, 0600, cert/chain/ca written, openssl
verifies), bundle (stdout and --out), inspect, a refusal that writes nothing,
a restart that keeps the CA, a start refused for a key file others can read,
the self-issued serving TLS that `waygate up` uses, a CA rotation that
rewrites the bundle file and shows in /metrics, and the bundle published to a
ConfigMap of a stand-in Kubernetes API server.
"""

from __future__ import annotations

import asyncio
import stat
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import duration_pb2

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.processes import http_get, run_cli, start_service
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system

TOKEN = "cli-" + "t" * 40
IDENTITY = "spiffe://waygate.local/ns/local/sa/user"


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {
                        "token": TOKEN,
                        "name": "user",
                        "allowed": [f"uri:{IDENTITY}", "dns:user.waygate.local", "ip:127.0.0.1"],
                    }
                ]
            }
        )
    )
    path.chmod(0o600)
    return path


def serve_argv(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--ca-dir", str(tmp_path / "ca"), "--tokens-file", str(tokens_file(tmp_path)),
        "--bundle-file", str(tmp_path / "bundle.pem"), *extra,
    ]  # fmt: skip


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def openssl_verify(ca: Path, leaf: Path, *check: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        "openssl", "verify", "-CAfile", str(ca), *check, str(leaf),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await process.communicate()
    return process.returncode or 0, out.decode()


async def test_issue_bundle_inspect_restart(tmp_path: Path) -> None:
    certs = await start_service(serve_argv(tmp_path))
    try:
        assert (await http_get(certs.admin_port, "/readyz"))[0] == 200
        out_dir = tmp_path / "out"
        code, out, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY,
            "--out", str(out_dir), "--dns", "user.waygate.local",
            "--ip", "127.0.0.1", "--lifetime", "2h", cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": TOKEN},
        )  # fmt: skip
        assert code == 0, err
        assert f"for {IDENTITY}" in out
        assert mode(out_dir / "key.pem") == 0o600
        assert (out_dir / "ca.pem").read_text() == (tmp_path / "bundle.pem").read_text()
        assert (out_dir / "chain.pem").read_bytes().startswith((out_dir / "cert.pem").read_bytes())
        verified = await openssl_verify(
            out_dir / "ca.pem", out_dir / "cert.pem", "-purpose", "sslserver",
            "-verify_hostname", "user.waygate.local",
        )  # fmt: skip
        assert verified[0] == 0, verified[1]

        # --client-only: the tunnel agent's role, a client certificate that serves no TLS.
        client_dir = tmp_path / "client-only"
        code, out, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY,
            "--out", str(client_dir), "--client-only", cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": TOKEN},
        )  # fmt: skip
        assert code == 0, err
        client = await openssl_verify(
            client_dir / "ca.pem", client_dir / "cert.pem", "-purpose", "sslclient"
        )
        server = await openssl_verify(
            client_dir / "ca.pem", client_dir / "cert.pem", "-purpose", "sslserver"
        )
        assert client[0] == 0, client[1]
        assert server[0] != 0 and "unsuitable certificate purpose" in server[1], server[1]

        code, out, err = await run_cli("cert", "inspect", str(out_dir / "cert.pem"), cwd=tmp_path)
        assert code == 0, err
        assert f"uri:{IDENTITY}" in out and "dns:user.waygate.local" in out
        assert "issuer:         CN=waygate.local CA 1,O=Waygate" in out
        assert "remaining life: 1h59m" in out or "remaining life: 2h0m" in out

        code, out, _ = await run_cli("cert", "bundle", "--addr", certs.grpc_address, cwd=tmp_path)
        assert code == 0 and out == (tmp_path / "bundle.pem").read_text()
        code, out, _ = await run_cli(
            "cert", "bundle", "--addr", certs.grpc_address, "--out", str(tmp_path / "b.pem"),
            cwd=tmp_path,
        )  # fmt: skip
        assert (
            code == 0 and (tmp_path / "b.pem").read_text() == (tmp_path / "bundle.pem").read_text()
        )

        # A refusal: one line, exit 1, and nothing written.
        code, out, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY,
            "--out", str(tmp_path / "refused"), cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": "wrong-" + "x" * 40},
        )  # fmt: skip
        assert code == 1
        assert err.strip().splitlines() == [
            "waygate: UNAUTHENTICATED: the token does not authenticate any caller"
        ]
        assert not (tmp_path / "refused").exists()
    finally:
        assert await certs.stop() == 0

    bundle_before = (tmp_path / "bundle.pem").read_text()
    again = await start_service(serve_argv(tmp_path))
    try:
        code, out, _ = await run_cli("cert", "bundle", "--addr", again.grpc_address, cwd=tmp_path)
        assert code == 0 and out == bundle_before  # same CA after a restart
    finally:
        assert await again.stop() == 0


async def test_start_is_refused_for_a_key_others_can_read(tmp_path: Path) -> None:
    certs = await start_service(serve_argv(tmp_path))
    assert await certs.stop() == 0
    (key,) = (tmp_path / "ca").glob("*.key.pem")
    key.chmod(0o644)
    code, _, err = await run_cli(*serve_argv(tmp_path)[1:], cwd=tmp_path)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("waygate: certs: CA key file") and "mode 0644" in last
    assert "Traceback" not in err


async def test_self_issued_tls_serves_certify_and_the_cli_verifies_it(tmp_path: Path) -> None:
    certs = await start_service(
        serve_argv(
            tmp_path,
            "--serving-identity",
            "spiffe://waygate.local/ns/local/sa/certs",
            "--serving-sans",
            "dns:certs.waygate.local,ip:127.0.0.1",
        )
    )
    try:
        bundle = tmp_path / "bundle.pem"
        code, _, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY,
            "--out", str(tmp_path / "out"), "--ca-file", str(bundle),
            cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": TOKEN},
        )  # fmt: skip
        assert code == 0, err
        # Plaintext against the TLS listener fails, as one line, without a traceback.
        code, _, err = await run_cli(
            "cert", "bundle", "--addr", certs.grpc_address, "--plaintext", "--timeout", "3s",
            cwd=tmp_path,
        )  # fmt: skip
        assert code == 2 and "Traceback" not in err and err.startswith("waygate: ")
    finally:
        assert await certs.stop() == 0


async def test_rotation_rewrites_the_bundle_file_and_metrics_show_the_cas(tmp_path: Path) -> None:
    admin_token = "admin-" + "a" * 40
    argv = serve_argv(tmp_path)
    tokens = yaml.safe_load((tmp_path / "tokens.yaml").read_text())
    tokens["tokens"].append({"token": admin_token, "name": "ops", "admin": True})
    (tmp_path / "tokens.yaml").write_text(yaml.safe_dump(tokens))
    certs = await start_service(argv)
    try:
        bundle = tmp_path / "bundle.pem"
        assert mode(bundle) == 0o644 and bundle.read_text().count("BEGIN CERTIFICATE") == 1
        code, _, err = await run_cli(
            "cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY,
            "--out", str(tmp_path / "out"), cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": TOKEN},
        )  # fmt: skip
        assert code == 0, err
        async with grpc.aio.insecure_channel(certs.grpc_address) as channel:
            reply = await certs_pb2_grpc.CertsStub(channel).RotateCA(
                certs_pb2.RotateCARequest(propagation_delay=duration_pb2.Duration(seconds=3600)),
                metadata=(("authorization", f"Bearer {admin_token}"),),
                timeout=10,
            )
        assert reply.new_authority.state == certs_pb2.CA_STATE_STAGED
        # The file is rewritten before RotateCA answers.
        assert bundle.read_text().count("BEGIN CERTIFICATE") == 2 and mode(bundle) == 0o644
        status, metrics = await http_get(certs.admin_port, "/metrics")
        assert status == 200
        not_after = [
            line
            for line in metrics.splitlines()
            if line.startswith("waygate_certs_ca_not_after_timestamp_seconds{")
        ]
        assert len(not_after) == 2 and any('state="STAGED"' in line for line in not_after)
        assert "waygate_certs_issued_total 1.0" in metrics
    finally:
        assert await certs.stop() == 0


async def test_bundle_configmap_follows_the_bundle(tmp_path: Path) -> None:
    """--bundle-configmap against a STAND-IN Kubernetes API server (none can run here),
    reached through a real kubeconfig by the real `waygate certs serve` process."""
    with StandInAPI() as standin:
        standin.bearer_token = "stand-in-bearer"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "s", "cluster": {"server": standin.url}}],
                    "users": [{"name": "u", "user": {"token": "stand-in-bearer"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "s", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        certs = await start_service(
            serve_argv(
                tmp_path, "--kubeconfig", str(kubeconfig), "--bundle-configmap", "waygate/trust"
            )
        )
        try:
            async with asyncio.timeout(20):
                while True:
                    try:
                        configmap = standin.get("v1", "ConfigMap", "trust", namespace="waygate")
                        break
                    except Exception:
                        await asyncio.sleep(0.05)
            assert configmap["data"]["ca.pem"] == (tmp_path / "bundle.pem").read_text()
        finally:
            assert await certs.stop() == 0


async def test_serve_under_an_upstream_root_refuses_a_short_lived_intermediate(
    tmp_path: Path,
) -> None:
    """`--ca-cert/--ca-key/--trust-anchor`: an intermediate with less life than two
    maximum leaf lifetimes plus the propagation delay is refused at start, with the
    reason; a long-lived one is served, its root published as the trust bundle."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from tests.integration.certs.test_upstream_authority import DAY, OrgCA

    now = datetime.now(UTC)
    root = OrgCA("Example Root", now, 3650 * DAY)

    def write(name: str, lifetime_days: int) -> list[str]:
        intermediate = OrgCA(name, now, lifetime_days * DAY, root)
        folder = tmp_path / name
        folder.mkdir()
        (folder / "root.pem").write_bytes(root.cert.public_bytes(serialization.Encoding.PEM))
        (folder / "ca.pem").write_bytes(intermediate.cert.public_bytes(serialization.Encoding.PEM))
        key = folder / "ca.key"
        key.write_bytes(
            intermediate.key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key.chmod(0o600)
        return [
            "--ca-dir", str(folder / "state"), "--ca-cert", str(folder / "ca.pem"),
            "--ca-key", str(key), "--trust-anchor", str(folder / "root.pem"),
        ]  # fmt: skip

    code, _, err = await run_cli(*serve_argv(tmp_path, *write("short", 10))[1:])
    assert code != 0
    # Leaves of at most 7 days (the default) and a 1 h propagation delay: 14 days.
    assert "rotating safely needs at least 14.0 days" in err
    assert not (tmp_path / "short" / "state").exists()

    certs = await start_service(serve_argv(tmp_path, *write("long", 90)))
    try:
        bundle = x509.load_pem_x509_certificates((tmp_path / "bundle.pem").read_bytes())
        assert bundle == [root.cert]
    finally:
        await certs.stop()
