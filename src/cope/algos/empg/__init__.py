"""EMPG (arXiv 2509.09265): per-step advantages modulated by action entropy.

* :mod:`~cope.algos.empg.advantages`: the math (a pure function over the epoch's scored minibatches);
* :mod:`~cope.algos.empg.callback`: registers it as a scored transform on the module.
"""
