"""A fixture shared by the native-kernel tests: an install that built no library."""

from __future__ import annotations

import pytest

from training.objectives import knca_native, native, native_candidates


def forget_loaded_kernels() -> None:
    """Clear every loader's cache, so that the next use loads (or fails to load) afresh."""
    native.load_library.cache_clear()
    native_candidates._load.cache_clear()
    knca_native._load.cache_clear()


@pytest.fixture
def install_without_kernels(tmp_path, monkeypatch):
    """The loaders look in an empty folder, as after an install without a C compiler; the
    caches are cleared on the way in and out (monkeypatch restores the folder after)."""
    monkeypatch.setattr(native, "KERNEL_DIR", tmp_path)
    forget_loaded_kernels()
    yield
    forget_loaded_kernels()
