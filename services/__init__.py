"""Waygate: resolver, certs, proxy and tunnel services, and the `waygate` command."""

# gRPC core reads its log threshold when grpc is imported: set it before any
# module of this package can import grpc (see waygate.core.settings.quiet_grpc_core).
from waygate.core.settings import quiet_grpc_core

quiet_grpc_core()
