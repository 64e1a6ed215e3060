"""``python train.py env=openenv debug=fast``: the tiny model trains a few epochs against the example OpenEnv env, served
locally by the trainer; the server is killed in the middle of the first validation (the example's fault injection
exits it abruptly, as a kill would): the validation episodes in flight abort and are counted, the server is restarted,
and every later episode runs (idle sessions reconnect); the run ends with its server stopped."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("openenv", reason="env=openenv needs openenv-core: pip install 'cope-trainer[openenv]'")


def _servers_of(tag: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "cope.envs.openenv.serve" in cmd and tag in env:
            out.append(pid)
    return out


@pytest.mark.long
def test_train_three_epochs_through_a_server_killed_mid_run(train_script, read_metrics, tmp_path):
    marker = tmp_path / "crashed"
    env = {"COPE_EXAMPLE_CRASH_ONCE": str(marker), "COPE_EXAMPLE_CRASH_AT": "3", "COPE_EXAMPLE_CRASH_ON": "/test/"}
    run = tmp_path / "run"
    # a longer warm start than debug=fast's: the first validation's guesses must be numbers that reach the server
    res = train_script(["env=openenv", "debug=fast", "trainer.max_epochs=3", "model.warm_start_steps=100",
                        f"hydra.run.dir={run}"], tmp_path, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert marker.exists() and "restarting it" in res.stdout + res.stderr
    m = read_metrics(run / "csv" / "metrics.csv")
    assert len(m["rollout/success"]) == 3 and len(m["val/success"]) == 4  # 3 epochs, validated before and after each
    assert m["val/aborted"][0] > 0 and m["val/aborted"][-1] == 0  # the validation in flight when it died, only
    assert max(m["rollout/aborted"]) == 0 and max(m["env/aborted_episodes"]) == 0
    assert not _servers_of(str(marker))  # stopped with the run
