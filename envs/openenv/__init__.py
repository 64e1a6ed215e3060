"""OpenEnv environments (openenv-core, extra ``openenv``) as ``env=openenv``: :mod:`cope.envs.openenv.env`."""
