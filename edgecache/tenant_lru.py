"""Entries of many tenants under one bound, each tenant with a share of it.

Tables that every tenant's traffic fills (the callers' wrong marks, the semantic learner's entries) must stay
bounded without letting one tenant's traffic push out another's. :class:`TenantLru` keeps each tenant's entries in
least-recently-used order; past the bound, the least recently used entry of the tenant that holds the most goes (on
a tie, the tenant that just added one). A tenant that holds no more than its share, the bound over the tenants that
hold any, therefore never loses an entry to another tenant's traffic; one that holds more loses its own first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TenantLru(Generic[K, V]):
    """(tenant, key) -> value, at most ``max_entries`` in all."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._of: dict[str, OrderedDict[K, V]] = {}
        self._count = 0

    def get(self, tenant: str, key: K) -> V | None:
        """The value, leaving its place in the order alone (a read on the hit path)."""
        entries = self._of.get(tenant)
        return entries.get(key) if entries is not None else None

    def touch(self, tenant: str, key: K) -> V | None:
        """The value, now the tenant's most recently used."""
        entries = self._of.get(tenant)
        if entries is None or key not in entries:
            return None
        entries.move_to_end(key)
        return entries[key]

    def put(self, tenant: str, key: K, value: V) -> None:
        """Set the value, the tenant's most recently used; past the bound the heaviest tenant's oldest goes."""
        entries = self._of.setdefault(tenant, OrderedDict())
        if key not in entries:
            self._count += 1
        entries[key] = value
        entries.move_to_end(key)
        while self._count > self.max_entries:
            heaviest = max(self._of, key=lambda t: (len(self._of[t]), t == tenant))
            self._pop_oldest(heaviest)

    def pop(self, tenant: str, key: K) -> V | None:
        entries = self._of.get(tenant)
        if entries is None or key not in entries:
            return None
        value = entries.pop(key)
        self._count -= 1
        if not entries:
            del self._of[tenant]
        return value

    def drop(self, tenant: str | None = None, where: Callable[[K], bool] | None = None) -> None:
        """Forget the entries of ``tenant`` (None: every tenant) whose key ``where`` picks (None: all)."""
        for name in [tenant] if tenant is not None else list(self._of):
            entries = self._of.get(name)
            if entries is None:
                continue
            for key in [key for key in entries if where is None or where(key)]:
                del entries[key]
                self._count -= 1
            if not entries:
                del self._of[name]

    def held(self, tenant: str) -> int:
        """How many entries ``tenant`` holds."""
        entries = self._of.get(tenant)
        return len(entries) if entries is not None else 0

    def items(self) -> Iterator[tuple[str, K, V]]:
        """Every entry as (tenant, key, value), each tenant's least recently used first."""
        for tenant, entries in self._of.items():
            for key, value in entries.items():
                yield tenant, key, value

    def __len__(self) -> int:
        return self._count

    def _pop_oldest(self, tenant: str) -> None:
        entries = self._of[tenant]
        entries.popitem(last=False)
        self._count -= 1
        if not entries:
            del self._of[tenant]
