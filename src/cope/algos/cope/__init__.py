"""CoPE (arXiv 2610.20597): on winning on-policy episodes, the policy learns to forecast its next K actions.

``algo=cope``, as its authors built it:

* :mod:`~cope.algos.cope.prompted`: the prompted forecast sample (h_t, a plan-ahead user turn, the next k actions),
  gates, look-past of invalid actions, group weights;
* :mod:`~cope.algos.cope.forecasts`: the callback that builds the epoch's samples and puts them into training
  (a separate optimizer step, or the same forward);
* :mod:`~cope.algos.cope.temporal_ensemble` and :mod:`~cope.algos.cope.te_loss`: the temporal-ensemble term
  (the math; the objective and the scored transform that gives it its targets).

Shared by both readings:

* :mod:`~cope.algos.cope.chunks`: the ``ForecastChunk`` record, and the continuation chunks (``algo=cope_continuation``:
  a_t..a_{t+K-1} continuing the transcript, invalid actions masked or cut);
* :mod:`~cope.algos.cope.packing`: chunks in a batch (packed segments, plain rows, the separate update's batches);
* :mod:`~cope.algos.cope.loss`: the forecast objective (group-weighted per-sample CE; ``update`` separate or joint;
  the continuation's adaptive scale);
* :mod:`~cope.algos.cope.forecast_targets` and :mod:`~cope.algos.cope.loss_balance`: the continuation's callbacks
  (its targets in every minibatch; the adaptive scale's measurements).
"""
