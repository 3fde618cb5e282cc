"""gRPC TLS that follows certificate rotation: server credentials, client channels.

- `dynamic_server_credentials`: grpc server credentials whose configuration
  fetcher gRPC calls before every new handshake; it hands over a new
  configuration only when the certificate or the bundle changed. Existing
  connections are untouched: nothing is dropped.
- `RotatingChannel`: grpc channel credentials are fixed when a channel opens,
  so this holder opens a new channel after every rotation and closes the old
  one after a grace period, letting calls in flight finish. Callers ask it for
  `channel()` each time they start a call or a stream (never keep the channel);
  a long-lived stream (a report, a tunnel) takes the channel with `hold()`
  instead, and the old channel stays open until the last holder lets go. A
  borrower of `lend()` hears when its channel is retired (`on_retired`) and
  moves its stream to `renew()` (the resolver Watch's handover), so a lent
  channel outlives a renewal by that borrower's bound, not indefinitely.
- `client_credentials`: channel credentials from the current certificate.
- `ProcessCertificates`: a process's rotating certificate and trust bundle with
  the gRPC and `ssl` TLS built on them (`waygate.certs.client` starts one).

`ssl` contexts are `waygate.core.tls`; the certs API client is
`waygate.certs.client` (core never imports a service's stubs). Keys are given
to grpc as bytes in memory, never written to disk.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc

from waygate.core.grpcclient import open_channel
from waygate.core.rotation import CertificateRotator, HeldCertificate, TrustBundle, TrustStore
from waygate.core.tls import ServerSSLContexts

# ---------------------------------------------------------------- gRPC servers


def dynamic_server_credentials(
    rotator: CertificateRotator, trust: TrustStore | None, *, client_auth: bool
) -> grpc.ServerCredentials:
    """Server credentials that present the current certificate and, with client_auth,
    require a client certificate chaining to the current trust bundle."""
    if client_auth and trust is None:
        raise ValueError("client_auth needs a trust store")
    served: list[tuple[HeldCertificate, TrustBundle | None]] = []

    def configuration() -> grpc.ServerCertificateConfiguration:
        held = rotator.current
        bundle = trust.current if (trust is not None and client_auth) else None
        served[:] = [(held, bundle)]
        return grpc.ssl_server_certificate_configuration(
            [(held.key_pem(), held.chain_pem())],
            root_certificates=bundle.pem if bundle is not None else None,
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this before each new handshake: None keeps what it has.
        held, bundle = served[0]
        current_bundle = trust.current if (trust is not None and client_auth) else None
        if rotator.current is held and current_bundle is bundle:
            return None
        return configuration()

    return grpc.dynamic_ssl_server_credentials(
        configuration(),
        fetch,  # type: ignore[arg-type]  # grpc documents None as "keep the current one"
        require_client_authentication=client_auth,
    )


# ---------------------------------------------------------------- clients


class RotatingChannel:
    """A grpc.aio channel to `address` that presents the current client certificate.

    Call `channel()` for every call or stream. After a rotation it returns a
    new channel; the previous one gets `close_grace` seconds for its calls in
    flight, then is closed. A stream that lives longer than that takes its
    channel with `async with rotating.hold() as channel:`; a held channel is
    closed only after the grace and once every holder has let go, so a
    rotation never cuts a long-lived stream (the connection keeps the
    certificate it was authenticated with; the next stream uses the new one).
    """

    def __init__(
        self,
        address: str,
        credentials: Callable[[], grpc.ChannelCredentials | None],
        subscribe: tuple[Callable[[Callable[[Any], None]], Callable[[], None]], ...] = (),
        *,
        server_name: str | None = None,
        close_grace: float = 30.0,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self._options = tuple(options)
        self._credentials = credentials
        self._server_name = server_name
        self._close_grace = close_grace
        self._channel: grpc.aio.Channel | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # Holders per channel, and the event a stale channel waits on to close.
        self._holders: dict[grpc.aio.Channel, int] = {}
        self._released: dict[grpc.aio.Channel, asyncio.Event] = {}
        # Borrowers (`LentChannel.on_retired`) to tell when their channel is retired.
        self._retiring: dict[grpc.aio.Channel, list[Callable[[], None]]] = {}
        self._unsubscribe = [add(self._stale) for add in subscribe]
        self.opened = 0  # channels opened so far

    def _stale(self, _changed: Any) -> None:
        old, self._channel = self._channel, None
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._close_when_released(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            for callback in self._retiring.pop(old, ()):
                callback()

    async def _close_when_released(self, old: grpc.aio.Channel) -> None:
        try:
            await asyncio.sleep(self._close_grace)
            while self._holders.get(old):
                released = self._released.setdefault(old, asyncio.Event())
                released.clear()
                await released.wait()
        finally:  # also when `close()` cancels the wait: the old channel is closed either way
            self._released.pop(old, None)
            await old.close()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[grpc.aio.Channel]:
        """The current channel, kept open across rotations until this block exits."""
        channel = self._take()
        try:
            yield channel
        finally:
            self._let_go(channel)

    def lend(self) -> grpc.aio.Channel:
        """The current channel as a `LentChannel`, held (as by `hold`) until the
        borrower calls its `close()`, which lets go of it and never closes the
        shared channel: for a consumer that closes the channel it was given after
        each stream (a ResolverWatch channel factory), so a rotation never cuts its
        stream. The borrower bounds how long it keeps a retired channel: it hears
        of the retirement (`on_retired`) and moves to `renew()`."""
        return cast("grpc.aio.Channel", LentChannel(self, self._take()))

    def _on_retired(self, channel: grpc.aio.Channel, callback: Callable[[], None]) -> None:
        if channel is self._channel:
            self._retiring.setdefault(channel, []).append(callback)
        else:  # retired already: say so at once (on the loop, never inside the caller)
            asyncio.get_running_loop().call_soon(callback)

    def _forget_retired(self, channel: grpc.aio.Channel, callback: Callable[[], None]) -> None:
        callbacks = self._retiring.get(channel)
        if callbacks is not None and callback in callbacks:
            callbacks.remove(callback)
            if not callbacks:
                del self._retiring[channel]

    def _take(self) -> grpc.aio.Channel:
        channel = self.channel()
        self._holders[channel] = self._holders.get(channel, 0) + 1
        return channel

    def _let_go(self, channel: grpc.aio.Channel) -> None:
        left = self._holders[channel] - 1
        if left:
            self._holders[channel] = left
        else:
            del self._holders[channel]
            released = self._released.get(channel)
            if released is not None:
                released.set()

    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(
                self.address,
                credentials=self._credentials(),
                server_name=self._server_name,
                options=self._options,
            )
            self.opened += 1
        return self._channel

    async def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._retiring.clear()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


class LentChannel:
    """A RotatingChannel's channel lent to one borrower: everything but `close`
    goes to the channel; `close` (once) lets go of the hold.

    `on_retired(callback)`: `callback()` is called once, on the loop, when the
    owner gives new calls a new channel (a certificate or bundle renewal); the
    borrower then opens its next stream on `renew()` and closes this one."""

    def __init__(self, owner: RotatingChannel, channel: grpc.aio.Channel) -> None:
        self._owner: RotatingChannel | None = owner
        self._channel = channel
        self._retired: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

    def on_retired(self, callback: Callable[[], None]) -> None:
        if self._owner is None:
            raise RuntimeError("the lent channel is closed")
        if self._retired is not None:
            raise RuntimeError("a lent channel tells one borrower")
        self._retired = callback
        self._owner._on_retired(self._channel, callback)

    def renew(self) -> LentChannel:
        """The owner's current channel, lent the same way."""
        if self._owner is None:
            raise RuntimeError("the lent channel is closed")
        return cast(LentChannel, self._owner.lend())

    async def close(self, grace: float | None = None) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            if self._retired is not None:
                owner._forget_retired(self._channel, self._retired)
            owner._let_go(self._channel)


def client_credentials(rotator: CertificateRotator, trust: TrustStore) -> grpc.ChannelCredentials:
    held = rotator.current
    return grpc.ssl_channel_credentials(
        root_certificates=trust.current.pem,
        private_key=held.key_pem(),
        certificate_chain=held.chain_pem(),
    )


# ---------------------------------------------------------------- a process's certificates


class ProcessCertificates:
    """A process's certificate from certs, its trust bundle, and the TLS built on them.

    Built by `waygate.certs.client.start_process_certificates` (which obtains the
    certificate and runs the renewal and the trust-bundle watch); `watcher` is that
    watcher, kept for tests and logs."""

    def __init__(self, rotator: CertificateRotator, trust: TrustStore, watcher: Any = None) -> None:
        self.rotator = rotator
        self.trust = trust
        self.watcher = watcher

    def server_credentials(self, *, client_auth: bool) -> grpc.ServerCredentials:
        return dynamic_server_credentials(self.rotator, self.trust, client_auth=client_auth)

    def ssl_contexts(
        self, *, client_auth: bool = False, alpn_protocols: tuple[str, ...] = ()
    ) -> ServerSSLContexts:
        return ServerSSLContexts(
            self.rotator, self.trust, client_auth=client_auth, alpn_protocols=alpn_protocols
        )

    def client_channel(self, address: str, *, server_name: str | None = None) -> RotatingChannel:
        return RotatingChannel(
            address,
            lambda: client_credentials(self.rotator, self.trust),
            (self.rotator.subscribe, self.trust.subscribe),
            server_name=server_name,
        )


def static_client_channel(
    address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None = None
) -> RotatingChannel:
    """A RotatingChannel that never rotates: fixed credentials (or plaintext)."""
    return RotatingChannel(address, lambda: credentials, server_name=server_name)


__all__ = [
    "LentChannel",
    "ProcessCertificates",
    "RotatingChannel",
    "client_credentials",
    "dynamic_server_credentials",
    "static_client_channel",
]
