"""CoPE (arXiv 2610.20597): on successful on-policy episodes, forecast the next K actions from each history.

* :mod:`~cope.algos.cope.chunks`: action chunks a_t..a_{t+K-1} from successful episodes (observations skipped,
  invalid actions masked or cut) and their two equivalent batch layouts (packed: same forward pass, segment attention;
  plain: one extra row per chunk, flagged ``aux_row``);
* :mod:`~cope.algos.cope.loss`: the forecast objective and its adaptive scale (the only owner of that state,
  checkpointed with the objective);
* :mod:`~cope.algos.cope.forecast_targets`: the callback that adds the targets to every minibatch;
* :mod:`~cope.algos.cope.loss_balance`: the callback that feeds the adaptive scale each step's magnitudes: loss values
  (``normalize=adaptive``) or gradient norms it measures itself (``normalize=gradnorm``); the new scale applies from
  the next step.
"""
