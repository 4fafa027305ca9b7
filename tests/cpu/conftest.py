import pytest

from tokenyard import env
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


@pytest.fixture
def tokenyard_env(monkeypatch):
    """``tokenyard_env(name, value)`` sets environment variable `name` (None: unsets it) and has `env.settings` read
    it again, as a process started so would; at the end every variable is as before and read again."""

    def set_variable(name: str, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        env.settings.cache_clear()

    yield set_variable
    monkeypatch.undo()
    env.settings.cache_clear()
