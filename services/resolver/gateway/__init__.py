"""Gateway API and Ingress for the resolver: checked specs (`spec`), the one
translation into routes and statuses (`translate`), and the status board
(`status`). The manifests source and the Kubernetes source both feed it."""
