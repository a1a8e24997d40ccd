"""The scripted engine the tests use lives with the benchmarks that need it too (:mod:`edgecache.bench.engines`)."""

from edgecache.bench.engines import FakeEngine

__all__ = ["FakeEngine"]
