"""The runtime's heap settings take on glibc (a value glibc rejects would silently leave
each step's tensors on fresh pages)."""

import ctypes.util
import platform

import pytest

from superfluid.runtimes.torch import heap


@pytest.mark.skipif(platform.system() != "Linux" or not ctypes.util.find_library("c"), reason="glibc only")
def test_glibc_takes_the_step_heap_settings():
    assert heap.keep_step_heap() is True
    assert heap.keep_step_heap() is True  # idempotent
    heap.give_back_freed_memory()
