"""Waygate: resolver, certs, proxy and tunnel services, and the `waygate` command."""
