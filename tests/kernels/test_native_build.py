"""The native kernels must build wherever a C compiler exists: the other native tests skip when the
library is unavailable, so without this a broken C source would only show up as skipped tests."""

from __future__ import annotations

import os
import shutil

import pytest

from deepinfer_kernels import native


def test_native_kernels_build_where_a_compiler_exists():
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler here")
    assert native.available(), f"the native kernels failed to build with {cc} (see the warning for its output)"
