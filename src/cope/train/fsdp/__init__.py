"""``trainer=fsdp``: the strategy (:mod:`~cope.train.fsdp.strategy`), when the policy's weights are sharded and when
whole (:mod:`~cope.train.fsdp.sharding`), and sharded checkpoints (:mod:`~cope.train.fsdp.checkpoint`)."""
