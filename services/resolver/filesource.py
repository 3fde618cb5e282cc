"""The YAML routes file: services, their endpoints and routes, reloaded on change.

The file (the embedded default of `waygate up`) looks like this; every key is
optional unless marked, unknown keys are errors (a typo must not silently
become a default):

    services:
      - namespace: demo            # default "default"
        name: hello                # required
        type: ClusterIP            # ClusterIP | NodePort | LoadBalancer | ExternalName
        clusterIPs: [10.96.0.10]
        headless: false
        externalName: ""           # ExternalName services only
        ports:
          - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 0,
             appProtocol: ""}   # kubernetes.io/h2c, h2c, h2, grpc: the proxy speaks HTTP/2
        endpoints:
          - address: 127.0.0.1     # required
            ports: [{name: http, port: 8080}]   # default: the service ports' numeric targets
            ready: true            # also: serving, terminating, zone, nodeName, tunnel, hostname
    routes:                        # the Route format: waygate.resolver.schema
      - namespace: demo
        name: hello                # required
        host: hello.localtest.me   # required
        to: hello

Routes are read and written through `waygate.resolver.schema`, the one
declaration of the route format (keys, types, allowed values, bounds), which
the Route CRD shares; the README lists every key. A file with more routes
than `max_routes` (--max-routes-per-source) is refused at the first route
past it.

Invariants:
- The store holds exactly the last file content that parsed and validated as a
  whole (`replace_source`, one version): an edit with any error is rejected
  entirely, with `path:line: reason` logged and kept in `last_error`, and the
  last good state stays.
- Changes are noticed by polling size + mtime and confirmed by content hash,
  so an editor's save-by-rename and a touch without change both behave.
- `apply_route` / `delete_route` write the whole file back atomically
  (temporary file + fsync + rename) and apply exactly what they wrote, so the
  store and the file never disagree and the change survives a restart.
  They refuse (FailedPrecondition, saying why) while the file is missing or
  holds an error, or before it was ever loaded: a write never starts from
  a view the resolver did not load (a missing file read as empty would drop
  every service and route).
  Writing back changes only the entry of the route applied or deleted
  (`waygate.resolver.routesedit`): the file's comments, order, quoting and
  indentation stay.
- The file holds route TLS private keys: whenever it is written, it is
  written mode 0600, whatever its mode was.
- File I/O and parsing never run on the event loop while it serves (worker
  thread); writers and reloads are serialised by one asyncio.Lock.
- The file's own state (valid or its last error, the version and time of the
  last good load) is recorded in the store after every load and rejection,
  so ListRoutes and Watch tell clients what the resolver is serving from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml
from ruamel.yaml.error import YAMLError as RuamelError

from waygate.core.errors import FailedPrecondition, InvalidArgument, NotFound, excerpt
from waygate.core.files import write_file_atomically
from waygate.resolver import routesedit, schema
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    Route,
    Service,
    ServicePort,
    SourceState,
)
from waygate.resolver.schema import DEFAULT_MAX_ROUTES_PER_SOURCE, route_to_document
from waygate.resolver.store import Store
from waygate.resolver.validation import (
    shown,
    validate_endpoint,
    validate_route,
    validate_service,
)
from waygate.resolver.yamlload import MAX_YAML_BYTES, FileError, YAMLDocuments

__all__ = ["FileContent", "FileError", "FileSource", "parse_routes_file", "route_to_document"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# A routes file is hand-written or generated config, not a data store; past
# this it is refused rather than parsed into memory (the YAML sources' one bound).
MAX_FILE_BYTES = MAX_YAML_BYTES

# The example file shipped inside the package (so it exists in an installed
# wheel too); `waygate up` starts from a copy of it.
EXAMPLE_ROUTES = Path(__file__).parent / "examples" / "routes.yaml"


@dataclasses.dataclass(frozen=True)
class FileContent:
    services: tuple[Service, ...]
    endpoints: tuple[Endpoint, ...]
    routes: tuple[Route, ...]


# ---------------------------------------------------------------- parsing


class _Parser:
    """Walks the composed YAML nodes so every error can name its line."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.loader = YAMLDocuments(path, text)

    def error(self, node: yaml.Node | None, reason: str) -> FileError:
        return FileError(self.path, node.start_mark.line + 1 if node is not None else None, reason)

    def root(self) -> yaml.Node | None:
        with self.loader:
            return self.loader.single()

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{what} must be a mapping")
        fields: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            if not isinstance(key, str):
                raise self.error(key_node, f"{what}: keys must be strings")
            if key not in allowed:
                raise self.error(
                    key_node, f"{what}: unknown key {excerpt(key)} (allowed: {', '.join(allowed)})"
                )
            if key in fields:
                raise self.error(key_node, f"{what}: key {excerpt(key)} appears twice")
            fields[key] = value_node
        return fields

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if isinstance(node, yaml.ScalarNode) and self.scalar(node) is None:
            return []
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, f"{what} must be a list")
        return list(node.value)

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error(node, "expected a single value, not a list or mapping")
        try:
            return self.loader.construct(node)
        except FileError as exc:
            raise self.error(node, f"bad value: {exc.reason}") from None

    def typed(
        self, fields: dict[str, yaml.Node], key: str, kind: type[T], default: T, what: str
    ) -> T:
        node = fields.get(key)
        if node is None:
            return default
        value = self.scalar(node)
        if value is None:
            return default
        # bool is an int in Python; a port of `true` is a mistake, not 1.
        if kind is int and isinstance(value, bool):
            raise self.error(
                node, f"{what}.{key} must be a whole number, not {excerpt(repr(value))}"
            )
        if kind is str and isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, kind):
            raise self.error(
                node, f"{what}.{key} must be a {kind.__name__}, not {excerpt(repr(value))}"
            )
        return value


_SERVICE_KEYS = (
    "namespace",
    "name",
    "type",
    "clusterIPs",
    "headless",
    "externalName",
    "ports",
    "endpoints",
)
_SERVICE_PORT_KEYS = ("name", "port", "targetPort", "protocol", "nodePort", "appProtocol")
_ENDPOINT_KEYS = (
    "address",
    "ports",
    "ready",
    "serving",
    "terminating",
    "zone",
    "nodeName",
    "tunnel",
    "hostname",
)
_ENDPOINT_PORT_KEYS = ("name", "port", "protocol")


def parse_routes_file(
    path: Path, text: str, *, max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE
) -> FileContent:
    """Parse and validate the whole file; FileError (with its line) on the first problem.

    More than `max_routes` routes is refused at the first one past the budget,
    before it is read.
    """
    parser = _Parser(path, text)
    root = parser.root()
    if root is None:
        return FileContent((), (), ())
    top = parser.mapping(root, "the file", ("services", "routes"))
    services: list[Service] = []
    endpoints: list[Endpoint] = []
    routes: list[Route] = []
    seen_services: dict[tuple[str, str], int] = {}
    for node in parser.sequence(top["services"], "services") if "services" in top else []:
        service, service_endpoints = _parse_service(parser, node)
        line = node.start_mark.line + 1
        if service.key in seen_services:
            raise parser.error(
                node,
                f"service {service.namespace}/{service.name} is already defined on line "
                f"{seen_services[service.key]}",
            )
        seen_services[service.key] = line
        services.append(service)
        endpoints.extend(service_endpoints)
    seen_routes: dict[tuple[str, str], int] = {}
    tree = schema.YamlTree()
    route_nodes = parser.sequence(top["routes"], "routes") if "routes" in top else []
    if len(route_nodes) > max_routes:
        raise parser.error(
            route_nodes[max_routes],
            f"{len(route_nodes)} routes; a source may produce at most {max_routes} "
            "(--max-routes-per-source)",
        )
    for node in route_nodes:
        route = read_route_entry(parser, tree, node)
        if route.key in seen_routes:
            raise parser.error(
                node,
                f"route {route.namespace}/{route.name} is already defined on line "
                f"{seen_routes[route.key]}",
            )
        seen_routes[route.key] = node.start_mark.line + 1
        routes.append(route)
    return FileContent(tuple(services), tuple(endpoints), tuple(routes))


def read_route_entry(parser: _Parser, tree: schema.YamlTree, node: yaml.Node) -> Route:
    """One route entry through the Route schema; FileError naming its line."""
    try:
        return schema.read_route(tree, node)
    except schema.SchemaError as exc:
        raise parser.error(exc.node, str(exc)) from None
    except InvalidArgument as exc:
        field = getattr(exc, "field", None)
        raise parser.error(_locate(node, field) if field else node, str(exc)) from None


# A service's field whose YAML key is not its camelCase (the Route schema knows its own).
_SERVICE_KEYS_BY_ATTR = {"cluster_ips": "clusterIPs"}


def _locate(node: yaml.Node, field: str) -> yaml.Node:
    """The node of a validation error's field ("backends[1].weight"), or the
    deepest node on the way there, so an error can name the closest line."""
    return schema.node_at(node, schema.key_path(field, _SERVICE_KEYS_BY_ATTR))


def _validated(parser: _Parser, node: yaml.Node, check: Callable[[T], T], value: T) -> T:
    try:
        return check(value)
    except InvalidArgument as exc:
        field = getattr(exc, "field", None)
        raise parser.error(_locate(node, field) if field else node, str(exc)) from None


def _parse_service(parser: _Parser, node: yaml.Node) -> tuple[Service, list[Endpoint]]:
    fields = parser.mapping(node, "service", _SERVICE_KEYS)
    namespace = parser.typed(fields, "namespace", str, "default", "service")
    name = parser.typed(fields, "name", str, "", "service")
    what = f"service {shown(namespace)}/{shown(name)}"
    ports = []
    for port_node in (
        parser.sequence(fields["ports"], f"{what}: ports") if "ports" in fields else []
    ):
        port_fields = parser.mapping(port_node, f"{what}: port", _SERVICE_PORT_KEYS)
        number = parser.typed(port_fields, "port", int, 0, f"{what}: port")
        ports.append(
            ServicePort(
                name=parser.typed(port_fields, "name", str, "", f"{what}: port"),
                port=number,
                target_port=parser.typed(
                    port_fields, "targetPort", str, str(number) if number else "", f"{what}: port"
                ),
                protocol=parser.typed(port_fields, "protocol", str, "TCP", f"{what}: port"),
                node_port=parser.typed(port_fields, "nodePort", int, 0, f"{what}: port"),
                app_protocol=parser.typed(port_fields, "appProtocol", str, "", f"{what}: port"),
            )
        )
    cluster_ips: list[str] = []
    if "clusterIPs" in fields:
        for ip_node in parser.sequence(fields["clusterIPs"], f"{what}: clusterIPs"):
            ip = parser.scalar(ip_node)
            if not isinstance(ip, str):
                raise parser.error(ip_node, f"{what}: clusterIPs entries must be strings")
            cluster_ips.append(ip)
    service = Service(
        namespace=namespace,
        name=name,
        type=parser.typed(fields, "type", str, "ClusterIP", "service"),
        cluster_ips=tuple(cluster_ips),
        headless=parser.typed(fields, "headless", bool, False, "service"),
        external_name=parser.typed(fields, "externalName", str, "", "service"),
        ports=tuple(ports),
    )
    service = _validated(parser, node, validate_service, service)
    # Endpoints without ports get the service ports' numeric targets, which is
    # what a static file almost always means.
    default_ports = tuple(
        EndpointPort(p.name, int(p.target_port), p.protocol)
        for p in service.ports
        if p.target_port.isascii() and p.target_port.isdigit()
    )
    endpoints: list[Endpoint] = []
    seen: dict[str, int] = {}
    endpoint_nodes = (
        parser.sequence(fields["endpoints"], f"{what}: endpoints") if "endpoints" in fields else []
    )
    for endpoint_node in endpoint_nodes:
        endpoint = _parse_endpoint(parser, endpoint_node, service, default_ports)
        if endpoint.address in seen:
            raise parser.error(
                endpoint_node,
                f"{what}: endpoint {endpoint.address} is already listed on line "
                f"{seen[endpoint.address]}",
            )
        seen[endpoint.address] = endpoint_node.start_mark.line + 1
        endpoints.append(endpoint)
    return service, endpoints


def _parse_endpoint(
    parser: _Parser, node: yaml.Node, service: Service, default_ports: tuple[EndpointPort, ...]
) -> Endpoint:
    what = f"endpoint of {shown(service.namespace)}/{shown(service.name)}"
    fields = parser.mapping(node, what, _ENDPOINT_KEYS)
    ports = default_ports
    if "ports" in fields:
        parsed = []
        for port_node in parser.sequence(fields["ports"], f"{what}: ports"):
            port_fields = parser.mapping(port_node, f"{what}: port", _ENDPOINT_PORT_KEYS)
            parsed.append(
                EndpointPort(
                    name=parser.typed(port_fields, "name", str, "", f"{what}: port"),
                    port=parser.typed(port_fields, "port", int, 0, f"{what}: port"),
                    protocol=parser.typed(port_fields, "protocol", str, "TCP", f"{what}: port"),
                )
            )
        ports = tuple(parsed)
    terminating = parser.typed(fields, "terminating", bool, False, what)
    endpoint = Endpoint(
        namespace=service.namespace,
        service=service.name,
        address=parser.typed(fields, "address", str, "", what),
        ports=ports,
        ready=parser.typed(fields, "ready", bool, True, what),
        serving=parser.typed(fields, "serving", bool, True, what),
        terminating=terminating,
        zone=parser.typed(fields, "zone", str, "", what),
        node_name=parser.typed(fields, "nodeName", str, "", what),
        tunnel=parser.typed(fields, "tunnel", bool, False, what),
        hostname=parser.typed(fields, "hostname", str, "", what),
    )
    return _validated(parser, node, validate_endpoint, endpoint)


# The file holds route TLS private keys: only the owner may read it.
FILE_MODE = 0o600


# ---------------------------------------------------------------- the source


@dataclasses.dataclass(frozen=True)
class _Read:
    """What one read of the file found (built off the event loop)."""

    stat: tuple[int, int] | None
    digest: bytes | None
    # None with error None: the content is the one already applied (same digest).
    content: FileContent | None
    error: FileError | None


class FileSource:
    """Feeds the store from one YAML file and writes route changes back to it.

    Reading, parsing, dumping and writing the file run in a worker thread
    (`asyncio.to_thread`): a large file must not stall the event loop and with
    it every other RPC. Only applying the parsed result to the store runs on
    the loop, as every store mutation must. One asyncio.Lock serialises the
    writers and the reloads, so a reload never applies a file older than a
    write that already returned.
    """

    def __init__(
        self,
        store: Store,
        path: Path,
        *,
        poll_interval: float = 1.0,
        max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE,
    ) -> None:
        self.store = store
        # More routes than this and the file is refused (--max-routes-per-source).
        self.max_routes = max_routes
        self.path = path.absolute()
        self.source = f"file:{self.path}"
        self.poll_interval = poll_interval
        # The last load's error as `path:line: reason`; None after a good load.
        self.last_error: str | None = None
        self.loaded = False
        # The store version and the time of the last good load.
        self.loaded_version = 0
        self.loaded_at: datetime | None = None
        # When the current run of rejections began (None while valid).
        self.error_since: datetime | None = None
        self._stat: tuple[int, int] | None = None
        self._digest: bytes | None = None
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------ loading

    def _stat_key(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _read(self, known_digest: bytes | None) -> _Read:
        """Read and parse the file; thread-safe (touches no shared state).

        An unchanged digest skips the parse: a touch without change costs a hash.
        """
        stat = self._stat_key()
        try:
            with self.path.open("rb") as handle:
                # One byte over the limit is enough to know it is too big.
                data = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            # Worded as the writers word it, whichever of them notices first.
            return _Read(stat, None, None, FileError(self.path, None, "is missing"))
        except OSError as exc:
            error = FileError(self.path, None, f"cannot read: {exc.strerror or exc}")
            return _Read(stat, None, None, error)
        if len(data) > MAX_FILE_BYTES:
            error = FileError(self.path, None, f"larger than {MAX_FILE_BYTES // (1 << 20)} MiB")
            return _Read(stat, None, None, error)
        digest = hashlib.sha256(data).digest()
        if digest == known_digest:
            return _Read(stat, digest, None, None)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            error = FileError(self.path, None, f"not UTF-8 text ({exc.reason})")
            return _Read(stat, digest, None, error)
        try:
            return _Read(
                stat, digest, parse_routes_file(self.path, text, max_routes=self.max_routes), None
            )
        except FileError as exc:
            return _Read(stat, digest, None, exc)

    def _apply(self, read: _Read) -> bool:
        """Make the store reflect `read` (on the event loop); True when it does."""
        self._stat = read.stat
        if read.error is None and read.content is None:
            # The content this source already applied (or already rejected).
            if self.last_error is None:
                self.store.mark_synced(self.source)
            return self.last_error is None
        if read.digest is not None or read.error is not None:
            # An unreadable (missing, oversized) file has no digest: forget the old
            # one, or restoring the very same bytes would count as "already applied"
            # and the error would never clear.
            self._digest = read.digest
        if read.error is not None:
            return self._reject(read.error)
        content = read.content
        assert content is not None, "a read without error or known digest has content"
        before = self.store.version
        self.store.replace_source(
            self.source,
            services=content.services,
            endpoints=content.endpoints,
            routes=content.routes,
        )
        self.store.mark_synced(self.source)
        if self.last_error is not None:
            log.info("routes file is valid again", extra={"path": str(self.path)})
        self.last_error = None
        self.error_since = None
        self.loaded = True
        self.loaded_version = self.store.version
        self.loaded_at = datetime.now(UTC)
        self._publish_state()
        log.info(
            "routes file loaded",
            extra={
                "path": str(self.path),
                "services": len(content.services),
                "endpoints": len(content.endpoints),
                "routes": len(content.routes),
                "version": self.store.version,
                "changed": self.store.version != before,
            },
        )
        return True

    def load(self) -> bool:
        """Read, parse and validate the file; apply it to the store if it is good.

        Synchronous: for start-up and tests, before the loop serves anyone
        (a serving process uses `reload`). Returns True when the store now
        reflects the file. On any error the store keeps the last good state,
        and the error is logged and kept.
        """
        return self._apply(self._read(self._digest))

    async def reload(self) -> bool:
        """`load`, with the reading and parsing in a worker thread."""
        async with self._lock:
            return self._apply(await asyncio.to_thread(self._read, self._digest))

    def _reject(self, error: FileError) -> bool:
        message = str(error)
        if message != self.last_error:
            log.error(
                "routes file rejected; keeping the last good state: %s",
                message,
                extra={"path": str(self.path), "line": error.line, "reason": error.reason},
            )
        if self.last_error is None:
            self.error_since = datetime.now(UTC)
        self.last_error = message
        self._publish_state()
        return False

    def state(self) -> SourceState:
        """What the resolver serves from this file, for clients to see."""
        return SourceState(
            source=self.source,
            valid=self.last_error is None and self.loaded,
            error=self.last_error or "",
            loaded_version=self.loaded_version,
            loaded_at=self.loaded_at,
            error_since=self.error_since,
        )

    def _publish_state(self) -> None:
        self.store.set_source_state(self.state())

    def _confirm(self) -> None:
        if self.last_error is None and self.loaded:
            self.store.mark_synced(self.source)

    def poll(self) -> None:
        """Reload when the file's size or mtime changed; else confirm freshness."""
        if self._stat_key() != self._stat:
            self.load()
        else:
            self._confirm()

    async def poll_async(self) -> None:
        """`poll` for a serving process: a changed file is reloaded in a worker thread."""
        if self._stat_key() != self._stat:
            await self.reload()
        else:
            self._confirm()

    async def run(self) -> None:
        """Poll for the life of the process."""
        while True:
            await asyncio.sleep(self.poll_interval)
            await self.poll_async()

    # ------------------------------------------------------------ writing routes

    def _check_loaded(self) -> None:
        """FailedPrecondition unless the store holds what the file holds (called locked)."""
        if not self.loaded:
            raise FailedPrecondition(
                f"the routes file {self.path} has not loaded yet; routes cannot change "
                f"until it does ({self.last_error or 'not read yet'})"
            )
        if self.last_error is not None:
            raise FailedPrecondition(
                "the routes file has an error; fix it before changing routes "
                "(the resolver keeps serving its last good state): " + self.last_error
            )

    def _check_writable(self, namespace: str, name: str) -> None:
        owner = self.store.route_owner(namespace, name)
        if owner is not None and owner != self.source:
            raise FailedPrecondition(
                f"route {namespace}/{name} comes from {owner}, which is read-only here"
            )

    async def apply_route(self, route: Route) -> Route:
        """Validate, write into the file, load: the stored route, normalised.

        Status and creation time are the resolver's and ignored; a field the
        routes file cannot hold (a Gateway API route's matches, ...) is refused,
        never dropped. A certificate given without its key (as `routes get`
        shows it: keys are redacted) keeps the key the file holds for that same
        certificate, so `routes get -o yaml | routes apply -f -` round-trips.
        """
        schema.refuse_derived(route)
        route = dataclasses.replace(route, status=None, created=None)

        async with self._lock:
            self._check_loaded()
            self._check_writable(route.namespace, route.name)
            route = validate_route(self._with_stored_key(route))
            entry = route_to_document(route)

            def edit(text: str) -> str:
                return routesedit.apply(text, route.key, entry)

            await self._rewrite(edit)
        stored = self.store.get_route(route.namespace, route.name)
        if stored is None:
            # Another source took the key between the write and now; never a crash.
            raise FailedPrecondition(f"route {route.namespace}/{route.name} was removed meanwhile")
        return stored

    def _with_stored_key(self, route: Route) -> Route:
        tls = route.tls
        if tls is None or not tls.certificate or tls.key:
            return route
        stored = self.store.get_route(route.namespace, route.name)
        if (
            stored is not None
            and stored.tls is not None
            and stored.tls.certificate == tls.certificate
            and self.store.route_owner(route.namespace, route.name) == self.source
        ):
            return dataclasses.replace(route, tls=dataclasses.replace(tls, key=stored.tls.key))
        return route

    async def delete_route(self, namespace: str, name: str) -> None:
        def edit(text: str) -> str:
            return routesedit.delete(text, (namespace, name))

        async with self._lock:
            self._check_loaded()
            self._check_writable(namespace, name)
            if self.store.get_route(namespace, name) is None:
                raise NotFound(f"route {namespace}/{name} not found")
            await self._rewrite(edit)

    async def _rewrite(self, edit: Callable[[str], str]) -> None:
        """Edit the file's routes in a worker thread, then apply what was written.

        Called with the lock held. The written text is parsed exactly once, and
        that parse is what the store gets: no second read of the file.
        """
        read = await asyncio.to_thread(self._edit_file, edit, self._digest)
        self._apply(read)

    def _edit_file(
        self,
        edit: Callable[[str], str],
        loaded_digest: bytes | None,
    ) -> _Read:
        """Read, edit, validate and write the file (thread-safe; no shared state).

        Only the bytes last loaded are edited (`loaded_digest`): a file changed
        since (emptied, half-written by an editor) would otherwise be taken as
        the view, and the write would replace what the store serves.
        """
        try:
            with self.path.open("rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"the routes file {self.path} is missing; restore it before changing routes "
                "(the resolver keeps serving its last good state)"
            ) from None
        except OSError as exc:
            raise FailedPrecondition(f"cannot read the routes file {self.path}: {exc}") from None
        if len(data) > MAX_FILE_BYTES or hashlib.sha256(data).digest() != loaded_digest:
            if len(data) <= MAX_FILE_BYTES:
                # Say what is wrong with the new content when something is.
                self._refuse_broken(data.decode("utf-8", errors="replace"))
            raise FailedPrecondition(
                f"the routes file {self.path} changed since it was loaded; retry "
                "(once the resolver has loaded the new content)"
            )
        text = data.decode("utf-8")  # the loaded bytes, which were UTF-8
        # Only the route's entry changes: the file's comments, order, quoting
        # and indentation stay (waygate.resolver.routesedit).
        try:
            data = edit(text).encode()
        except (RuamelError, ValueError):
            self._refuse_broken(text)
            raise FailedPrecondition(
                f"the routes file {self.path} cannot be edited as YAML; fix it by hand"
            ) from None
        if len(data) > MAX_FILE_BYTES:
            raise FailedPrecondition(
                f"the routes file would grow over {MAX_FILE_BYTES // (1 << 20)} MiB; not written"
            )
        # Parse what is about to be written: the file must stay loadable.
        try:
            content = parse_routes_file(self.path, data.decode(), max_routes=self.max_routes)
        except FileError as exc:
            # The existing file's own error, or the new route's?
            self._refuse_broken(text)
            raise InvalidArgument(str(exc)) from None
        try:
            write_file_atomically(self.path, data, FILE_MODE)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot write the routes file {self.path}: {exc.strerror or exc}"
            ) from None
        return _Read(self._stat_key(), hashlib.sha256(data).digest(), content, None)

    def _refuse_broken(self, text: str) -> None:
        """FailedPrecondition when the file as it stands does not load."""
        try:
            parse_routes_file(self.path, text, max_routes=self.max_routes)
        except FileError as exc:
            raise FailedPrecondition(
                f"the routes file has an error; fix it before changing routes: {exc}"
            ) from None
