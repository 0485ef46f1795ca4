"""The router's pure parts: the routing key, the ring and the bounded-load choice."""

from __future__ import annotations

import random
import subprocess
import sys

from kvscale.router.balance import (
    LEAST_LOADED,
    LOAD_BOUND,
    NO_PREFIX,
    PREFIX_HIT,
    HashRing,
    Load,
    choose,
    load_bound,
    prefix_key,
)
from kvscale.server.engine.block_hash import block_hashes

REPLICAS = [f"http://10.0.0.{i}:8000" for i in range(1, 6)]


def _keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [prefix_key([rng.randrange(5000) for _ in range(32)], 16, 2) for _ in range(n)]  # type: ignore[misc]


def test_prefix_key_is_the_engines_block_hash() -> None:
    ids = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    assert prefix_key(ids, 16, 2) == block_hashes(ids, 16)[1]
    assert prefix_key(ids, 16, 8) == block_hashes(ids, 16)[2]  # fewer blocks than asked
    assert prefix_key(ids[:15], 16, 4) is None  # shorter than one block
    # the same leading blocks: the same key, whatever follows
    assert prefix_key(ids[:32] + [1, 2, 3] * 9, 16, 2) == prefix_key(ids, 16, 2)
    assert prefix_key(ids, 16, 2, salt="a") != prefix_key(ids, 16, 2)


def test_ring_is_deterministic_across_instances_and_processes() -> None:
    keys = _keys(50)
    a = [next(HashRing(REPLICAS).walk(k)) for k in keys]
    b = [next(HashRing(list(reversed(REPLICAS))).walk(k)) for k in keys]
    assert a == b
    assert len(set(a)) == len(REPLICAS)  # 50 keys reach every replica
    # another interpreter (another PYTHONHASHSEED) computes the same homes
    code = (
        "import random\n"
        "from kvscale.router.balance import HashRing, prefix_key\n"
        f"R = {REPLICAS!r}\n"
        "rng = random.Random(0)\n"
        "keys = [prefix_key([rng.randrange(5000) for _ in range(32)], 16, 2) for _ in range(50)]\n"
        "print(' '.join(next(HashRing(R).walk(k)) for k in keys))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONSAFEPATH": "1"},
        timeout=120,
    ).stdout.split()
    assert out == a


def test_walk_visits_every_replica_once_and_removal_moves_only_its_keys() -> None:
    ring = HashRing(REPLICAS)
    for k in _keys(20):
        assert sorted(ring.walk(k)) == sorted(REPLICAS)
    smaller = HashRing(REPLICAS[1:])
    for k in _keys(100, seed=1):
        home = next(ring.walk(k))
        if home != REPLICAS[0]:
            assert next(smaller.walk(k)) == home  # consistent hashing: the others stay
        else:  # the removed replica's keys go to the next one on the ring
            assert next(smaller.walk(k)) == list(ring.walk(k))[1]


def test_same_prefix_goes_to_the_same_replica() -> None:
    ring = HashRing(REPLICAS)
    loads = {r: Load() for r in REPLICAS}
    rng = random.Random(3)
    system = [rng.randrange(5000) for _ in range(64)]
    picks = set()
    for _ in range(10):
        ids = system + [rng.randrange(5000) for _ in range(rng.randrange(1, 40))]
        c = choose("prefix", prefix_key(ids, 16, 4), ring, loads)
        assert c is not None and c.reason == PREFIX_HIT
        picks.add(c.replica)
    assert len(picks) == 1


def test_bounded_load_skips_the_overloaded_home() -> None:
    ring = HashRing(REPLICAS)
    key = _keys(1)[0]
    order = list(ring.walk(key))
    loads = {r: Load(inflight=1) for r in REPLICAS}
    c = choose("prefix", key, ring, loads)
    assert c is not None and (c.replica, c.reason) == (order[0], PREFIX_HIT)
    # the home carries 5 of 9: the bound is ceil(1.25 * 10 / 5) = 3, so it is skipped
    loads[order[0]] = Load(inflight=3, others=2)
    assert load_bound(loads, 0.25) == 3
    c = choose("prefix", key, ring, loads, epsilon=0.25)
    assert c is not None and (c.replica, c.reason) == (order[1], LOAD_BOUND)
    # a larger epsilon keeps it home
    c = choose("prefix", key, ring, loads, epsilon=2.0)
    assert c is not None and c.replica == order[0]
    # a full KV cache counts as over the bound, too
    loads[order[0]] = Load(inflight=1, kv_usage=0.99)
    c = choose("prefix", key, ring, loads)
    assert c is not None and (c.replica, c.reason) == (order[1], LOAD_BOUND)
    # a replica not ready (absent from loads) is skipped, and is no longer the "home"
    del loads[order[0]]
    c = choose("prefix", key, ring, loads)
    assert c is not None and (c.replica, c.reason) == (order[1], PREFIX_HIT)


def test_the_chosen_replica_always_fits_the_bound() -> None:
    rng = random.Random(7)
    ring = HashRing(REPLICAS)
    for key in _keys(300, seed=2):
        loads = {r: Load(rng.randrange(10), rng.randrange(12)) for r in REPLICAS}
        c = choose("prefix", key, ring, loads, epsilon=rng.choice([0.0, 0.25, 1.0]))
        assert c is not None and c.load + 1 <= c.bound


def test_parse_load_reads_the_servers_gauges() -> None:
    from kvscale.router.endpoints import parse_load

    text = (
        "# TYPE kvscale:num_requests_running gauge\n"
        'kvscale:num_requests_running{model_name="m"} 3.0\n'
        "# TYPE kvscale:num_requests_waiting gauge\n"
        'kvscale:num_requests_waiting{model_name="m"} 2.0\n'
        "# TYPE kvscale:kv_cache_usage_perc gauge\n"
        'kvscale:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    assert parse_load(text) == (5, 0.5)
    assert parse_load("") == (0, 0.0)


def test_short_prompts_and_least_loaded_go_to_the_least_loaded() -> None:
    ring = HashRing(REPLICAS)
    loads = {r: Load(inflight=3) for r in REPLICAS}
    loads[REPLICAS[3]] = Load(inflight=1, others=1)
    loads[REPLICAS[2]] = Load(inflight=0, others=4)  # other routers' requests
    key = prefix_key(list(range(10)), 16, 4)
    assert key is None
    c = choose("prefix", key, ring, loads)
    assert c is not None and (c.replica, c.reason) == (REPLICAS[3], NO_PREFIX)
    c = choose("least-loaded", _keys(1)[0], ring, loads)
    assert c is not None and (c.replica, c.reason) == (REPLICAS[3], LEAST_LOADED)
    # excluded (already tried) replicas are never chosen; none left: None
    c = choose("least-loaded", None, ring, loads, exclude=frozenset({REPLICAS[3]}))
    assert c is not None and c.replica != REPLICAS[3]
    assert choose("random", None, ring, loads, exclude=frozenset(REPLICAS)) is None
    assert choose("prefix", _keys(1)[0], ring, {}) is None
