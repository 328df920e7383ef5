"""``Kept``: values kept by key, at most a fixed number, the oldest forgotten first. The runtime
keeps host work per tape content in them (compact records, lowerings, the JAX walker's layouts
and bounds), so that an edit back and forth finds its work done and a long-running process does not
grow without bound."""

__all__ = ["Kept"]


class Kept:
    """At most ``size`` values by key. ``get(key, make)``: the value kept for ``key``, else
    ``make()``'s, kept (the oldest entry forgotten past ``size``). Values are shared between
    callers: read, not changed."""

    __slots__ = ("size", "_values")

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"Kept needs room for at least one value, not {size}")
        self.size, self._values = size, {}

    def get(self, key, make):
        try:
            return self._values[key]
        except KeyError:
            pass
        value = make()
        if len(self._values) >= self.size:
            del self._values[next(iter(self._values))]
        self._values[key] = value
        return value

    def __len__(self) -> int:
        return len(self._values)
