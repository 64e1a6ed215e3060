"""World models from the policy's own rollouts: RWML (``algo=rwml``, ``algo=rwml_grpo``) and WM-SFT (``algo=wm_sft``).

RWML (arXiv 2602.05842, self-supervised world-model RL): the policy, prompted to act as the environment, samples
next observations of its own transitions and is trained by GRPO + KL on a binary match reward. WM-SFT (the world-model
SFT term of CoPE's authors' code, ulab-uiuc/CoPE): the same prompt, the real next observation as a cross-entropy
target, a small weighted term beside GRPO.

* :mod:`~cope.algos.rwml.triplets`: (history up to a_t, a_t, s_{t+1}) from an epoch's episodes;
* :mod:`~cope.algos.rwml.prompt`: the world-model prompt, token-exact, shared by both;
* :mod:`~cope.algos.rwml.rewards` and :mod:`~cope.algos.rwml.embedders`: RWML's rewards (embedding cosine under
  tau_d, ROUGE-L, exact match) and the frozen embedders;
* :mod:`~cope.algos.rwml.easy_filter`: RWML's too-easy filter;
* :mod:`~cope.algos.rwml.collector`: RWML as a collector (``data.collector``): the world-model episodes, its stage
  switch to ordinary GRPO (``rwml.epochs``);
* :mod:`~cope.algos.rwml.world`: the engine capability it needs and its reductions over ranks;
* :mod:`~cope.algos.rwml.wm_sft` and :mod:`~cope.algos.rwml.wm_loss`: WM-SFT's samples as extra rows and its loss.
"""
