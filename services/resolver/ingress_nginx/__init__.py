"""ingress-nginx compatibility: Ingresses of the nginx class served by Waygate's one route model.

- `catalogue`: every documented `nginx.ingress.kubernetes.io/*` annotation with
  its grammar and what Waygate does with it today (one place: as the proxy gains
  a behaviour, its verdict flips there).
- `annotations`: one Ingress's annotations -> validated route fields and a
  verdict per annotation; an Ingress with a not-honoured access-bearing
  annotation, a value outside its grammar or a path outside its pathType is
  refused alone (fail closed).
- `config`: the controller's flags and ConfigMap.
- `report`: `waygate ingress-nginx check`, the offline migration report.
"""
