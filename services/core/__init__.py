"""Pieces every Waygate service shares: settings, logging, tracing, the gRPC
server and client bootstrap, the admin HTTP server and domain errors.

Nothing here knows about a particular service; each service composes these.
"""
