"""WebShop-compatible shop: the adapter (:mod:`~cope.envs.webshop.env`, ``WebShopEnv``), the catalog
generator (:mod:`~cope.envs.webshop.catalog`, ``python -m cope.envs.webshop.catalog``) and its vocabulary
(:mod:`~cope.envs.webshop.vocab`), the search (:mod:`~cope.envs.webshop.search`), the purchase reward
(:mod:`~cope.envs.webshop.reward`) and the shipped catalog (``data/``). docs/envs/webshop.md."""
