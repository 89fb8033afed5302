"""The allocator settings the ZeroMQ transport makes (allocator.py): once, and never over the user's own."""

import platform

import pytest

from openprime.transports.zmq import allocator


@pytest.mark.parametrize(("name", "value"), [("MALLOC_TRIM_THRESHOLD_", "131072"),
                                             ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")])
def test_user_settings_are_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert allocator._apply() is False


def test_applied_once_per_process(monkeypatch):
    monkeypatch.setattr(allocator, "_applied", None)
    calls = []
    monkeypatch.setattr(allocator, "_apply", lambda: calls.append(1) or True)
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert calls == [1]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds(monkeypatch):
    for name in (*allocator._USER_SETTINGS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert allocator._apply() is True
