"""Routers: which replica of a fleet takes a request, decided at its arrival from live replica state.

Every router reads the same state (``Replicas``): each replica's outstanding requests (routed, not yet
finished) and its KV use (allocated slots / capacity, now). Ties go to the lowest replica index, so a
run is deterministic; the random routers draw from their own seeded stream.

``prefix-affinity`` keeps the router's own record of the prompt blocks (hash ids) it has sent to each
replica, as a cache-aware router does (no eviction: it does not see a replica's cache evict), and sends
a request to the replica holding its longest prefix unless that replica would then hold more than
ceil(``load_cap`` x the mean outstanding requests, this one included): then to the least loaded.
``session-affinity`` sends a session's requests to the replica that took its first one (chosen as
least-outstanding).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np

from sim.config import ScenarioError
from sim.engine import least_loaded


class Replicas:
    """Live state of the fleet's replicas, as routers read it."""

    def __init__(self, engines: list) -> None:
        self.engines = engines
        self.n = len(engines)
        self._loads = [0] * self.n  # each replica's outstanding requests, kept by the replica (Engine.share_load)
        for k, e in enumerate(engines):
            e.share_load(self._loads, k)

    def outstanding(self, r: int) -> int:
        return self._loads[r]

    def loads(self) -> list[int]:
        """Every replica's outstanding requests (read-only: the replicas keep this list)."""
        return self._loads

    def kv_use(self, r: int) -> float:
        """KV slots in use / capacity, now, as exact stepping would hold them (``Engine.kv_slots_in_use``)."""
        e = self.engines[r]
        return e.kv_slots_in_use() / e.kv.capacity if e.kv.capacity else 1.0

    def exact_kv(self) -> None:
        """Make ``kv_use`` exact on every replica: one whose pages leave a window while decoding steps
        one step at a time (inside a span its KV would need the window frees of the steps begun)."""
        for e in self.engines:
            if e.kv.slides:
                e.exact = True

    def least_outstanding(self, cands, loads: list[int] | None = None) -> int:
        """The candidate with the fewest outstanding requests, the lowest index among ties."""
        loads = self._loads if loads is None else loads
        if len(cands) == self.n:  # every replica (ids 0..n-1 in order)
            return least_loaded(loads)
        return min(cands, key=loads.__getitem__)


class Router:
    name = ""
    live = True  # reads replica state: routes at each arrival on the fleet's clock (else all at once, ahead)
    reads_kv = False  # reads the replicas' KV in use (``Replicas.kv_use``)

    def __init__(self, replicas: Replicas, requests, options, stream: str = "") -> None:
        self.replicas = replicas
        self.requests = requests
        self.options = options  # which router reads which option: sim.config.ROUTER_OPTION_USERS (keep it true)
        # the random routers' seed: a second router of the same run (a disaggregated fleet's decode pool)
        # names its own stream, so that its draws do not repeat the first one's
        self.seed = options.seed if not stream else f"{options.seed}:{stream}"

    def route(self, i: int, cands: tuple[int, ...]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"
    live = False

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.k = 0

    def route(self, i, cands):
        r = cands[self.k % len(cands)]
        self.k += 1
        return r


class Random(Router):
    name = "random"
    live = False

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.rng = random.Random(self.seed)

    def route(self, i, cands):
        return cands[self.rng.randrange(len(cands))]


class LeastOutstanding(Router):
    name = "least-outstanding"

    def route(self, i, cands):
        return self.replicas.least_outstanding(cands)


class LeastKv(Router):
    name = "least-kv"
    reads_kv = True  # KV in use as exact stepping holds it, inside decode spans too; outstanding counts
    # change only at pushes and finishes, which spans keep exact

    def route(self, i, cands):
        s = self.replicas
        loads = s.loads()
        return min(cands, key=lambda r: (s.kv_use(r), loads[r]))


class PowerOfTwo(Router):
    name = "power-of-two"

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.rng = random.Random(self.seed)

    def route(self, i, cands):
        if len(cands) == 1:
            return cands[0]
        a, b = self.rng.sample(cands, 2)
        la, lb = self.replicas.outstanding(a), self.replicas.outstanding(b)
        return a if la < lb or la == lb and a < b else b  # a tie to the lower index, as everywhere


class PrefixAffinity(Router):
    name = "prefix-affinity"

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.hashes = self.requests.prefix_hashes
        self.owners: dict[int, int] = {}  # block hash id -> bit mask of the replicas it was sent to
        self.num_capped = 0  # requests whose affinity choice was over the load cap
        self.num_affine = 0  # requests sent to a replica holding part of their prefix
        # the cap as the exact decimal it was written as (1.1 x 50 / 5 is 11.000000000000002 in floats)
        self.cap = Fraction(repr(float(self.options.load_cap)))

    def route(self, i, cands):
        s, owners = self.replicas, self.owners
        ids = self.hashes.of(i).tolist()
        mask = 0
        for r in cands:
            mask |= 1 << r
        best = 0
        for h in ids:
            m = owners.get(h, 0) & mask
            if not m:
                break
            mask = best = m
        r = None
        loads = s.loads()
        if best:
            held = [c for c in cands if best >> c & 1]
            r = s.least_outstanding(held, loads)
            total = sum(loads[c] for c in cands) + 1  # with this request
            # bounded loads (consistent hashing with bounded loads): at most ceil(cap x the mean) each, so a
            # lightly loaded fleet (a mean under one) still follows the prefix
            if loads[r] + 1 > math.ceil(self.cap * total / len(cands)):
                self.num_capped += 1
                r = None
            else:
                self.num_affine += 1
        if r is None:
            r = s.least_outstanding(cands, loads)
        bit = 1 << r
        for h in ids:
            owners[h] = owners.get(h, 0) | bit
        return r


class SessionAffinity(Router):
    name = "session-affinity"

    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.sessions = np.asarray(self.requests.session_id)
        self.home: dict = {}

    def route(self, i, cands):
        key = self.sessions[i].item() if hasattr(self.sessions[i], "item") else self.sessions[i]
        r = self.home.get(key)
        if r is None or r not in cands:
            r = self.replicas.least_outstanding(cands)
            self.home[key] = r
        return r


ROUTER_CLASSES = {c.name: c for c in (RoundRobin, Random, LeastOutstanding, LeastKv, PowerOfTwo, PrefixAffinity,
                                      SessionAffinity)}


# What a router needs of the workload's requests: the attribute that must be set, and why
NEEDS = {"prefix-affinity": ("prefix_hashes", "prefix-affinity needs prompt prefix hashes: a trace with hash ids "
                                              "(Mooncake) or a synthetic workload with shared_prefixes"),
         "session-affinity": ("session_id", "session-affinity needs the trace's session ids (a session_id column); "
                                            "this workload has none")}


def check_routers(names: list[str], requests) -> None:
    """Raise :class:`ScenarioError` when a router of ``names`` needs what the workload's requests lack (checked
    before any run, so that ``sim check`` says so and a list of routers fails before the first one runs)."""
    for name in names:
        if name in NEEDS and getattr(requests, NEEDS[name][0]) is None:
            raise ScenarioError(f"cluster.router: {NEEDS[name][1]}")


def make_router(name: str, replicas: Replicas, requests, options, stream: str = "") -> Router:
    """``stream``: a name for a second router of the same run (its own random stream)."""
    check_routers([name], requests)
    router = ROUTER_CLASSES[name](replicas, requests, options, stream)
    if router.reads_kv:
        replicas.exact_kv()
    return router
