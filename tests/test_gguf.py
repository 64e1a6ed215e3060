"""`cope.models.gguf`: the conversion cache is keyed by the GGUF file's content and written atomically, and a missing
package names what to install. The real conversion (SmolLM2) is exercised by tests/test_smollm2.py."""
from __future__ import annotations

import sys

import pytest

from cope.models import gguf


@pytest.fixture
def fake_convert(monkeypatch):
    calls = []

    def convert(src, dest):
        calls.append(src)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "_convert", convert)
    return calls


def test_cache_keyed_by_content(tmp_path, fake_convert):
    pytest.importorskip("gguf")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"one")
    b.write_bytes(b"one")
    out_a = gguf.convert_gguf(a, tmp_path / "cache")
    assert gguf.convert_gguf(b, tmp_path / "cache") == out_a and len(fake_convert) == 1  # same bytes: converted once
    b.write_bytes(b"two")
    assert gguf.convert_gguf(b, tmp_path / "cache") != out_a and len(fake_convert) == 2
    folders = sorted(p.name for p in (tmp_path / "cache").iterdir() if p.suffix != ".lock")  # cope.models.build_cache's locks
    assert folders == sorted([out_a.name, gguf.convert_gguf(b, tmp_path / "cache").name])
    assert (out_a / "cope_gguf.json").is_file()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    pytest.importorskip("gguf")

    def broken(src, dest):
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(gguf, "_convert", broken)
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="boom"):
        gguf.convert_gguf(src, tmp_path / "cache")
    left = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(left) == 1 and left[0].endswith(".lock")  # no half-written folder is ever picked up (a lock file stays)


def test_missing_gguf_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"cope-trainer\[smollm2\]"):
        gguf.convert_gguf(tmp_path / "m.gguf", tmp_path / "cache")


def test_missing_weights_package_names_the_install():
    with pytest.raises(ImportError, match="make install"):
        gguf.packaged_file("no_such_weights_package_xyz", "m.gguf", "`make install` installs it")
