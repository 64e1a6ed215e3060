"""WM-SFT's samples in training (``algo=wm_sft``): a collate transform that appends them to each rollout minibatch.

Each epoch, from the episodes the DataModule collected, every triplet (:mod:`cope.algos.rwml.triplets`: history, a_t,
the observation s_{t+1}) becomes a world-model sample (:func:`cope.algos.rwml.prompt.sft_sample`: the transcript up
to a_t, the world-model user turn, the assistant header, then s_{t+1}'s ids and the turn end as the target). Each
minibatch gets the samples of its own episodes laid in by ``layout`` (:mod:`cope.train.packing.segments`) and
``wm_mask`` marks their targets; :class:`cope.algos.rwml.wm_loss.WorldModelNLL` adds ``weight x`` their mean token NLL
to the policy-gradient loss of the same step. Sample tokens are ``roles`` PAD in either layout: scored untempered (the
model's own distribution), and no other objective sees them.

* ``packed`` (the default): each sample a segment after its episode's transcript, in the same row (a tree: the
  segment sees the transcript up to its anchor). The transcript is forwarded once for all of its samples, so the
  cost is the samples' own tokens; one row per sample forwards the prefix once per sample, which grows with the
  square of the episode's turns (``bench/wm_sft_cost.py`` measures both). With ``data.share_prefix`` the rows then
  join their group's trie. A packed row holds its transcript and all of its samples, and a row is never split: one
  longer than ``module.max_tokens_per_microbatch`` is forwarded alone, over the budget (``max_per_episode`` bounds
  it; a plain row is at most ``max_context``).
* ``plain``: one extra row per sample, ``tokens[:anchor] + sample``, ``aux_row`` True: the reference layout (the
  study's WM-SFT runs used it), the same loss and gradient (``tests/test_wm_sft.py``).

Why in the rollout minibatch (CoPE's ``update=joint``), not batches of their own (``update=separate``, the authors'
recommended world-model path): the coefficient (0.01; their range 1e-4 .. 0.01) then means what it says, a weight in
the summed loss, where in an Adam step of its own it is mostly normalized away; the run takes exactly GRPO's optimizer
steps (same count, same LR schedule), so a comparison with GRPO at equal steps holds; and each sample is trained in
the step of the episode it comes from. The cost is longer minibatches (``module.max_tokens_per_microbatch`` bounds
each forward).

Which samples: every triplet of every non-aborted episode, failed episodes too (no success gate: dynamics are learned
from any transition; their builder takes whatever trajectories it is handed, one sample per env turn), the last
``max_per_episode`` of an episode when that is set (their ``max_samples_per_trajectory`` keeps the last ones), dropped
and counted when longer than ``max_context``.
"""
from __future__ import annotations

from lightning.pytorch import Callback

from cope.algos.rwml.prompt import WorldModelPrompt, WorldModelSample, sft_sample
from cope.algos.rwml.triplets import extract_triplets
from cope.algos.rwml.wm_loss import WM_MASK
from cope.episode import Episode
from cope.train.packing.segments import append_rows, pack_segments, target_mask

LAYOUTS = ("packed", "plain")


def append_samples(batch: dict, episodes: list[Episode], samples: list[WorldModelSample], pad_id: int,
                   layout: str = "plain") -> dict:
    """A new batch: ``batch`` (2D attention mask, as :func:`cope.batch.collate` gives it) with the samples of its
    episodes laid in by ``layout`` (:mod:`cope.train.packing.segments`): ``plain``, one extra row per sample,
    ``Episode.tokens[:anchor] + sample.tokens``, ``aux_row`` True on it; ``packed``, each sample a segment after its
    episode's transcript (the row a tree, ``packed`` set). Adds ``wm_mask`` marking the targets."""
    if layout not in LAYOUTS:
        raise ValueError(f"wm_sft.layout must be one of {LAYOUTS}, got {layout!r}")
    lay = append_rows if layout == "plain" else pack_segments
    out, placed = lay(batch, episodes, samples, pad_id, f"wm_sft ({layout})")
    out[WM_MASK] = target_mask(placed, tuple(out["input_ids"].shape))
    return out


def build_samples(episodes: list[Episode], chat, prompt: WorldModelPrompt, skip_invalid: bool = False,
                  max_per_episode: int | None = None,
                  max_context: int | None = None) -> tuple[list[WorldModelSample], dict[str, float]]:
    """The epoch's WM-SFT samples (see the module doc) and their metrics: ``wm/samples``, ``wm/target_tokens``,
    ``wm/dropped_long``."""
    out, dropped = [], 0
    by_episode: dict[int, list[WorldModelSample]] = {}
    for tr in extract_triplets(episodes, chat, skip_invalid):
        by_episode.setdefault(tr.episode, []).append(sft_sample(tr, chat, prompt))
    for ei in sorted(by_episode):
        mine = by_episode[ei][-max_per_episode:] if max_per_episode else by_episode[ei]
        for s in mine:
            if max_context is not None and len(s) > max_context:
                dropped += 1
            else:
                out.append(s)
    return out, {"wm/samples": float(len(out)), "wm/target_tokens": float(sum(sum(s.target) for s in out)),
                 "wm/dropped_long": float(dropped)}


class WorldModelSFT(Callback):
    """Registers WM-SFT's collate transform and logs its ``wm/*`` epoch metrics (see the module doc).

    Args:
        prompt: the world-model instruction (None: :data:`cope.algos.rwml.prompt.DEFAULT_INSTRUCTION`).
        skip_invalid: no samples from steps the env refused.
        max_per_episode: keep the last N samples of an episode (None: all).
        max_context: samples longer than this are dropped and counted (None: no limit).
        layout: ``packed`` (segments in their transcript's row) or ``plain`` (a row per sample); module doc.
    """

    def __init__(self, prompt: str | None = None, skip_invalid: bool = False, max_per_episode: int | None = None,
                 max_context: int | None = None, layout: str = "packed"):
        if layout not in LAYOUTS:
            raise ValueError(f"wm_sft.layout must be one of {LAYOUTS}, got {layout!r}")
        if max_per_episode is not None and max_per_episode < 1:
            raise ValueError(f"wm_sft.max_per_episode must be null (all) or >= 1, got {max_per_episode}")
        self.prompt_text, self.skip_invalid, self.max_per_episode = prompt, bool(skip_invalid), max_per_episode
        self.max_context, self.layout = max_context, layout
        self._prompt: WorldModelPrompt | None = None
        self._chat, self._pad_id, self._datamodule = None, 0, None
        self._built: tuple[list, list, dict] | None = None  # (the epoch's episode list, its samples, their metrics)

    def setup(self, trainer, pl_module, stage: str) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "add_collate_transform"):
            raise TypeError("WorldModelSFT needs the RolloutDataModule (cope.train.datamodule), which collates its samples")
        if not any(o.name == "wm" for o in pl_module.objectives):
            raise ValueError("algo.callbacks.wm_sft builds world-model samples, but algo.objectives has no `wm` entry "
                             "(cope.algos.rwml.wm_loss.WorldModelNLL) to train them")
        policy = pl_module.policy
        self._chat, self._pad_id = policy.chat, policy.pad_id
        self._prompt = WorldModelPrompt(policy.tokenizer, self.prompt_text)
        if dm is not self._datamodule:  # setup runs once per stage
            dm.add_collate_transform(self.transform)
            self._datamodule = dm

    def samples(self, episodes: list[Episode]) -> tuple[list[WorldModelSample], dict[str, float]]:
        """The epoch's samples (built once per epoch) and their metrics."""
        if self._built is None or self._built[0] is not episodes:  # the list object, not its id (ids are reused)
            got = build_samples(episodes, self._chat, self._prompt, self.skip_invalid, self.max_per_episode,
                                self.max_context)
            self._built = (episodes, *got)
        return self._built[1], self._built[2]

    def transform(self, batch: dict, episodes: list[Episode]) -> dict:
        return append_samples(batch, episodes, self.samples(episodes)[0], self._pad_id, self.layout)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._built is not None:
            pl_module.log_dict(self._built[2], on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
