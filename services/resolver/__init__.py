"""resolver: the source of truth for where a name goes (services, endpoints, routes, tunnel presence)."""
