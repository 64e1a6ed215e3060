"""Tests for the terminal env (`cope.envs.terminal.env`), its task suite and the work-dir archives."""
from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile

import pytest

from cope.envs.actions import unencodable
from cope.envs.base import Env, Task
from cope.envs.terminal.env import (
    HARNESS_EMPTY,
    HARNESS_NOT_FOUND,
    HARNESS_STEP_LIMIT,
    HARNESS_SYNTAX,
    INSTRUCTIONS,
    NOT_SOLVED,
    SOLVED,
    TerminalEnv,
    parse_command,
    program_available,
)
from cope.envs.terminal.sandbox import unavailable_reason
from cope.envs.terminal.tasks import families, make_task
from cope.envs.terminal.workdir import Snapshot, add_files, is_complete, pack

_REASON = "bwrap not installed (Debian package: bubblewrap)" if shutil.which("bwrap") is None else unavailable_reason()
needs_sandbox = pytest.mark.skipif(_REASON is not None, reason=f"no sandbox here: {_REASON}")
FAMILIES = list(families())


def _task(split: str = "train", index: int = 0) -> Task:
    return Task(env="terminal", split=split, index=index)


@pytest.fixture(scope="module")
def env():
    e = TerminalEnv(timeout_s=3)
    yield e
    e.close()


def _family_env(family: str, **kw) -> TerminalEnv:
    missing = [p for p in make_task(family, "train", 0).needs if not program_available(p)]
    if missing:
        pytest.skip(f"{family} needs {missing} (Debian: apt-get install {' '.join(missing)})")
    return TerminalEnv(families=[family], timeout_s=3, **kw)


# ---- suite and protocol (no sandbox needed) -------------------------------------------------------------

def test_protocol_and_instructions():
    env = TerminalEnv()
    assert isinstance(env, Env)
    assert env.num_tasks("train") == 10_000 and env.num_tasks("test") == 500
    assert "submit" in env.instructions and env.instructions == INSTRUCTIONS
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("val")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("ls")
    env.close()
    env.close()  # safe twice


def test_suite_has_30_plus_families_in_all_categories():
    assert len(FAMILIES) >= 30
    for name in ("create_file", "set_mode", "grep_lines", "sed_replace", "sum_column", "greet_script", "python_sum",
                 "git_init_commit"):
        assert name in FAMILIES
    for name in FAMILIES:
        t = make_task(name, "train", 3)
        assert t.family == name and t.instruction and t.solution and callable(t.check)
        assert set(t.needs) <= {"git", "python3"}


def test_tasks_are_deterministic_and_splits_differ():
    for name in FAMILIES:
        a, b = make_task(name, "train", 5), make_task(name, "train", 5)
        assert (a.instruction, dict(a.files), a.solution, a.setup) == (b.instruction, dict(b.files), b.solution, b.setup)
        assert pack(a.files, a.modes, a.dirs) == pack(b.files, b.modes, b.dirs)
    differ = sum(make_task(n, "train", i).instruction != make_task(n, "test", i).instruction
                 or dict(make_task(n, "train", i).files) != dict(make_task(n, "test", i).files)
                 for n in FAMILIES for i in range(3))
    assert differ >= 0.9 * 3 * len(FAMILIES)


def test_index_maps_round_robin_over_families():
    env = TerminalEnv(families=["create_file", "line_count", "word_count"])
    assert [env.task("train", i).family for i in range(6)] == ["create_file", "line_count", "word_count"] * 2
    with pytest.raises(ValueError, match="index"):
        env.task("test", 500)
    held = TerminalEnv(families=["create_file", "line_count", "word_count"], held_out_families=["word_count"])
    assert {held.task("train", i).family for i in range(6)} == {"create_file", "line_count"}
    assert {held.task("test", i).family for i in range(6)} == {"word_count"}


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"name": ""}, "name"), ({"max_steps": 0}, "max_steps"), ({"num_train_tasks": 0}, "num_train_tasks"),
     ({"num_test_tasks": -1}, "num_test_tasks"), ({"max_output_chars": 0}, "max_output_chars"),
     ({"max_command_chars": 0}, "max_command_chars"), ({"max_command_chars": 10**6}, "max_command_chars"),
     ({"families": ["nope"]}, "families"), ({"families": []}, "families"),
     ({"held_out_families": ["nope"]}, "held_out_families"),
     ({"families": ["create_file"], "held_out_families": ["create_file"]}, "held_out_families"),
     ({"families": ["create_file"], "held_out_families": ["line_count"]}, "held_out_families"),
     ({"timeout_s": 0}, "timeout_s"), ({"memory_mb": 1}, "memory_mb"), ({"max_processes": 1}, "max_processes"),
     ({"work_size_mb": 0}, "work_size_mb"), ({"host_uid": 0}, "host_uid")],
)
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        TerminalEnv(**kwargs)


@pytest.mark.parametrize(
    ("raw", "command"),
    [("ls -la", "ls -la"), ("```bash\nls -la\n```", "ls -la"), ("```\ncat a.txt\n```", "cat a.txt"),
     ("`pwd`", "pwd"), ("Action: ls", "ls"), ("$ wc -l f.txt", "wc -l f.txt"), ("  ls  \n", "ls"),
     ("echo 'a  b'", "echo 'a  b'"),  # inner spaces and quotes mean something to bash: kept
     ("'ls' && echo 'x'", "'ls' && echo 'x'"), ("cp a.txt .", "cp a.txt ."),
     ("```bash\nfor f in *; do\n  echo $f\ndone\n```", "for f in *; do\n  echo $f\ndone"), ("", ""), ("``` ```", "")],
)
def test_parse_command(raw, command):
    assert parse_command(raw) == command


def test_workdir_pack_snapshot_roundtrip():
    state = pack({"a.txt": "hi\n", "d/e/f.bin": b"\x00\xff"}, modes={"a.txt": 0o600}, dirs=["empty"])
    snap = Snapshot(state)
    assert snap.text("a.txt") == "hi\n" and snap.mode("./a.txt") == 0o600 and snap.read("d/e/f.bin") == b"\x00\xff"
    assert snap.text("d/e/f.bin") is None and snap.is_dir("d/e") and snap.is_dir("empty") and snap.listdir() == [
        "a.txt", "d", "empty"]
    assert snap.files() == ["a.txt", "d/e/f.bin"] and snap.files("d") == ["d/e/f.bin"] and not snap.exists("nope")
    more = Snapshot(add_files(state, {"a.txt": "new\n", "h.txt": "hidden"}))
    assert more.text("a.txt") == "new\n" and more.text("h.txt") == "hidden" and more.read("d/e/f.bin") == b"\x00\xff"
    assert is_complete(state) and not is_complete(state[:700]) and not is_complete(b"") and not is_complete(b"junk" * 300)
    with pytest.raises(ValueError):
        Snapshot(state[:700])


def test_snapshot_never_follows_links():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, target in (("answer.txt", "/etc/hostname"), ("up", "../../etc/passwd")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    snap = Snapshot(buf.getvalue())
    assert snap.kind("answer.txt") == "symlink" and snap.read("answer.txt") is None
    assert snap.link("up") == "../../etc/passwd" and snap.text("up") is None
    for name in ("../../escape.txt", "/etc/cron.d/x", "a/../../b"):  # names that climb out are refused outright
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        with pytest.raises(ValueError, match="absolute name or one with '..'"):
            Snapshot(buf.getvalue())


def test_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import cope.envs.terminal.env, cope.envs.terminal.sandbox; "
            "print(len(cope.envs.terminal.env.TerminalEnv().num_tasks('train') * 'x'))")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "10000"


# ---- episodes in the sandbox ----------------------------------------------------------------------------

@pytest.mark.long
@needs_sandbox
@pytest.mark.parametrize("k", range(len(FAMILIES)))
def test_reference_solution_solves_and_bare_submit_fails(k):
    family = FAMILIES[k]
    env = _family_env(family)
    task = _task("test" if k % 2 else "train", 1 + k % 3)
    reset = env.reset(task)
    assert reset.observation.startswith(env._task.instruction) and reset.info["family"] == family
    for action in env.reference_solution():
        out = env.step(action)
        assert out.valid, (action, out.observation, out.harness)
        if out.done:
            break
    assert out.done and out.success and out.reward == 1.0 and out.score == 1.0, (out.observation, out.info)
    assert out.observation == SOLVED and out.harness == ""
    env.reset(task)
    out = env.step("Submit.")
    assert out.done and out.valid and not out.success and out.reward == 0.0 and out.observation == NOT_SOLVED
    with pytest.raises(RuntimeError, match="reset"):
        env.step("ls")


@needs_sandbox
def test_observation_format_and_persistence(env):
    env.reset(_task(index=0))  # create_file: /work starts empty
    out = env.step("mkdir sub && echo hello > sub/f.txt && cd sub && pwd")
    assert out.valid and not out.done and out.harness == "" and out.reward == 0.0
    assert out.observation == "/work/sub\n[exit code 0]" and out.info["exit_code"] == 0
    out = env.step("pwd; cat sub/f.txt; echo $FOO; export FOO=1")
    assert out.observation == "/work\nhello\n\n[exit code 0]"  # files persist, cwd and variables do not
    out = env.step("ls nothere")
    assert out.valid and out.observation.endswith("[exit code 2]") and "No such file" in out.observation
    out = env.step("false")
    assert out.valid and out.observation == "[exit code 1]"


@needs_sandbox
@pytest.mark.parametrize(
    ("action", "harness", "ran"),
    [("", HARNESS_EMPTY, False), ("   \n ", HARNESS_EMPTY, False), ("```\n```", HARNESS_EMPTY, False),
     ("echo 'unclosed > made.txt", HARNESS_SYNTAX, False), ("touch made.txt; if then", HARNESS_SYNTAX, False),
     ("touch made.txt; no-such-program", HARNESS_NOT_FOUND, True)],
)
def test_invalid_actions(env, action, harness, ran):
    env.reset(_task(index=0))
    out = env.step(action)
    assert not out.valid and not out.done and out.harness == harness and out.reward == 0.0
    if harness == HARNESS_EMPTY:
        assert out.observation == ""
    else:
        assert out.observation.endswith("[exit code 2]" if harness == HARNESS_SYNTAX else "[exit code 127]")
    listing = env.step("ls")
    assert ("made.txt" in listing.observation) == ran  # a syntax error runs nothing


@needs_sandbox
def test_too_long_command_is_invalid():
    env = TerminalEnv(max_command_chars=20)
    env.reset(_task(index=0))
    out = env.step("echo " + "x" * 30)
    assert not out.valid and out.observation == "" and "longer than 20" in out.harness


@needs_sandbox
@pytest.mark.parametrize("action", ["touch made.txt; echo a\x00b", "touch made.txt; echo \ud800",
                                    "touch made.txt; echo \udcff"])
def test_unpassable_command_is_an_invalid_action(env, action):
    # byte-level tokenizers can emit these; before, `ValueError: embedded null byte` aborted the episode,
    # and U+DC80-U+DCFF went through os.fsencode as raw bytes: "echo \udcff" ran (made.txt appeared)
    env.reset(_task(index=0))
    out = env.step(action)
    nul = "[Invalid action: it contains a NUL byte (\\0), which no program argument can hold; not run.]"
    assert not out.valid and not out.done and out.observation == "" and out.info["exit_code"] is None
    assert out.harness == (unencodable(action) or nul)
    listing = env.step("ls")
    assert listing.valid and "made.txt" not in listing.observation  # nothing ran, the episode goes on


@needs_sandbox
def test_truncation_notice_is_harness():
    env = TerminalEnv(max_output_chars=50)
    env.reset(_task(index=0))
    out = env.step("seq 1000")
    text = out.observation.removesuffix("[exit code 0]")
    assert len(text) <= 51 and text.startswith("1\n2\n3\n") and "truncated" not in out.observation
    assert out.harness.startswith("[Output truncated to its first 50 characters") and "3893 bytes" in out.harness
    assert out.valid


@needs_sandbox
def test_timeout_notice_is_harness():
    env = TerminalEnv(timeout_s=1)
    env.reset(_task(index=0))
    out = env.step("echo before; touch kept.txt; sleep 30")
    assert out.valid and out.info["timed_out"] and out.observation == "before\n" and "[exit code" not in out.observation
    assert out.harness == "[The command timed out after 1 s and was killed.]"
    assert "kept.txt" in env.step("ls").observation


@needs_sandbox
def test_step_limit_runs_the_checker():
    env = _family_env("create_file", max_steps=2)
    env.reset(_task(index=0))
    first, _ = env.reference_solution()
    out = env.step(first)
    assert not out.done and out.info["timeout"] is False
    out = env.step("ls")
    assert out.done and out.success and out.reward == 1.0 and out.info["checked"]
    assert out.info["timeout"] is False  # the check passed: the task, not the budget, ended it
    assert out.harness == HARNESS_STEP_LIMIT and out.observation.endswith("[exit code 0]")
    env.reset(_task(index=0))
    env.step("ls")
    out = env.step("pwd")
    assert out.done and not out.success and out.reward == 0.0 and out.harness == HARNESS_STEP_LIMIT
    assert out.info["timeout"] is True


@needs_sandbox
def test_checker_ignores_symlinks_to_solutions():
    env = _family_env("line_count")
    env.reset(_task(index=0))
    out = env.step("wc -l < *.txt > /tmp/a; ln -s /tmp/a answer.txt")
    assert out.valid
    assert not env.step("submit").success  # the checker reads answer.txt without following the link


@needs_sandbox
def test_example_actions_are_well_formed(env):
    env.reset(_task(index=16))  # a family with files
    actions = env.example_actions()
    assert actions[-1] == "submit" and "ls" in actions and any(a.startswith("cat ") for a in actions)
    for action in actions[:-1]:
        out = env.step(action)
        assert out.valid and out.observation.endswith("[exit code 0]"), (action, out.observation)


@needs_sandbox
def test_git_families_skip_cleanly_without_git(monkeypatch):
    from cope.envs.terminal import env as terminal

    monkeypatch.setattr(terminal, "program_available", lambda name: name != "git")
    active = TerminalEnv().active_families()
    assert active and not any(f.startswith("git_") for f in active) and "python_sum" in active


@pytest.mark.long
@needs_sandbox
def test_e2e_one_epoch(run_train, tmp_path):
    result = run_train(["env=terminal", "model.max_context=2048", "data.max_context=2048", "model.tokenizer_episodes=4",
                        "model.warm_start_walks=4", "model.warm_start_steps=2", "data.tasks_per_epoch=1",
                        "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1", "data.val_batch_size=1",
                        "trainer.max_epochs=1", "env.max_steps=3", "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 2
