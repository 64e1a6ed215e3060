"""Rollout trajectories as a table: a few episodes of each training epoch, one row per turn.

Reads the epoch's episodes from the datamodule's record (``trainer.datamodule.train_record``) at
``on_train_epoch_end`` and writes, per agent turn, the action text, its validity and reward, and the
feedback the agent saw next. The feedback is decoded from ``Episode.tokens`` between
``Step.obs_start`` and ``Step.obs_end``, restricted to OBSERVATION and HARNESS tokens, so the chat
scaffold does not clutter the table (token-in/token-out: decoding is for display only).

Every run gets ``<log_dir>/trajectories.jsonl`` (one JSON line per turn), so CSV-only runs keep
their trajectories; a :class:`~lightning.pytorch.loggers.WandbLogger` additionally gets a
``rollout/trajectories`` table. Files are written on global rank zero only.

With ``messages`` (on by default) the same episodes also go to ``<log_dir>/trajectories_messages.jsonl``, one JSON
line per episode in the OpenAI chat format: ``{"epoch", "task", "episode", "success", "reward", "messages": [system,
user, assistant (with ``tool_calls`` in native-tool episodes), tool / user, ...], "tools": [...]}``
(:func:`cope.chat.conformance.episode_messages`), what SFT pipelines, eval tools and chat viewers read.
``python -m cope.callbacks.trajectory_table FILE [--successes]`` prints its ``{"messages", "tools"}`` records (an
SFT set).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning.pytorch import Callback
from lightning.pytorch.loggers import WandbLogger

from cope.chat.conformance import episode_messages
from cope.episode import Episode, Role
from cope.records import train_record
from cope.run.checkpoint_io import atomic_write_bytes

MESSAGES_FILE = "trajectories_messages.jsonl"
COLUMNS = ["epoch", "task", "episode", "step", "action", "valid", "reward", "observation", "sampled_epoch"]
# sampled_epoch: the epoch whose starting weights sampled the episode (= epoch, except with data.max_lag)
_FEEDBACK_ROLES = (int(Role.OBSERVATION), int(Role.HARNESS))


def _run_dir(trainer) -> Path:
    """The run folder: ``trainer.log_dir`` (a collective under DDP: call it on every rank), else
    ``trainer.default_root_dir``."""
    return Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir)


def pick_episodes(episodes: list[Episode], n: int) -> list[int]:
    """Indices of up to ``n`` episodes: the first success, the first failure, then the rest in order."""
    first = [next((i for i, e in enumerate(episodes) if e.success == want), None) for want in (True, False)]
    chosen = [i for i in first if i is not None]
    chosen += [i for i in range(len(episodes)) if i not in chosen]
    return chosen[:n]


def feedback_text(episode: Episode, step_index: int, tokenizer) -> str:
    """Decoded observation and harness text of the feedback turn after step ``step_index``."""
    s = episode.steps[step_index]
    if s.obs_start < 0 or s.obs_end <= s.obs_start:
        return ""
    span = slice(s.obs_start, s.obs_end)
    ids = [t for t, r in zip(episode.tokens[span], episode.roles[span]) if r in _FEEDBACK_ROLES]
    return tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class TrajectoryTable(Callback):
    """Logs a per-turn table of a few training episodes every ``every_n_epochs`` epochs.

    Args:
        num_episodes: episodes per table (the first success and first failure come first); >= 1.
        every_n_epochs: write after epochs ``n-1, 2n-1, ...`` (0-based); >= 1.
        max_chars: observation texts are cut to this many characters; >= 1. Actions are never cut: the file is a set
            of demonstrations ``algo=sft sft.source=file`` replays, and a cut action would be another action.
        messages: also write the episodes as OpenAI chat messages (``trajectories_messages.jsonl``; never cut).
    """

    def __init__(self, num_episodes: int = 4, every_n_epochs: int = 1, max_chars: int = 4000, messages: bool = True):
        for name, value in (("num_episodes", num_episodes), ("every_n_epochs", every_n_epochs), ("max_chars", max_chars)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrajectoryTable.{name} must be an int >= 1, got {value!r}")
        self.num_episodes, self.every_n_epochs, self.max_chars = num_episodes, every_n_epochs, max_chars
        self.messages = bool(messages)

    def rows(self, episodes: list[Episode], tokenizer, epoch: int) -> list[list]:
        """Table rows (in ``COLUMNS`` order) for the picked episodes of ``episodes``."""
        out = []
        for i in pick_episodes(episodes, self.num_episodes):
            ep = episodes[i]
            for j, s in enumerate(ep.steps):
                obs = feedback_text(ep, j, tokenizer)[: self.max_chars]
                out.append([epoch, ep.task.id, i, j, s.action_text, bool(s.valid), float(s.reward), obs,
                            ep.sampled_epoch])
        return out

    def message_records(self, episodes: list[Episode], tokenizer, chat, epoch: int) -> list[dict]:
        """One OpenAI-format record per picked episode (see the module doc)."""
        return [{"epoch": epoch, "task": episodes[i].task.id, "episode": i, "success": bool(episodes[i].success),
                 "reward": float(episodes[i].reward), **episode_messages(episodes[i], tokenizer, chat)}
                for i in pick_episodes(episodes, self.num_episodes)]

    def on_train_start(self, trainer, pl_module) -> None:
        # lines an earlier process wrote for the epoch this fit starts at or later: that epoch runs again
        for path in (_run_dir(trainer) / "trajectories.jsonl", _run_dir(trainer) / MESSAGES_FILE):
            if trainer.is_global_zero and path.exists():
                keep = [ln for ln in path.read_text(encoding="utf-8").splitlines(keepends=True)
                        if ln.strip() and json.loads(ln).get("epoch", -1) < trainer.current_epoch]
                atomic_write_bytes(path, "".join(keep).encode("utf-8"))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        path = _run_dir(trainer) / "trajectories.jsonl"  # resolved on every rank (log_dir broadcasts)
        if not trainer.is_global_zero:
            return
        record = train_record(trainer)
        episodes = list(record.episodes) if record is not None else []
        if not episodes:
            return
        data = self.rows(episodes, pl_module.policy.tokenizer, trainer.current_epoch)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in data:
                f.write(json.dumps(dict(zip(COLUMNS, row)), ensure_ascii=False) + "\n")
        chat = getattr(pl_module.policy, "chat", None)
        if self.messages and chat is not None:
            records = self.message_records(episodes, pl_module.policy.tokenizer, chat, trainer.current_epoch)
            with (path.parent / MESSAGES_FILE).open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(key="rollout/trajectories", columns=list(COLUMNS), data=data, step=trainer.global_step)


def main(argv: list[str] | None = None) -> None:
    """Print the ``{"messages", "tools"}`` records of a ``trajectories_messages.jsonl`` (an SFT set), one per line."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("file", type=Path, help=f"a {MESSAGES_FILE} of a run (<run>/csv/{MESSAGES_FILE})")
    p.add_argument("--successes", action="store_true", help="only the successful episodes")
    args = p.parse_args(argv)
    for line in args.file.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line) if line.strip() else None
        if rec is None or (args.successes and not rec.get("success")):
            continue
        out = {"messages": rec["messages"], **({"tools": rec["tools"]} if rec.get("tools") else {})}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
