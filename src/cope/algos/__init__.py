"""The training methods, one place each: an algorithm's targets, batch packing, losses, state and callbacks.

* :mod:`cope.algos.grpo`: the policy-gradient objective (GRPO / Dr.GRPO clipped ratio) and the KL penalty;
  every algorithm builds on it.
* :mod:`cope.algos.echo`: ECHO's observation-token loss (arXiv 2605.24517).
* :mod:`cope.algos.cope`: CoPE action forecasting (arXiv 2610.20597) as its authors built it (prompted samples,
  a separate optimizer step, the temporal ensemble), and the earlier continuation reading.
* :mod:`cope.algos.empg`: EMPG entropy-modulated advantages (arXiv 2509.09265): the math and its callback.

Losses are pure functions (tensors in, ``(loss, metrics)`` out); objectives wrap them with a name and a
weight (:mod:`cope.train.objectives`); ``conf/algo/*.yaml`` decides which are on.
"""
