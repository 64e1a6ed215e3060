"""Shared prefixes forwarded once (``data.share_prefix``, CoPE's packed forecasts): prefix trees
(:mod:`~cope.train.packing.prefix_tree`), packed rows (:mod:`~cope.train.packing.tree_batch`), GRPO groups packed as
the trie of their rows (:mod:`~cope.train.packing.group_prefix`, :mod:`~cope.train.packing.token_trie`) and the
attention that reads a tree (:mod:`~cope.train.packing.tree_attention`)."""
