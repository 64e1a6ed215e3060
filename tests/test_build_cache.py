"""cope.models.build_cache.build_once: one build across concurrent processes, nothing half-built left behind."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest

from cope.models.build_cache import build_once


def _slow_build(out: str, log: str) -> None:
    def build(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write("built\n")
        tmp.mkdir()
        time.sleep(0.5)
        (tmp / "config.json").write_text("{}")

    build_once(Path(out), build)


def test_concurrent_callers_build_once(tmp_path):
    out, log = tmp_path / "cache" / "key", tmp_path / "log.txt"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_slow_build, args=(str(out), str(log))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert log.read_text() == "built\n" and (out / "config.json").is_file()
    assert sorted(x.name for x in out.parent.iterdir()) == ["key", "key.lock"]  # no temporary folder left


def test_failed_build_leaves_nothing_and_a_retry_builds(tmp_path):
    out = tmp_path / "key"

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(out, broken)
    assert not out.exists() and [x.name for x in tmp_path.iterdir()] == ["key.lock"]
    out.mkdir()  # a stale folder without the ready file is replaced
    assert build_once(out, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}"))) is True
    assert build_once(out, lambda tmp: pytest.fail("built twice")) is False
