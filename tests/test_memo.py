"""runtime.memo.Kept: a value is made once per key while kept, at most ``size`` are kept, and the
oldest is forgotten first."""
import pytest

from taperay.runtime.memo import Kept


def test_kept_makes_a_value_once_and_forgets_the_oldest_first():
    made = []

    def make(k):
        return lambda: made.append(k) or f"value {k}"

    kept = Kept(2)
    assert kept.get("a", make("a")) == "value a" and kept.get("a", make("a")) == "value a"
    kept.get("b", make("b"))
    kept.get("c", make("c"))                  # past size: "a" is forgotten, "b" kept
    assert len(kept) == 2
    kept.get("b", make("b"))
    kept.get("a", make("a"))
    assert made == ["a", "b", "c", "a"]


def test_kept_raises_what_make_raises_and_keeps_nothing_then():
    kept = Kept(4)
    with pytest.raises(ZeroDivisionError):
        kept.get("x", lambda: 1 / 0)
    assert len(kept) == 0 and kept.get("x", lambda: 3) == 3
    with pytest.raises(ValueError, match="at least one"):
        Kept(0)
