"""certs: the certificate authority that issues, rotates and publishes trust."""
