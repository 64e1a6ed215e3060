"""Raw-package replays for bench/env_speed.py: each env's own package, called as its README calls it.

Each entry ``RAW[name](env_cfg, tasks)`` prepares the package's env for the same tasks our adapter
runs (same game / task and variation) and returns ``run(plans) -> (steps, seconds)``, which resets
each task and steps its recorded action texts, timing resets and steps only. Envs that are ours
(maze, the WebShop-compatible shop, terminal tasks) have no raw package and no entry.
"""
from __future__ import annotations

import time

RAW_NOTES = {
    "scienceworld": "scienceworld.ScienceWorldEnv.step() as shipped (it rebuilds the valid-action list every step)",
    "textworld": "textworld.start(game, EnvInfos(score, max_score, won, lost, objective, feedback)).step()",
    "alfworld": "textworld.gym env with AlfredDemangler + AlfredInfos (as alfworld's AlfredTWEnv), generated games",
}


def _replayer(envs, step):
    """``run(plans)``: episode i resets ``envs[i]`` and steps its plan with ``step(env, action)``."""

    def run(plans):
        n, t0 = 0, time.perf_counter()
        for env, plan in zip(envs, plans):
            env.reset()
            for a in plan:
                step(env, a)
                n += 1
        return n, time.perf_counter() - t0

    return run


def _adapter(env_cfg):
    from hydra.utils import instantiate

    return instantiate(env_cfg)()


def scienceworld(env_cfg, tasks):
    import scienceworld

    adapter = _adapter(env_cfg)
    pairs = [adapter.task_pair(t) for t in tasks]  # (task name, variation); starts no JVM
    simplifications = adapter.simplifications
    adapter.close()
    raw = scienceworld.ScienceWorldEnv("", envStepLimit=10**6)

    def run(plans):
        n, t0 = 0, time.perf_counter()
        for (name, variation), plan in zip(pairs, plans):
            raw.load(name, variation, simplifications)
            raw.reset()
            for a in plan:
                raw.step(a)
                n += 1
        return n, time.perf_counter() - t0

    return run


def textworld(env_cfg, tasks):
    import textworld

    adapter = _adapter(env_cfg)
    paths = [adapter.game_file(t) for t in tasks]  # generated into the cache if missing
    admissible = adapter.admissible
    adapter.close()
    infos = textworld.EnvInfos(score=True, max_score=True, won=True, lost=True, objective=True, feedback=True,
                               admissible_commands=admissible)
    envs = {p: textworld.start(p, request_infos=infos) for p in set(paths)}
    return _replayer([envs[p] for p in paths], lambda env, a: env.step(a))


def alfworld(env_cfg, tasks):
    import textworld
    import textworld.gym
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    adapter = _adapter(env_cfg)
    paths = [adapter.game_file(t.split, t.index) for t in tasks]  # generated into the cache if missing
    adapter.close()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    envs = {}
    for p in set(paths):  # how alfworld's AlfredTWEnv runs a game
        env_id = textworld.gym.register_games([p], infos, batch_size=1, asynchronous=False, max_episode_steps=10**6,
                                              wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
        envs[p] = textworld.gym.make(env_id)
    return _replayer([envs[p] for p in paths], lambda env, a: env.step([a]))


RAW = {"scienceworld": scienceworld, "textworld": textworld, "alfworld": alfworld}
