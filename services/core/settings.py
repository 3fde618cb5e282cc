"""Settings: one frozen, keyword-only dataclass per service, validated at start.

Every field is declared with `setting(...)`, which records its help text, its
environment variable and an optional check. `load_settings` builds an instance
from three layers, highest first:

    command-line flags  >  WAYGATE_* environment  >  YAML config file  >  default

Invariants:
- `os.environ` is read here and nowhere else in Waygate (callers may pass a
  mapping instead, which is how tests stay hermetic).
- A bad value stops start-up with one line naming the setting, the layer it
  came from and what is wrong (`SettingsError`); nothing half-configured runs.
- Instances are immutable; a service that needs different settings restarts.
- Every field named `*_port` is checked to be a port number (0 = any free port).
- The config file comes from `--config` or, for services, WAYGATE_CONFIG; a
  settings class may name its own variable in a `CONFIG_ENV` class attribute
  (client commands: WAYGATE_CLIENT_CONFIG, `waygate up`: WAYGATE_UP_CONFIG), so a
  service's file in the environment never breaks a client command beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

ENV_PREFIX = "WAYGATE_"
CONFIG_ENV = "WAYGATE_CONFIG"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "text")

S = TypeVar("S")
Check = Callable[[Any], "str | None"]


class SettingsError(ValueError):
    """A setting is missing, malformed or inconsistent; the message is one line."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    env: str | tuple[str, ...] | None = None,
    check: Check | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """Declare a settings field.

    env:    environment variable name(s); default WAYGATE_<FIELD_NAME>.
    check:  returns an error text for a bad (already typed) value, else None.
    parse:  turns a string (flag, env, YAML string) into the field's type.
    """
    metadata = {"help": help, "env": env, "check": check, "parse": parse, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


#: gRPC core's own log threshold (GRPC_VERBOSITY); a value the user set wins.
GRPC_CORE_VERBOSITY = "ERROR"


def quiet_grpc_core(environ: typing.MutableMapping[str, str] | None = None) -> None:
    """Keep grpc core's own (non-JSON, absl format) log lines below ERROR off stderr.

    grpc reads GRPC_VERBOSITY once, when it is imported: the `waygate` package
    calls this first thing, and the variable stays in the environment, so every
    child process (`waygate up`'s) inherits it. A failed TLS handshake is an
    INFO line there, so a TLS scan no longer writes one line per connection.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("GRPC_VERBOSITY", GRPC_CORE_VERBOSITY)


# ---------------------------------------------------------------- value parsing

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """'1h30m', '250ms', '24h' or a bare number of seconds -> seconds."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 1h30m)")
    return total


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else f"must be a port number 0..65535, not {value}"


def positive(value: float) -> str | None:
    return None if value > 0 else f"must be greater than 0, not {value}"


def fraction(value: float) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"must lie between 0 and 1, not {value}"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must be 0 or more, not {value}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true or false)")


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _coerce(field: dataclasses.Field[Any], tp: Any, raw: Any) -> Any:
    """Turn a raw value from any layer into the field's type, or raise ValueError."""
    base, optional = _strip_optional(tp)
    if raw is None or (optional and raw == ""):
        if optional:
            return None
        raise ValueError("a value is required")
    parse = field.metadata.get("parse")
    if parse is not None:
        if isinstance(raw, str):
            return parse(raw)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError(f"not a valid value: {raw!r}")
        return raw
    if base is bool:
        return raw if isinstance(raw, bool) else _parse_bool(str(raw))
    if base is int:
        if isinstance(raw, bool):
            raise ValueError(f"not an integer: {raw!r}")
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"not an integer: {raw!r}") from None
    if base is float:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"not a number: {raw!r}") from None
    if base is Path:
        return Path(str(raw)).expanduser()
    if typing.get_origin(base) is tuple:
        items = raw.split(",") if isinstance(raw, str) else list(raw)
        return tuple(str(i).strip() for i in items if str(i).strip())
    if base is str:
        if isinstance(raw, (dict, list)):
            raise ValueError(f"not a string: {raw!r}")
        return str(raw)
    raise TypeError(f"settings field type {tp!r} is not supported")


# ---------------------------------------------------------------- loading


def _env_names(field: dataclasses.Field[Any]) -> tuple[str, ...]:
    env = field.metadata.get("env")
    if env is None:
        return (ENV_PREFIX + field.name.upper(),)
    return (env,) if isinstance(env, str) else tuple(env)


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise SettingsError(f"config file {path}{where} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(
    cls: type[S],
    *,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> S:
    """Build and validate `cls` from flags > environment > config file > defaults.

    flags maps field names to values; None means "not given".
    """
    env = os.environ if env is None else env
    flags = flags or {}
    config_env = getattr(cls, "CONFIG_ENV", CONFIG_ENV)  # None: no config file at all
    if config_file is None and config_env and env.get(config_env):
        config_file = Path(env[config_env])
    from_file = _read_config_file(config_file) if config_file else {}
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(from_file) - set(known))
    if unknown:
        raise SettingsError(f"unknown setting {unknown[0]!r} in config file {config_file}")
    unknown_flags = sorted(k for k, v in flags.items() if v is not None and k not in known)
    if unknown_flags:
        raise SettingsError(f"unknown setting {unknown_flags[0]!r}")

    values: dict[str, Any] = {}
    for name, field in known.items():
        layers: list[tuple[str, Any]] = []
        if flags.get(name) is not None:
            layers.append((f"--{name.replace('_', '-')}", flags[name]))
        layers += [(var, env[var]) for var in _env_names(field) if var in env]
        if name in from_file:
            layers.append((f"{config_file}", from_file[name]))
        if not layers:
            if (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ):
                raise SettingsError(
                    f"setting {name} is required (--{name.replace('_', '-')} or {_env_names(field)[0]})"
                )
            continue
        source, raw = layers[0]
        try:
            value = _coerce(field, hints[name], raw)
        except ValueError as exc:
            raise SettingsError(f"invalid setting {name} (from {source}): {exc}") from None
        problem = _check_field(field, value)
        if problem:
            raise SettingsError(f"invalid setting {name} (from {source}): {problem}")
        values[name] = value
    return cls(**values)


def _check_field(field: dataclasses.Field[Any], value: Any) -> str | None:
    # Every `*_port` field is a port number, even when a subclass redeclares it
    # with a new default and forgets the check.
    if field.name.endswith("_port") and isinstance(value, int):
        problem = port_number(value)
        if problem:
            return problem
    choices = field.metadata.get("choices")
    if choices and value is not None and value not in choices:
        return f"must be one of {', '.join(choices)}, not {value!r}"
    check = field.metadata.get("check")
    if check is not None and value is not None:
        return typing.cast("str | None", check(value))
    return None


# ---------------------------------------------------------------- argparse


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """One `--flag` per field (default None = not given), plus --config."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group("settings (flags > WAYGATE_* env > --config file)")
    group.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"YAML config file (env {getattr(cls, 'CONFIG_ENV', CONFIG_ENV)})",
    )
    for field in dataclasses.fields(cls):
        base, _ = _strip_optional(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        env_hint = _env_names(field)[0]
        default = "" if field.default in (dataclasses.MISSING, None) else f" [{field.default}]"
        help_text = f"{field.metadata.get('help', '')} (env {env_hint}){default}"
        if base is bool:
            group.add_argument(
                flag,
                dest=f"setting_{field.name}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=f"setting_{field.name}",
                default=None,
                metavar=field.name.upper(),
                help=help_text,
            )


def settings_from_args(
    cls: type[S], args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> S:
    flags = {
        k.removeprefix("setting_"): v for k, v in vars(args).items() if k.startswith("setting_")
    }
    return load_settings(cls, flags=flags, env=env, config_file=getattr(args, "config", None))


# ---------------------------------------------------------------- shared settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """What every Waygate process has: a listen host, an admin port, logs, traces."""

    #: Not a setting: whether this kind of process asks certs for a client-only
    #: certificate (extended key usage clientAuth only). The tunnel agent does: that
    #: is its role, and the tunnel server registers no other certificate as an agent.
    client_certificate_only: typing.ClassVar[bool] = False

    host: str = setting("127.0.0.1", help="address every listener of this process binds")
    admin_port: int = setting(
        0, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
    )
    log_level: str = setting("info", help="log level", choices=LOG_LEVELS)
    log_format: str = setting(
        "auto",
        help="log line format: json, text (one readable line), or auto (text on a terminal, else json)",
        choices=LOG_FORMATS,
    )
    # The admin port must keep answering kubelet's probes while slow or hostile
    # clients hold connections (see waygate.core.admin for how the room is shared).
    admin_max_connections: int = setting(
        64, help="admin HTTP connections open at once", check=positive
    )
    admin_max_connections_per_source: int = setting(
        8,
        help="admin HTTP connections still sending their request head, per source IP",
        check=positive,
    )
    admin_head_timeout: float = setting(
        2.0,
        help="time a client has to send a whole admin HTTP request head",
        parse=parse_duration,
        check=positive,
    )
    admin_hosts: tuple[str, ...] = setting(
        (),
        help="host names the admin port answers besides IP addresses and localhost, "
        "comma-separated (e.g. the Service name a scraper uses); any other Host header "
        "is refused (DNS rebinding)",
    )
    otlp_endpoint: str | None = setting(
        None,
        help="OTLP/gRPC endpoint for traces (e.g. http://jaeger:4317); unset: no export",
        env=("WAYGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    trace_sample_ratio: float = setting(
        0.0,
        help="share of requests without trace context that the proxy starts a trace for "
        "(0..1); requests that carry one follow their parent's decision",
        check=fraction,
    )
    shutdown_grace: float = setting(
        10.0,
        help="how long in-flight work may finish after SIGTERM",
        parse=parse_duration,
        check=positive,
    )
    insecure: bool = setting(False, help="allow plaintext listeners on a non-loopback host")
    tls_cert_file: Path | None = setting(None, help="PEM serving certificate (chain)")
    tls_key_file: Path | None = setting(None, help="PEM private key of the serving certificate")
    tls_client_ca_file: Path | None = setting(
        None, help="PEM CA bundle; when set, clients must present a certificate"
    )
    # Certificates from the certs service (`waygate up` sets these): the process
    # makes its key itself, sends only a CSR, and renews before expiry.
    certs_address: str | None = setting(
        None, help="host:port of the certs service; when set, TLS certificates come from it"
    )
    certs_token_file: Path | None = setting(
        None, help="file holding the bearer token that authenticates this process to certs"
    )
    certs_ca_file: Path | None = setting(
        None, help="PEM trust bundle to verify certs with (kept fresh from certs afterwards)"
    )
    cert_identity: str | None = setting(
        None, help="identity to ask certs for: spiffe://DOMAIN/ns/NS/sa/SA or a DNS name"
    )
    cert_sans: tuple[str, ...] = setting(
        (), help="more names for the certificate, comma-separated: dns:NAME, uri:URI, ip:ADDRESS"
    )
    # At most 0.75: with the 5% jitter every renewal is due before the last 20%
    # of the life, so the "under 20%" warning always means renewal is failing.
    cert_renew_fraction: float = setting(
        0.7,
        help="renew when this fraction of the certificate's lifetime has passed (plus or minus 5 percent, at random)",
        check=lambda v: None if 0.1 <= v <= 0.75 else f"must be between 0.1 and 0.75, not {v}",
    )

    def __post_init__(self) -> None:
        problem = self.validate()
        if problem:
            raise SettingsError(problem)

    def validate(self) -> str | None:
        """Cross-field checks; subclasses extend and call super()."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            return "invalid setting tls_cert_file/tls_key_file: give both or neither"
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                return f"invalid setting {name}: {path} is not a readable file"
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            return "invalid setting tls_client_ca_file: client certificates need tls_cert_file and tls_key_file"
        problem = self._validate_certs_client()
        if problem:
            return problem
        if not self.tls_enabled and not self.insecure and not is_loopback(self.host):
            return (
                f"invalid setting host: {self.host} is not a loopback address and no TLS is configured; "
                "set tls_cert_file and tls_key_file, or pass --insecure to serve plaintext"
            )
        return None

    def _validate_certs_client(self) -> str | None:
        if self.certs_address is None:
            for name in ("certs_token_file", "certs_ca_file", "cert_identity"):
                if getattr(self, name) is not None:
                    return f"invalid setting {name}: it needs certs_address"
            return None
        if self.tls_cert_file is not None:
            return "invalid setting certs_address: give certs_address or tls_cert_file, not both"
        for name in ("certs_token_file", "certs_ca_file", "cert_identity"):
            if getattr(self, name) is None:
                return f"invalid setting {name}: required with certs_address"
        for name in ("certs_token_file", "certs_ca_file"):
            path = getattr(self, name)
            if not path.is_file():
                return f"invalid setting {name}: {path} is not a readable file"
        # Imported here so settings stays free of cryptography for processes without certs.
        from waygate.core.errors import InvalidArgument
        from waygate.core.rotation import sans_for

        try:
            sans_for(self.cert_identity or "", self.cert_sans)
        except InvalidArgument as exc:
            return f"invalid setting cert_sans: {exc}"
        return None

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None or self.certs_address is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpcServerSettings(ProcessSettings):
    """A process that serves gRPC: its port and the limits on that listener.

    Fair limits (see waygate.core.grpcserver): long-lived streams (every
    streaming method) are capped per peer (the verified client-certificate
    identity, else the peer IP) and in total, and unary calls have a budget of
    their own that streams can never use up. On loopback every plaintext
    client is the one peer 127.0.0.1: the per-IP default leaves room for a
    proxy, a `routes --watch` and tests side by side.
    """

    grpc_port: int = setting(0, help="gRPC listen port", check=port_number)
    max_concurrent_rpcs: int = setting(
        10_000,
        help="outer bound on calls in flight (grpc core), above the stream and unary budgets",
        check=positive,
    )
    max_concurrent_unary: int = setting(
        1000,
        help="unary calls in flight before new ones get RESOURCE_EXHAUSTED; streams never use these",
        check=positive,
    )
    max_concurrent_health: int = setting(
        100,
        help="grpc.health.v1 Check calls in flight (their own budget: health answers while "
        "other unary calls hold theirs)",
        check=positive,
    )
    max_streams: int = setting(
        4000,
        help="long-lived (streaming) calls open at once, all peers together",
        check=positive,
    )
    max_unauthenticated_streams: int = setting(
        1000,
        help="long-lived calls open at once from peers without a client certificate, all "
        "together (below max_streams: peers with a certificate always keep room)",
        check=positive,
    )
    max_streams_per_peer: int = setting(
        512,
        help="long-lived calls open at once per peer with a verified client certificate "
        "(identity), e.g. all replicas of one ServiceAccount",
        check=positive,
    )
    max_streams_per_unauthenticated_peer: int = setting(
        64,
        help="long-lived calls open at once per peer IP without a client certificate",
        check=positive,
    )
    max_concurrent_streams: int = setting(
        100,
        help="HTTP/2 MAX_CONCURRENT_STREAMS: calls at once on one connection (more wait client-side)",
        check=positive,
    )
    max_connection_idle: float = setting(
        120.0,
        help="close a connection with no call in progress for this long (GOAWAY; clients "
        "reconnect); 0: never",
        parse=parse_duration,
        check=non_negative,
    )
    max_connection_age: float = setting(
        1800.0,
        help="close every connection after this long (GOAWAY), spreading clients over replicas; "
        "0: never (for streams that carry data, which the grace would cut)",
        parse=parse_duration,
        check=non_negative,
    )
    max_connection_age_grace: float = setting(
        30.0,
        help="how long calls on a connection past max_connection_age may still run",
        parse=parse_duration,
        check=positive,
    )
    handshake_timeout: float = setting(
        10.0,
        help="time a new connection has for its TLS and HTTP/2 handshake",
        parse=parse_duration,
        check=positive,
    )
    max_message_bytes: int = setting(
        4 * 1024 * 1024, help="largest gRPC message accepted", check=positive
    )
    keepalive_time: float = setting(
        30.0,
        help="interval of server keepalive pings on idle connections",
        parse=parse_duration,
        check=positive,
    )

    def validate(self) -> str | None:
        problem = super().validate()
        if problem:
            return problem
        if self.max_streams_per_unauthenticated_peer > self.max_streams_per_peer:
            return (
                "invalid setting max_streams_per_unauthenticated_peer: "
                f"{self.max_streams_per_unauthenticated_peer} is above max_streams_per_peer "
                f"{self.max_streams_per_peer}; unauthenticated peers get the lower cap"
            )
        if self.max_unauthenticated_streams > self.max_streams:
            return (
                "invalid setting max_unauthenticated_streams: "
                f"{self.max_unauthenticated_streams} is above max_streams {self.max_streams}"
            )
        budgets = self.max_streams + self.max_concurrent_unary + self.max_concurrent_health
        if self.max_concurrent_rpcs < budgets:
            return (
                f"invalid setting max_concurrent_rpcs: {self.max_concurrent_rpcs} is below "
                f"max_streams + max_concurrent_unary + max_concurrent_health ({budgets}); "
                "it is only the outer bound"
            )
        return None
