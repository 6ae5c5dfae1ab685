"""Issue 21, case 9: the native library is loaded only from a private directory and only when it
is the file this user built (hash recorded at build time). A fake compiler keeps these fast."""

from __future__ import annotations

import os
import stat

import pytest

from deepinfer_kernels import native


@pytest.fixture
def fake_cc(tmp_path, monkeypatch):
    """A 'compiler' that writes a counter into its -o file at each link (the library), so each build is
    distinguishable; a compile (-c, one per source) just writes its object."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_private_fallback", None)
    cc = tmp_path / "fakecc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo fakecc 1; exit 0; fi\n'
                  'c=0; while [ "$#" -gt 0 ]; do if [ "$1" = -o ]; then out="$2"; fi; if [ "$1" = -c ]; then c=1; fi; shift; done\n'
                  'if [ $c = 1 ]; then echo obj > "$out"; exit 0; fi\n'
                  f'n=$(cat {tmp_path}/count 2>/dev/null || echo 0); n=$((n+1)); echo $n > {tmp_path}/count\n'
                  'echo "build $n" > "$out"\n')
    cc.chmod(0o755)
    return str(cc)


def _builds(tmp_path) -> int:
    return int((tmp_path / "count").read_text())


def test_build_records_a_hash_in_a_private_directory(fake_cc, tmp_path):
    lib = native._build(fake_cc)
    assert stat.S_IMODE(os.stat(lib.parent).st_mode) == 0o700
    assert not os.stat(lib).st_mode & 0o077
    assert lib.with_suffix(".sha256").read_text().strip() == native._sha256(lib)
    assert native._build(fake_cc) == lib and _builds(tmp_path) == 1  # verified: reused, not rebuilt


@pytest.mark.parametrize("tamper", ["replace", "no_hash", "group_writable"])
def test_a_tampered_library_is_rebuilt_not_loaded(fake_cc, tmp_path, tamper):
    lib = native._build(fake_cc)
    if tamper == "replace":  # a planted library under the expected name
        lib.write_text("planted")
    elif tamper == "no_hash":
        lib.with_suffix(".sha256").unlink()
    else:
        os.chmod(lib, 0o770)
    assert not native._verified(lib)
    again = native._build(fake_cc)
    assert _builds(tmp_path) == 2 and native._verified(again)
    assert again.read_text() == "build 2\n"


def test_a_loose_cache_directory_of_ours_is_tightened(fake_cc, tmp_path):
    d = tmp_path / "cache" / "native"
    d.mkdir(parents=True)
    os.chmod(d, 0o777)
    native._build(fake_cc)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_a_cache_directory_of_another_user_is_not_used(fake_cc, tmp_path, monkeypatch):
    real_uid = os.getuid()
    (tmp_path / "cache" / "native").mkdir(parents=True)
    monkeypatch.setattr(native.os, "getuid", lambda: real_uid + 1)  # as if the directory were someone else's
    with pytest.warns(UserWarning, match="not a directory owned by this user"):
        d = native._trusted_dir()
    assert d != tmp_path / "cache" / "native" and d.is_dir()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.rmdir(d)
