"""The certs service's sections of the status page (`waygate.core.statuspage`):
the CAs in the trust bundle with their state and time left, the CA rotation's
phase and who holds it, the trust consumers with the bundle each applied, and
the newest certificates issued with their time left. Read from the authority at
request time."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from waygate.certs.authority import Authority
from waygate.core.statuspage import Section, expiry_cell

#: Issued certificates listed (the newest; `waygate cert status` lists them all).
ISSUED_SHOWN = 50


def provider(authority: Authority) -> Callable[[], list[Section]]:
    def sections() -> list[Section]:
        now = datetime.now(UTC)
        bundle = authority.trust_bundle()
        cas = [
            [
                ca.state.value,
                ca.fingerprint[:16],
                ca.certificate.subject.rfc4514_string(),
                expiry_cell(ca.not_after, ca.certificate.not_valid_before_utc, now=now),
            ]
            for ca in bundle.authorities
        ]
        status = authority.rotation_status()
        holding = {(c.identity, c.instance) for c in status.gate.waiting_for}
        consumers = [
            [
                c.identity,
                c.instance,
                str(c.version),
                f"{int((now - c.reported_at).total_seconds())}s ago",
                status.gate.step
                if (c.identity, c.instance) in holding
                else ("-" if c in status.live else "silent"),
            ]
            for c in status.consumers
        ]
        rotation_note = f"CA rotation: {status.phase.value}"
        if status.gate.step:
            rotation_note += f"; next step {status.gate.step}"
            if status.gate.waiting_for:
                rotation_note += ", held by " + ", ".join(c.name for c in status.gate.waiting_for)
        issued = [
            [
                record.identity,
                record.serial[:16],
                record.requested_by,
                expiry_cell(record.not_after, record.not_before, now=now),
            ]
            for record in reversed(authority.list_issued(limit=ISSUED_SHOWN))
        ]
        return [
            Section(
                "Certificate authorities",
                ["state", "fingerprint", "subject", "expires in"],
                cas,
                note=f"trust bundle version {bundle.version}; {rotation_note}",
            ),
            Section(
                "Trust consumers",
                ["identity", "instance", "bundle version", "last report", "holds step"],
                consumers,
                note="the bundle each process reports it applied (ReportTrust)",
                empty="no process has reported yet",
            ),
            Section(
                "Issued certificates",
                ["identity", "serial", "requested by", "expires in"],
                issued,
                note=f"the newest {ISSUED_SHOWN} still valid; `waygate cert status` lists all",
                empty="none issued yet",
            ),
        ]

    return sections
