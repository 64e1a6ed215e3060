"""SIGTERM (a scheduler's preemption, ``kill``, a launcher stopping its jobs) ends a run as *interrupted*:
exit status 143 (128 + SIGTERM), the last epoch checkpoint kept, one log line saying how to resume.
The run stops at the next optimizer step or validation batch (Lightning's own check) or, during a
rollout, after the turn in progress (``RolloutDataModule`` checks after every turn: a rollout at 7B
can outlast a scheduler's grace period).

Lightning already stops ``fit`` at the next batch end after a SIGTERM, but it raises
``SIGTERMException`` (a ``SystemExit`` without a code), so the process exited with status 0 after any
epoch and looked finished to every caller (a study launcher, a job array, a shell ``&&``). Its flag is
also reset at the start of each stage, so a SIGTERM during the pre-fit validation was forgotten and
the run trained on.

:class:`SigtermGuard` records the signal from the moment the trainer takes over (it chains with
Lightning's own handler, which Lightning registers on top of whatever is installed) and keeps that
record across stages; :meth:`SigtermGuard.stop` is the ``SystemExit(143)`` the run ends with. The
epoch being trained when the signal came is not saved (a mid-epoch state cannot be resumed exactly);
``last.ckpt`` holds the newest finished epoch (``callbacks.checkpoint.every_n_epochs``), and
``ckpt_path=auto`` continues from it as an uninterrupted run would.
"""
from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

log = logging.getLogger(__name__)

EXIT_SIGTERM = 128 + signal.SIGTERM  # 143, what a shell reports for a process ended by SIGTERM


class SigtermGuard:
    """Context manager: while active, a SIGTERM is recorded (``received``) instead of ending the process;
    the previous handler is restored on exit. Use in the main thread only (``signal`` requires it)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: signal.Handlers | None = None

    def __enter__(self) -> SigtermGuard:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            log.warning("SIGTERM received: the run stops after the current turn, optimizer step or validation batch")
        self.received = True

    def stop(self, epoch: int, checkpoint: Path) -> SystemExit:
        """The exit to raise after a cut-short stage (``epoch``: the epoch that was interrupted)."""
        if checkpoint.exists():
            where = f"{checkpoint} holds the newest finished epoch; rerun with ckpt_path=auto to resume"
        else:
            where = f"no checkpoint was written yet ({checkpoint}); a rerun starts from the beginning"
        log.warning("run interrupted by SIGTERM during epoch %d: %s (exit status %d)", epoch, where, EXIT_SIGTERM)
        return SystemExit(EXIT_SIGTERM)
