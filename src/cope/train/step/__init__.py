"""One optimizer step, in the pieces the module composes: the scoring pass before an epoch's first step
(:mod:`~cope.train.step.scoring`), the micro-batched backward (:mod:`~cope.train.step.backward`), the non-finite step
guard (:mod:`~cope.train.step.guard`), the epoch's trust region (:mod:`~cope.train.step.trust_region`) and
per-objective gradients (:mod:`~cope.train.step.grad_stats`)."""
