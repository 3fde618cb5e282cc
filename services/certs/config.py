"""The authority's settings: its CA, its leaves' lifetimes and bounds, the rotation's timings.

One validated object (`AuthorityConfig`), made by the service's settings
(`waygate.certs.app`) and read by the authority and its lifecycle modules.

Invariants:
- immutable; every bound it names is what the error messages quote;
- `auto_rotate_before` leaves room for the propagation delay and two maximum
  leaf lifetimes, so an expiring CA never shortens a leaf and the old CA
  retires before it expires.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from waygate.certs.consumers import REPORT_INTERVAL
from waygate.certs.csr import MAX_SANS
from waygate.certs.issuing import ISSUED_RECORDS, ISSUED_RECORDS_BYTES


@dataclasses.dataclass(frozen=True)
class AuthorityConfig:
    trust_domain: str = "waygate.local"
    organization: str = "Waygate"
    key_algorithm: str = "ecdsa-p256"
    ca_lifetime: timedelta = timedelta(days=365)
    default_lifetime: timedelta = timedelta(hours=24)
    max_lifetime: timedelta = timedelta(days=7)
    #: not_before is this far in the past, so peers with a slow clock accept the leaf.
    backdate: timedelta = timedelta(minutes=5)
    #: RotateCA's default minimum wait between publishing a new CA and signing with it
    #: (signing also waits for every live consumer to hold the new CA).
    propagation_delay: timedelta = timedelta(hours=1)
    leaf_bound_step: timedelta = timedelta(hours=1)
    #: Most SANs one CSR may ask for; more is INVALID_ARGUMENT naming this bound.
    max_sans: int = MAX_SANS
    #: Bounds of the in-memory ListIssued records (count, estimated bytes).
    issued_records: int = ISSUED_RECORDS
    issued_records_bytes: int = ISSUED_RECORDS_BYTES
    #: A consumer that has not reported for this long no longer holds a rotation step
    #: (the default leaf lifetime: a consumer silent longer holds no leaf of ours).
    consumer_ttl: timedelta = timedelta(hours=24)
    #: How long a rotation step waits, after this process starts judging them, for
    #: consumers to report (a few report intervals).
    consumer_settle: timedelta = timedelta(seconds=3 * REPORT_INTERVAL)

    @property
    def auto_rotate_before(self) -> timedelta:
        """Rotate by itself when the active CA has this much life left: room for the
        propagation delay and for two full leaf lifetimes, so leaves never get shortened
        by an expiring CA and the old CA can retire before it expires. So also the
        least life an upstream intermediate must have left at start."""
        return self.propagation_delay + 2 * self.max_lifetime
