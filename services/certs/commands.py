"""Client commands: `waygate cert issue | bundle | inspect | status | rotate-ca`.

`cert issue` generates the private key here and sends only a CSR; the key is
written 0600 and never leaves this machine. Its bearer token comes from
`--token-file` or the WAYGATE_CERTS_TOKEN environment variable, never from the
command line: command lines are readable by every local user (/proc/PID/cmdline),
so `--token` is refused with a message saying where to put the token instead. Files are written only after the
CA answered, each atomically, so a failed call leaves the output directory as
it was.

`cert inspect` reads a local file (PEM or DER) and needs no server. Its exit
status says how usable the certificate is: 0 fine, 1 expired (or the file is
not a certificate), 2 under 20% of its lifetime left.

`cert status` (the CA generations, the CA rotation's phase and who holds its
next step, the trust consumers with the bundle each applied, and what this
replica issued, with expiry) and `cert rotate-ca` (`--force`: take the next
step of the rotation under way and list who will break) are admin calls: they
send the token of `--token-file` (or WAYGATE_CERTS_TOKEN; under `waygate up`,
the local user's admin token in the state directory) as `authorization: Bearer`.
`rotation_findings` is what `waygate check` says of the rotation.
"""

from __future__ import annotations

import argparse
import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from google.protobuf import duration_pb2, json_format

from waygate.certs.castate import KEY_ALGORITHMS, generate_key
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.components import by_command
from waygate.core.clientcli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE_OR_UNREACHABLE,
    ClientSettings,
    add_client_arguments,
    add_output_argument,
    channel_for,
    fail,
    render,
    run_client,
    table,
)
from waygate.core.errors import InvalidArgument
from waygate.core.files import write_file_atomically
from waygate.core.rotation import CLIENT_ONLY
from waygate.core.sans import identity_san, parse_san
from waygate.core.settings import load_settings, parse_duration, setting

DEFAULT_PORT = by_command(("certs", "serve")).port("grpc_port")
#: `cert inspect` exits 2 when less than this fraction of the lifetime remains.
LOW_LIFE_FRACTION = 0.2


# ---------------------------------------------------------------- files


def _pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


# ---------------------------------------------------------------- cert issue


def _csr_names(args: argparse.Namespace) -> list[str]:
    names = [identity_san(args.identity)]
    for kind, values in (("dns", args.dns), ("uri", args.uri), ("ip", args.ip)):
        for value in values:
            name = f"{kind}:{value}"
            if name not in names:
                names.append(name)
    return names


TOKEN_ENV = "WAYGATE_CERTS_TOKEN"
TOKEN_ON_COMMAND_LINE = (
    "--token is not accepted: a command line is readable by every local user "
    f"(/proc/PID/cmdline); put the token in a file (0600) and pass --token-file FILE, "
    f"or set the {TOKEN_ENV} environment variable"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IssueToken:
    """The token `cert issue` may take from the environment (never a flag, no config file)."""

    CONFIG_ENV: ClassVar[str | None] = None

    certs_token: str | None = setting(
        None, help="bearer token that authenticates you to the CA", env=TOKEN_ENV
    )


def _token(args: argparse.Namespace) -> str:
    """The bearer token from --token-file, else WAYGATE_CERTS_TOKEN; ValueError if neither."""
    if args.token_file is not None:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"token file {args.token_file} is empty")
        return token
    token = (load_settings(IssueToken).certs_token or "").strip()
    if not token:
        raise ValueError(f"give --token-file FILE or set {TOKEN_ENV} (never --token)")
    return token


def _issue(args: argparse.Namespace) -> int:
    if args.token is not None:
        return fail(TOKEN_ON_COMMAND_LINE, EXIT_USAGE_OR_UNREACHABLE)
    try:
        lifetime = parse_duration(args.lifetime) if args.lifetime else None
        token = _token(args)
        names = [parse_san(n) for n in _csr_names(args)]
    except (ValueError, InvalidArgument) as exc:  # SettingsError is a ValueError
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
    out = Path(args.out)

    async def body(settings: ClientSettings) -> int:
        key = generate_key(args.key_algorithm)
        builder = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .add_extension(x509.SubjectAlternativeName(names), critical=True)
        )
        if args.client_only:  # the tunnel agent's role (certs issues what the CSR asks for)
            builder = builder.add_extension(CLIENT_ONLY, critical=False)
        csr = builder.sign(
            key, None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
        )
        request = certs_pb2.CertifyRequest(
            identity=args.identity,
            token=token,
            certificate_signing_request=csr.public_bytes(serialization.Encoding.DER),
        )
        if lifetime is not None:
            request.lifetime.FromTimedelta(timedelta(seconds=lifetime))
        async with channel_for(args, settings) as channel:
            stub = certs_pb2_grpc.CertsStub(channel)
            reply = await stub.Certify(request, timeout=settings.timeout)
            bundle = await stub.GetTrustBundle(
                certs_pb2.GetTrustBundleRequest(), timeout=settings.timeout
            )
        leaf_pem = _pem(reply.leaf_certificate)
        chain_pem = leaf_pem + b"".join(_pem(d) for d in reply.intermediate_certificates)
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_file_atomically(
            out / "key.pem",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
            0o600,
        )
        write_file_atomically(out / "cert.pem", leaf_pem, 0o644)
        write_file_atomically(out / "chain.pem", chain_pem, 0o644)
        write_file_atomically(out / "ca.pem", bundle.pem.encode(), 0o644)
        valid_until = reply.valid_until.ToDatetime(tzinfo=UTC)
        print(
            f"issued {reply.serial} for {args.identity}, valid until {valid_until.isoformat()}; "
            f"wrote key.pem (0600), cert.pem, chain.pem, ca.pem to {out}"
        )
        return EXIT_OK

    return run_client(args, body)


def configure_issue(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--identity", required=True, help="spiffe:// ID, DNS name or node name")
    parser.add_argument(
        "--token-file",
        help=f"file holding the bearer token that authenticates you to the CA (or set {TOKEN_ENV})",
    )
    # Still parsed, only to refuse it with the way out (a secret on a command line
    # is readable by every local user).
    parser.add_argument("--token", help=f"refused: use --token-file or {TOKEN_ENV}")
    parser.add_argument(
        "--out", required=True, help="directory for key.pem, cert.pem, chain.pem, ca.pem"
    )
    parser.add_argument("--dns", action="append", default=[], metavar="NAME", help="extra DNS SAN")
    parser.add_argument("--uri", action="append", default=[], metavar="URI", help="extra URI SAN")
    parser.add_argument("--ip", action="append", default=[], metavar="IP", help="extra IP SAN")
    parser.add_argument("--lifetime", help="requested lifetime, e.g. 24h (default: the CA's)")
    parser.add_argument(
        "--client-only",
        action="store_true",
        help="ask for extended key usage clientAuth only (a tunnel agent's certificate: "
        "the tunnel server registers no other as an agent)",
    )
    parser.add_argument(
        "--key-algorithm", default="ecdsa-p256", choices=KEY_ALGORITHMS, help="[%(default)s]"
    )
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_issue)


# ---------------------------------------------------------------- cert bundle


def _bundle(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            bundle = await certs_pb2_grpc.CertsStub(channel).GetTrustBundle(
                certs_pb2.GetTrustBundleRequest(), timeout=settings.timeout
            )
        if args.out:
            write_file_atomically(Path(args.out), bundle.pem.encode(), 0o644)
            print(
                f"wrote {len(bundle.authorities)} CA certificate(s), version {bundle.version}, to {args.out}"
            )
        else:
            print(bundle.pem, end="")
        return EXIT_OK

    return run_client(args, body)


def configure_bundle(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", help="write the PEM bundle here instead of stdout")
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_bundle)


# ---------------------------------------------------------------- cert inspect


def _load_certificates(data: bytes) -> list[x509.Certificate]:
    if b"-----BEGIN CERTIFICATE-----" in data:
        return x509.load_pem_x509_certificates(data)
    return [x509.load_der_x509_certificate(data)]


_KIND: dict[type, str] = {
    x509.DNSName: "dns",
    x509.UniformResourceIdentifier: "uri",
    x509.IPAddress: "ip",
}


def _names(cert: x509.Certificate) -> list[str]:
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [f"{_KIND.get(type(n), type(n).__name__)}:{n.value}" for n in sans]


def _duration(delta: timedelta) -> str:
    seconds = int(abs(delta.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{seconds}s"


def inspect_certificate(cert: x509.Certificate, now: datetime) -> tuple[list[str], int]:
    """Lines describing `cert` and the exit status it deserves at `now`."""
    not_before, not_after = cert.not_valid_before_utc, cert.not_valid_after_utc
    lifetime = not_after - not_before
    remaining = not_after - now
    fraction = remaining / lifetime if lifetime > timedelta(0) else 0.0
    if remaining <= timedelta(0):
        status, life = 1, f"EXPIRED {_duration(remaining)} ago"
    elif fraction < LOW_LIFE_FRACTION:
        status, life = 2, f"{_duration(remaining)} ({fraction:.0%} of its lifetime) - RENEW SOON"
    else:
        status, life = 0, f"{_duration(remaining)} ({fraction:.0%} of its lifetime)"
    lines = [
        f"subject:        {cert.subject.rfc4514_string() or '(empty)'}",
        f"SANs:           {', '.join(_names(cert)) or '(none)'}",
        f"key:            {key_type(cert)}",
        f"usage:          {', '.join(key_usages(cert)) or '(none)'}",
        f"CA:             {'yes' if is_ca(cert) else 'no'}",
        f"issuer:         {cert.issuer.rfc4514_string()}",
        f"serial:         {cert.serial_number:x}",
        f"not_before:     {not_before.isoformat()}",
        f"not_after:      {not_after.isoformat()}",
        f"remaining life: {life}",
    ]
    return lines, status


def key_type(cert: x509.Certificate) -> str:
    """ "ECDSA P-256", "RSA 2048", "Ed25519", ..."""
    key = cert.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        curve = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
        return f"ECDSA {curve.get(key.curve.name, key.curve.name)}"
    if isinstance(key, rsa.RSAPublicKey):
        return f"RSA {key.key_size}"
    if isinstance(key, ed25519.Ed25519PublicKey):
        return "Ed25519"
    if isinstance(key, ed448.Ed448PublicKey):
        return "Ed448"
    if isinstance(key, dsa.DSAPublicKey):
        return f"DSA {key.key_size}"
    return type(key).__name__


_EKU_NAMES = {
    x509.oid.ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    x509.oid.ExtendedKeyUsageOID.CODE_SIGNING: "codeSigning",
    x509.oid.ExtendedKeyUsageOID.EMAIL_PROTECTION: "emailProtection",
    x509.oid.ExtendedKeyUsageOID.OCSP_SIGNING: "OCSPSigning",
}


def key_usages(cert: x509.Certificate) -> list[str]:
    """Extended key usages (serverAuth, clientAuth, ...) then key usages."""
    names: list[str] = []
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        names += [_EKU_NAMES.get(oid, oid.dotted_string) for oid in eku]
    except x509.ExtensionNotFound:
        pass
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        return names
    for name in ("digital_signature", "key_encipherment", "key_cert_sign", "crl_sign"):
        if getattr(usage, name):
            names.append(name.replace("_", " "))
    return names


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def certificate_document(cert: x509.Certificate, now: datetime) -> dict[str, object]:
    """What `cert inspect -o json|yaml` prints for one certificate."""
    not_before, not_after = cert.not_valid_before_utc, cert.not_valid_after_utc
    return {
        "subject": cert.subject.rfc4514_string(),
        "sans": _names(cert),
        "key": key_type(cert),
        "usage": key_usages(cert),
        "ca": is_ca(cert),
        "issuer": cert.issuer.rfc4514_string(),
        "serial": f"{cert.serial_number:x}",
        "notBefore": not_before.isoformat(),
        "notAfter": not_after.isoformat(),
        "secondsLeft": int((not_after - now).total_seconds()),
    }


def _inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        data = path.read_bytes()
    except OSError as exc:
        return fail(f"cannot read {path}: {exc.strerror}", EXIT_FAILED)
    try:
        certificates = _load_certificates(data)
    except ValueError:
        return fail(f"{path} holds no PEM or DER certificate", EXIT_FAILED)
    now = datetime.now(UTC)
    worst = EXIT_OK
    texts = []
    for index, cert in enumerate(certificates):
        lines, status = inspect_certificate(cert, now)
        if len(certificates) > 1:
            lines.insert(0, f"certificate {index + 1} of {len(certificates)}:")
        texts.append("\n".join(lines))
        # Expired (1) is worse than low life (2).
        worst = status if worst == EXIT_OK or status == 1 else worst
    document = [certificate_document(cert, now) for cert in certificates]
    print(render(document, args.output, lambda _wide: "\n".join(texts)))
    return worst


def configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="PEM or DER certificate file")
    add_output_argument(parser)
    parser.set_defaults(func=_inspect)


# ---------------------------------------------------------------- cert status, rotate-ca


def _admin_token(args: argparse.Namespace, settings: ClientSettings) -> str:
    """--token-file, else WAYGATE_CERTS_TOKEN, else the local user's token that
    `waygate up` left in the state directory (admin under `up`)."""
    if args.token_file is None:
        state_dir = settings.found_state_dir()
        mine = None if state_dir is None else state_dir / "tokens" / "user.token"
        if mine is not None and mine.is_file() and not load_settings(IssueToken).certs_token:
            args.token_file = mine
    try:
        return _token(args)
    except ValueError as exc:
        raise InvalidArgument(
            f"{exc}; an admin token (admin: true in certs' tokens file)"
        ) from None


def _when(stamp: object) -> str:
    return stamp.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # type: ignore[attr-defined]


def _left(stamp: object, now: datetime) -> str:
    left = stamp.ToDatetime(tzinfo=UTC) - now  # type: ignore[attr-defined]
    return f"EXPIRED {_duration(left)} ago" if left <= timedelta(0) else _duration(left)


_CA_STATES = {
    certs_pb2.CA_STATE_STAGED: "staged",
    certs_pb2.CA_STATE_ACTIVE: "active",
    certs_pb2.CA_STATE_RETIRING: "retiring",
}


def _status(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        try:
            token = _admin_token(args, settings)
        except InvalidArgument as exc:
            return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
        metadata = (("authorization", f"Bearer {token}"),)
        issued: list[certs_pb2.IssuedCertificate] = []
        async with channel_for(args, settings) as channel:
            stub = certs_pb2_grpc.CertsStub(channel)
            bundle = await stub.GetTrustBundle(
                certs_pb2.GetTrustBundleRequest(), timeout=settings.timeout
            )
            rotation = await _rotation_status(stub, settings.timeout, metadata)
            token_page = ""
            replica = ""
            while True:
                page = await stub.ListIssued(
                    certs_pb2.ListIssuedRequest(
                        include_expired=args.include_expired, page_token=token_page
                    ),
                    timeout=settings.timeout,
                    metadata=metadata,
                )
                issued += page.certificates
                replica = page.replica
                token_page = page.next_page_token
                if not token_page:
                    break
        now = datetime.now(UTC)
        document = {
            "bundleVersion": bundle.version,
            "authorities": [json_format.MessageToDict(a) for a in bundle.authorities],
            "replica": replica,
            "issued": [json_format.MessageToDict(c) for c in issued],
            "rotation": _rotation_document(rotation),
            "consumers": [_consumer_document(c) for c in rotation.consumers],
        }

        def text(wide: bool) -> str:
            lines = [f"trust bundle version {bundle.version}", ""]
            lines.append(
                table(
                    ("CA", "STATE", "NOT AFTER", "LEFT", "SHA-256"),
                    [
                        (
                            str(index + 1),
                            _CA_STATES.get(a.state, "?"),
                            _when(a.not_after),
                            _left(a.not_after, now),
                            a.fingerprint_sha256 if wide else a.fingerprint_sha256[:16],
                        )
                        for index, a in enumerate(bundle.authorities)
                    ],
                )
            )
            lines += ["", _rotation_line(rotation, now)]
            lines += [
                "",
                f"trust consumers reporting to {rotation.replica or 'this replica'}: "
                f"{len(rotation.consumers)}",
            ]
            if rotation.consumers:
                waiting = {(c.identity, c.instance) for c in rotation.waiting_for}
                lines.append(
                    table(
                        ("IDENTITY", "INSTANCE", "BUNDLE", "LAST REPORT", "HOLDS"),
                        [
                            (
                                c.identity,
                                c.instance,
                                str(c.bundle_version),
                                f"{_duration(now - c.last_report.ToDatetime(tzinfo=UTC))} ago",
                                rotation.next_step
                                if (c.identity, c.instance) in waiting
                                else ("-" if c.live else "(silent)"),
                            )
                            for c in rotation.consumers
                        ],
                    )
                )
            lines += ["", f"issued by {replica or 'this replica'}: {len(issued)}"]
            if issued:
                header: tuple[str, ...] = ("IDENTITY", "SERIAL", "NOT AFTER", "LEFT")
                if wide:
                    header += ("DNS", "REQUESTED BY")
                rows = []
                for c in issued:
                    row: tuple[str, ...] = (
                        c.identity,
                        c.serial[:16],
                        _when(c.not_after),
                        _left(c.not_after, now),
                    )
                    if wide:
                        row += (",".join(c.dns_names) or "-", c.requested_by or "-")
                    rows.append(row)
                lines.append(table(header, rows))
            return "\n".join(lines)

        print(render(document, args.output, text))
        return EXIT_OK

    return run_client(args, body)


_PHASES = {
    certs_pb2.ROTATION_PHASE_IDLE: "idle",
    certs_pb2.ROTATION_PHASE_PREPARE: "prepare",
    certs_pb2.ROTATION_PHASE_ACTIVATE: "activate",
    certs_pb2.ROTATION_PHASE_RETIRE: "retire",
}


async def _rotation_status(
    stub: certs_pb2_grpc.CertsStub, timeout: float, metadata: Any
) -> certs_pb2.RotationStatus:
    """GetRotationStatus; an empty status from a certs that predates it."""
    try:
        return await stub.GetRotationStatus(
            certs_pb2.GetRotationStatusRequest(), timeout=timeout, metadata=metadata
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return certs_pb2.RotationStatus()


def _consumer_document(consumer: certs_pb2.TrustConsumer) -> dict[str, object]:
    return {
        "identity": consumer.identity,
        "instance": consumer.instance,
        "generation": consumer.bundle_version,
        "lastReport": _when(consumer.last_report),
        "live": consumer.live,
        "fingerprints": list(consumer.fingerprints_sha256),
    }


def _rotation_document(status: certs_pb2.RotationStatus) -> dict[str, object]:
    document: dict[str, object] = {
        "phase": _PHASES.get(status.phase, "unknown"),
        "nextStep": status.next_step,
        "waitingFor": [f"{c.identity} ({c.instance})" for c in status.waiting_for],
    }
    if status.HasField("not_before"):
        document["notBefore"] = _when(status.not_before)
    return document


def _rotation_line(status: certs_pb2.RotationStatus, now: datetime) -> str:
    phase = _PHASES.get(status.phase, "unknown")
    if not status.next_step:
        return f"CA rotation: {phase}"
    line = f"CA rotation: {phase}; next step {status.next_step}"
    if status.HasField("not_before") and status.not_before.ToDatetime(tzinfo=UTC) > now:
        line += f" not before {_when(status.not_before)}"
    if status.waiting_for:
        names = ", ".join(f"{c.identity} ({c.instance})" for c in status.waiting_for)
        line += f"; HELD BY {len(status.waiting_for)} consumer(s): {names}"
    return line


#: A rotation step held by consumers this long past its clock is worth a failure in
#: `waygate check` (before: a warning); the alert WaygateCertsRotationHeld agrees.
HELD_FAILS_AFTER = timedelta(minutes=15)


def rotation_findings(
    status: certs_pb2.RotationStatus, now: datetime
) -> list[tuple[str, str, str]]:
    """What `waygate check` says of the rotation and the consumers: (level, title,
    hint) with level "ok", "warn" or "failed"."""
    findings: list[tuple[str, str, str]] = []
    live = [c for c in status.consumers if c.live]
    versions = sorted({c.bundle_version for c in live})
    shown = ", ".join(str(v) for v in versions) or "-"
    findings.append(("ok", f"trust consumers: {len(live)} reporting (bundle versions {shown})", ""))
    if not status.next_step:
        return findings
    title = _rotation_line(status, now)
    if not status.waiting_for:
        findings.append(("ok", title, ""))
        return findings
    ready = status.not_before.ToDatetime(tzinfo=UTC) if status.HasField("not_before") else None
    held_long = ready is not None and now - ready > HELD_FAILS_AFTER
    hint = (
        "these processes have not applied the new trust bundle: check their trust-bundle "
        "watch (their log: 'trust bundle'); `waygate cert rotate-ca --force` moves on "
        "and they will fail to verify peers"
    )
    findings.append(("failed" if held_long else "warn", title, hint))
    return findings


async def fetch_rotation_status(
    stub: certs_pb2_grpc.CertsStub, timeout: float, token: str
) -> certs_pb2.RotationStatus:
    """GetRotationStatus with an admin token; an empty status from an older certs."""
    return await _rotation_status(stub, timeout, (("authorization", f"Bearer {token}"),))


def configure_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file", metavar="FILE", help="admin token [the state directory's user token]"
    )
    parser.add_argument("--include-expired", action="store_true", help="list expired ones too")
    add_output_argument(parser)
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_status)


def _rotate_ca(args: argparse.Namespace) -> int:
    try:
        delay = parse_duration(args.propagation_delay) if args.propagation_delay else None
    except ValueError as exc:
        return fail(f"--propagation-delay: {exc}", EXIT_USAGE_OR_UNREACHABLE)

    async def body(settings: ClientSettings) -> int:
        try:
            token = _admin_token(args, settings)
        except InvalidArgument as exc:
            return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
        request = certs_pb2.RotateCARequest(force=args.force)
        if delay is not None:
            request.propagation_delay.CopyFrom(duration_pb2.Duration(seconds=int(delay)))
        async with channel_for(args, settings) as channel:
            reply = await certs_pb2_grpc.CertsStub(channel).RotateCA(
                request,
                timeout=settings.timeout,
                metadata=(("authorization", f"Bearer {token}"),),
            )
        new = reply.new_authority
        if reply.forced_step:
            broken = [f"{c.identity} ({c.instance})" for c in reply.forced_past]
            text = f"forced the {reply.forced_step} step; " + (
                f"{len(broken)} consumer(s) had not acknowledged it and will break: "
                + ", ".join(broken)
                if broken
                else "no consumer was holding it"
            )
            print(render(json_format.MessageToDict(reply), args.output, lambda _wide: text))
            return EXIT_OK
        text = (
            f"new CA {new.fingerprint_sha256[:16]} published (bundle version "
            f"{reply.bundle.version}); it signs from {_when(reply.signing_switch_at)} at the "
            "earliest, once every trust consumer has acknowledged it (`waygate cert status` "
            f"shows who holds it); the old CA leaves the bundle after "
            f"{_when(reply.old_retire_after)}"
        )
        print(render(json_format.MessageToDict(reply), args.output, lambda _wide: text))
        return EXIT_OK

    return run_client(args, body)


def configure_rotate_ca(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-file", metavar="FILE", help="admin token [the state directory's user token]"
    )
    parser.add_argument(
        "--propagation-delay",
        metavar="DURATION",
        help="wait at least this long before the new CA signs (e.g. 1h); it also waits "
        "for every trust consumer to report the new CA [the CA's default]",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="a rotation is under way: take its next step now, although consumers have "
        "not acknowledged it, and list who will break",
    )
    add_output_argument(parser)
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_rotate_ca)


COMMANDS = {
    ("cert", "issue"): configure_issue,
    ("cert", "bundle"): configure_bundle,
    ("cert", "inspect"): configure_inspect,
    ("cert", "status"): configure_status,
    ("cert", "rotate-ca"): configure_rotate_ca,
}
