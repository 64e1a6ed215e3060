"""How an epoch's experience is gathered: the collector seam (:mod:`~cope.train.collect.collector`) and its collectors
(:mod:`~cope.train.collect.sync`: collect, then train; :mod:`~cope.train.collect.lagged`: rollouts that overlap
training), the episodes made an epoch record (:mod:`~cope.train.collect.epoch_builder` on the plain functions of
:mod:`~cope.train.collect.experience`), the run's counters (:mod:`~cope.train.collect.counters`) and the held-out
panel (:mod:`~cope.train.collect.validation`)."""
