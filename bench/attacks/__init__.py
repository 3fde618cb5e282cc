"""Attack runs against a real proxy, timed by a bystander (issue 31's audit, kept).

`python -m bench.attacks` starts a stack (`stack.proxy_stack`: this package's
backend, a resolver and `waygate proxy serve`, each its own process), then for
each attack runs it in its own process (`python -m bench.attacks attack`)
while a well-behaved HTTP/2 client (`tests.support.h2attack.Bystander`) times
its requests, and reports the bystander's success rate, p50 and p99 with the
proxy's CPU seconds and resident memory against the attacker's CPU seconds.
`tests/system/test_proxy_h2_hostile.py` runs the same attacks for a few seconds.
"""
