"""Offline generator of alfworld-style (generated) games: the files of an ALFWorld game folder, built
from what the ``alfworld`` package ships, for the real ALFWorld text engine to run.

These are NOT the ALFWorld benchmark games (those come from ``alfworld-download``); no result on them
is an ALFWorld result. They are called "alfworld-style (generated)" everywhere.

A game folder holds what an official one holds::

    initial_state.pddl   the PDDL problem (objects, initial facts, goal) for alfworld's ``alfred.pddl`` domain
    traj_data.json       task type, floor plan and ``pddl_params`` (what alfworld's handcoded expert reads)
    game.tw-pddl         {"pddl_domain", "grammar" (the task sentence filled in), "pddl_problem",
                          "solvable", "walkthrough"}: what textworld's ``PddlEnv`` loads

The scene and the task come from :mod:`cope.envs.alfworld.scenes`; the goal formula and the task
sentence templates are alfworld's own (``alfworld.gen.goal_library``), names are mangled the way
ALFWorld's problems are (``Cabinet|+00.68|...`` -> ``Cabinet_bar__plus_00_dot_68...``), and the
walkthrough (go to, open, take, clean/heat/cool, use, move) names things the way the engine will
(alfworld's ``Demangler``: "cabinet 3").

Cache: ``<cache_dir>/<key>/<split>/<index>/`` with ``key`` naming the generator version, seed and task
types. A game is written into a temporary folder next to its final place and renamed into place
(atomic), so concurrent workers never see half a game; a present game is reused as is. Same
arguments -> byte-identical files.

Run ``python -m cope.envs.alfworld.games CACHE_DIR --split train --num 100`` to pre-generate games.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence

from cope.envs.alfworld.scenes import OPENABLE, TASK_TYPES, Scene, Thing, sample_scene

GENERATOR_VERSION = 1
GENERATOR_NAME = "cope-trainer alfworld-style (generated)"
_MANGLE = {"-": "_minus_", "|": "_bar_", "+": "_plus_", ".": "_dot_", ",": "_comma_"}


def mangle(name: str) -> str:
    """An ALFRED id as a PDDL name, the way ALFWorld's problem files spell it."""
    return "".join(_MANGLE.get(ch, ch) for ch in name)


def cache_key(seed: int, task_types: Sequence[str]) -> str:
    types = ",".join(sorted(task_types))
    digest = hashlib.sha256(f"{GENERATOR_VERSION}/{seed}/{types}".encode()).hexdigest()[:10]
    return f"v{GENERATOR_VERSION}-seed{seed}-{digest}"


def problem_pddl(scene: Scene) -> str:
    """The PDDL problem (ALFWorld's ``initial_state.pddl`` layout) of ``scene``."""
    from alfworld.gen import constants as c
    from alfworld.gen.goal_library import gdict

    m = mangle
    objects, receps = scene.objects, scene.receptacles
    static = sorted(c.RECEPTACLES - set(c.MOVABLE_RECEPTACLES))
    otypes = sorted((set(c.OBJECTS) | set(c.MOVABLE_RECEPTACLES)) - set(static))
    locations = sorted({r.where for r in receps} | {scene.agent_location})
    where = {r.id: r.where for r in receps}
    decl = (["agent1 - agent"] + [f"{t}Type - otype" for t in otypes] + [f"{t}Type - rtype" for t in static]
            + [f"{m(o.id)} - object" for o in objects] + [f"{m(r.id)} - receptacle" for r in receps]
            + [f"{m(loc)} - location" for loc in locations])
    init = [f"(atLocation agent1 {m(scene.agent_location)})"]
    for r in receps:
        init += [f"(receptacleType {m(r.id)} {r.type}Type)", f"(receptacleAtLocation {m(r.id)} {m(r.where)})"]
        init += [f"(openable {m(r.id)})"] if r.type in OPENABLE else []
    props = {"cleanable": "Cleanable", "heatable": "Heatable", "coolable": "Coolable", "sliceable": "Sliceable"}
    for o in objects:
        init += [f"(objectType {m(o.id)} {o.type}Type)", f"(inReceptacle {m(o.id)} {m(o.where)})",
                 f"(objectAtLocation {m(o.id)} {m(where[o.where])})"]
        if o.type in ("DeskLamp", "FloorLamp"):
            init.append(f"(toggleable {m(o.id)})")
            continue
        init.append(f"(pickupable {m(o.id)})")
        init += [f"(isReceptacleObject {m(o.id)})"] if o.type in c.MOVABLE_RECEPTACLES else []
        init += [f"({p} {m(o.id)})" for p, key in props.items() if o.type in c.VAL_ACTION_OBJECTS[key]]
    present = sorted({o.type for o in objects})
    for rtype in sorted({r.type for r in receps}):
        init += [f"(canContain {rtype}Type {t}Type)" for t in present if t in c.VAL_RECEPTACLE_OBJECTS.get(rtype, ())]
    goal = gdict[scene.task_type]["pddl"].format(
        obj=scene.object_target, recep=scene.parent_target, toggle=scene.toggle_target, mrecep="")
    goal = goal.replace("#", "-").strip()
    assert goal.endswith(")")  # the library's goal also closes the (define ...): keep our own closing
    goal = goal[:-1].rstrip()
    lines = [f";; {GENERATOR_NAME}: {scene.split}/{scene.index}, FloorPlan{scene.floor_plan}. Not an ALFWorld benchmark game.",
             f"(define (problem gen_{scene.split}_{scene.index})",
             "    (:domain alfred)",
             "    (:objects",
             *(f"        {d}" for d in decl),
             "    )",
             "    (:init",
             *(f"        {f}" for f in init),
             "    )",
             "    " + goal,
             ")", ""]
    return "\n".join(lines)


def engine_names(scene: Scene) -> dict[str, str]:
    """ALFRED id -> the name the engine shows ("cabinet 3"), computed with alfworld's own Demangler on
    the (lower-cased, mangled) names the PDDL parser hands to the engine."""
    from types import SimpleNamespace

    from alfworld.agents.utils.misc import Demangler

    things = [*scene.receptacles, *scene.objects]
    infos = {t.id: SimpleNamespace(id=mangle(t.id).lower()) for t in things}
    demangler = Demangler(game_infos=infos)
    return {k: demangler.demangle_alfred_name(v.id) for k, v in infos.items()}


def walkthrough(scene: Scene, names: dict[str, str] | None = None) -> list[str]:
    """A winning command sequence, built from the scene (no search)."""
    names = names or engine_names(scene)
    plan: list[str] = []
    state = {"at": scene.agent_location, "opened": set()}

    def go(r: Thing) -> None:
        if state["at"] != r.where:
            plan.append(f"go to {names[r.id]}")
            state["at"] = r.where
        if r.type in OPENABLE and r.id not in state["opened"]:
            plan.append(f"open {names[r.id]}")
            state["opened"].add(r.id)

    def by_type(rtype: str) -> Thing:
        return min((r for r in scene.receptacles if r.type == rtype), key=lambda r: names[r.id])

    targets = sorted((o for o in scene.objects if o.type == scene.object_target), key=lambda o: names[o.id])
    count = 2 if scene.task_type == "pick_two_obj_and_place" else 1
    for o in targets[:count]:
        r = scene.receptacle(o.where)
        go(r)
        plan.append(f"take {names[o.id]} from {names[r.id]}")
        verb = {"pick_clean_then_place_in_recep": ("clean", "SinkBasin"),
                "pick_heat_then_place_in_recep": ("heat", "Microwave"),
                "pick_cool_then_place_in_recep": ("cool", "Fridge")}.get(scene.task_type)
        if verb:
            appliance = by_type(verb[1])
            if state["at"] != appliance.where:
                plan.append(f"go to {names[appliance.id]}")
                state["at"] = appliance.where
            plan.append(f"{verb[0]} {names[o.id]} with {names[appliance.id]}")
        if scene.task_type == "look_at_obj_in_light":
            lamp = next(x for x in scene.objects if x.type == scene.toggle_target)
            holder = scene.receptacle(lamp.where)
            if state["at"] != holder.where:
                plan.append(f"go to {names[holder.id]}")
                state["at"] = holder.where
            plan.append(f"use {names[lamp.id]}")
        else:
            parent = by_type(scene.parent_target)
            go(parent)
            plan.append(f"move {names[o.id]} to {names[parent.id]}")
    return plan


def traj_data(scene: Scene) -> dict:
    """What alfworld reads from ``traj_data.json`` (task type, ``pddl_params``), plus provenance."""
    return {
        "generator": GENERATOR_NAME,
        "generator_version": GENERATOR_VERSION,
        "task_id": f"generated_{scene.split}_{scene.index:06d}",
        "task_type": scene.task_type,
        "split": scene.split,
        "scene": {"floor_plan": f"FloorPlan{scene.floor_plan}", "scene_num": scene.floor_plan},
        "pddl_params": {"object_target": scene.object_target, "parent_target": scene.parent_target,
                        "toggle_target": scene.toggle_target, "mrecep_target": "", "object_sliced": False},
        "turk_annotations": {"anns": [{"task_desc": scene.description}]},
    }


def game_files(scene: Scene) -> dict[str, str]:
    """File name -> text of the game folder of ``scene``."""
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    with open(ALFRED_PDDL_PATH) as f:
        domain = f.read()
    with open(ALFRED_TWL2_PATH) as f:
        grammar = f.read().replace("UNKNOWN GOAL", scene.description)  # what alfworld's add_task_to_grammar does
    problem = problem_pddl(scene)
    game = {"pddl_domain": domain, "grammar": grammar, "pddl_problem": problem,
            "solvable": True, "walkthrough": walkthrough(scene)}
    return {
        "initial_state.pddl": problem,
        "traj_data.json": json.dumps(traj_data(scene), indent=2, sort_keys=True) + "\n",
        "game.tw-pddl": json.dumps(game, sort_keys=True) + "\n",
    }


def game_dir(cache_dir: str, split: str, index: int, task_types: Sequence[str], seed: int = 0) -> str:
    return os.path.join(cache_dir, cache_key(seed, task_types), split, f"{index:06d}")


def ensure_game(cache_dir: str, split: str, index: int, task_types: Sequence[str] = TASK_TYPES,
                seed: int = 0) -> str:
    """Path of the ``game.tw-pddl`` of generated game ``index`` of ``split``; written (atomically) if absent."""
    final = game_dir(cache_dir, split, index, task_types, seed)
    path = os.path.join(final, "game.tw-pddl")
    if os.path.isfile(path):
        return path
    files = game_files(sample_scene(split, index, task_types, seed))
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{index:06d}-", dir=parent)
    try:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same game first: keep theirs
            if not os.path.isfile(path):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Pre-generate alfworld-style (generated) games (not ALFWorld benchmark games).")
    p.add_argument("cache_dir")
    p.add_argument("--split", choices=("train", "test"), default="train")
    p.add_argument("--num", type=int, default=100)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-types", nargs="+", default=list(TASK_TYPES), choices=TASK_TYPES)
    args = p.parse_args(argv)
    for i in range(args.start, args.start + args.num):
        print(ensure_game(args.cache_dir, args.split, i, args.task_types, args.seed))


if __name__ == "__main__":
    main()
