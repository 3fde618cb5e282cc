"""The bootstrap `waygate up` writes meets certs' contract, checked with certs' own code.

The tokens file is read by certs' real `StaticTokenAuthenticator` (which refuses
a file others can read), and each process's CSR, built the way the rotation
client builds it, is checked by certs' real `Policy`: each token gets exactly
its own process's names and nothing of another's.
"""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from waygate.certs.auth import StaticTokenAuthenticator
from waygate.certs.policy import Policy
from waygate.components import TRUST_DOMAIN, USER, process_identity, spiffe_id
from waygate.core.errors import PermissionDenied
from waygate.core.rotation import build_csr, generate_key
from waygate.supervisor import Bootstrap

NAMES = ("resolver", "tunnel-server", "proxy", "tunnel-agent", USER)


def csr_for(identity: str, sans: tuple[str, ...]) -> x509.CertificateSigningRequest:
    return x509.load_der_x509_csr(build_csr(generate_key(), identity, sans))


async def test_each_token_gets_its_own_process_names_and_no_others(tmp_path) -> None:
    bootstrap = Bootstrap(tmp_path, NAMES)
    bootstrap.write()
    assert stat.S_IMODE(bootstrap.tokens_file.stat().st_mode) == 0o600
    authenticator = StaticTokenAuthenticator.from_file(bootstrap.tokens_file)
    policy = Policy(TRUST_DOMAIN)
    tokens = set()
    for name in NAMES:
        token_file = bootstrap.token_file(name)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        tokens.add(token)
        caller = await authenticator.authenticate(token)
        assert caller is not None and caller.name == name
        identity, sans = (spiffe_id(name), ()) if name == USER else process_identity(name)
        policy.authorize_csr(caller, identity, csr_for(identity, sans))
        other = spiffe_id("certs" if name != "resolver" else "proxy")
        with pytest.raises(PermissionDenied):
            policy.authorize_csr(caller, other, csr_for(other, ()))
    assert len(tokens) == len(NAMES)


async def test_every_up_gets_fresh_tokens(tmp_path) -> None:
    bootstrap = Bootstrap(tmp_path, ("resolver", USER))
    bootstrap.write()
    first = bootstrap.token_file("resolver").read_text()
    bootstrap.write()
    assert bootstrap.token_file("resolver").read_text() != first
    authenticator = StaticTokenAuthenticator.from_file(bootstrap.tokens_file)
    assert await authenticator.authenticate(first.strip()) is None
