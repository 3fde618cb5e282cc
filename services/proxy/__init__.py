"""proxy: the HTTP/1.1 + TLS reverse proxy fed by the resolver and certs."""
