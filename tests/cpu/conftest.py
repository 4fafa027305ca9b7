import pytest

from tokenyard.tools.launch import RankPool

_pools = {}


@pytest.fixture(scope="session")
def ranks():
    """``ranks(n)`` -> a RankPool of n gloo ranks, started on first use and restarted when broken (NOTE [rank pool] in
    tokenyard/tools/launch.py)."""

    def get(world_size: int) -> RankPool:
        pool = _pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = _pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in _pools.values():
        pool.close()
