"""Routing cost at the engine level, without sockets: binds, routes and unbinds per second.

``python -m bench.routing_engine [--bindings 100 10000 100000] [--seconds 2]``
builds, for each N, a topic exchange with N bindings ``dev.<i>.*`` over four
queues and a headers exchange with N bindings ``{x-match: all, dev: i}``,
routes messages whose keys (or ``dev`` header) rarely repeat, then removes
every binding. It only calls ``VirtualHost`` (bind, route, unbind), so the
same file measures another tree's engine too:
``PYTHONPATH=/path/to/other/tree python bench/routing_engine.py``.
The socket-level figures beside RabbitMQ are ``python -m bench --scenario
bindings_10k`` (bench/scenarios/bindings.py).
"""

from __future__ import annotations

import argparse
import gc
import time

from core.engine.vhost import VirtualHost
from core.model import properties
from core.model.message import Message

OWNER = object()
QUEUES = 4


def measure(n: int, kind: str, seconds: float) -> tuple[float, float, float]:
    vh = VirtualHost("/")
    queues = [vh.declare_queue(f"q{i}", OWNER) for i in range(QUEUES)]
    x = vh.declare_exchange("x", kind)

    def binding(i: int) -> tuple[str, dict[str, object] | None]:
        return (f"dev.{i}.*", None) if kind == "topic" else ("", {"x-match": "all", "dev": i})

    start = time.perf_counter()
    for i in range(n):
        vh.bind("x", queues[i % QUEUES], *binding(i))
    bind_rate = n / (time.perf_counter() - start)
    messages = []
    for j in range(20_000):
        device = (j * 7919) % n
        if kind == "topic":
            messages.append(Message("x", f"dev.{device}.k{j}", properties.EMPTY, b""))
        else:
            messages.append(Message("x", "", properties.encode({"headers": {"dev": device, "j": j}}), b""))
    routed = 0
    start = time.perf_counter()
    deadline = start + seconds
    for m in messages:
        assert len(vh.route(x, m)) == 1
        routed += 1
        if routed % 64 == 0 and time.perf_counter() > deadline:
            break
    route_rate = routed / (time.perf_counter() - start)
    start = time.perf_counter()
    for i in range(n):
        vh.unbind("x", queues[i % QUEUES], *binding(i))
    unbind_rate = n / (time.perf_counter() - start)
    return bind_rate, route_rate, unbind_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bindings", type=int, nargs="+", default=[100, 10_000, 100_000])
    p.add_argument("--seconds", type=float, default=2.0, help="routing time per case at most (default 2)")
    args = p.parse_args()
    gc.set_threshold(50_000, 20, 100)  # as the node does (leveret/node)
    print(f"{'exchange':<9} {'bindings':>9} {'bind/s':>10} {'route/s':>10} {'unbind/s':>10}")
    for kind in ("topic", "headers"):
        for n in args.bindings:
            b, r, u = measure(n, kind, args.seconds)
            print(f"{kind:<9} {n:>9,} {b:>10,.0f} {r:>10,.0f} {u:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
