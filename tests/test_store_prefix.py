"""PrefixStore specifics: key layout, nesting, shared timeout, num_keys, ownership."""

from __future__ import annotations

from datetime import timedelta

import pytest

from meshcomm.errors import InvalidArgument
from meshcomm.store import HashStore, PrefixStore


def test_keys_live_under_prefix_slash() -> None:
    base = HashStore(timeout=5)
    job = PrefixStore("job", base)
    job.set("k", b"v")
    job.add("n", 2)
    job.multi_set(["a", "b"], [b"1", b"2"])
    job.append("log", b"x")
    assert base.multi_get(["job/k", "job/n", "job/a", "job/b", "job/log"]) == [
        b"v",
        b"2",
        b"1",
        b"2",
        b"x",
    ]
    assert base.check(["job/k"]) and not base.check(["k"])
    assert job.compare_set("k", b"v", b"w") == b"w"
    assert job.delete_key("k") and not base.check(["job/k"])


def test_nesting_and_isolation() -> None:
    base = HashStore(timeout=5)
    outer = PrefixStore("a", base)
    inner = PrefixStore("b", outer)
    other = PrefixStore("c", base)
    inner.set("k", b"inner")
    other.set("k", b"other")
    assert base.get("a/b/k") == b"inner"
    assert other.get("k") == b"other"
    assert inner.prefix == "b" and inner.underlying_store is outer


def test_timeout_and_num_keys_are_the_wrapped_stores() -> None:
    base = HashStore(timeout=5)
    base.set("outside", b"")
    job = PrefixStore("job", base)
    job.set_timeout(timedelta(seconds=2))
    assert base.timeout == 2.0 and job.timeout == 2.0
    job.set("k", b"")
    assert job.num_keys() == 2  # as torch: counts the whole wrapped store


def test_close_leaves_the_wrapped_store_open() -> None:
    base = HashStore(timeout=5)
    with PrefixStore("job", base) as job:
        job.set("k", b"v")
    assert base.get("job/k") == b"v"


def test_bad_prefix_and_keys() -> None:
    base = HashStore(timeout=5)
    with pytest.raises(InvalidArgument):
        PrefixStore("", base)
    with pytest.raises(TypeError):
        PrefixStore("p", object())  # type: ignore[arg-type]
    job = PrefixStore("job", base)
    with pytest.raises(InvalidArgument):
        job.set("", b"v")  # "job/" alone would be a valid key: the empty key must not pass
    with pytest.raises(InvalidArgument):
        job.wait("abc")
