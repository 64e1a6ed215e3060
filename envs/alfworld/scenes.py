"""Floor plans -> scenes and tasks for the alfworld-style (generated) games (``envs/alfworld/games.py``).

Everything here comes from what the ``alfworld`` package ships (no THOR simulator, no download):

* ``alfworld/gen/layouts/FloorPlan<N>-objects.json``: the object and receptacle types of floor plan N;
* ``FloorPlan<N>-openable.json``: receptacle ids (``Cabinet|+00.68|+00.50|-02.20``) with the pose
  the agent interacts from;
* ``FloorPlan<N>-layout.npy``: the reachable grid points (poses for the other receptacles, the start);
* ``alfworld.gen.constants``: which receptacle type holds which object types, the heatable, coolable
  and cleanable sets, and ALFRED's train/test floor plans.

A scene keeps the floor plan's receptacles (every receptacle of ``openable.json``, plus one instance
of each other receptacle type the floor plan lists) and samples a subset of its small objects. The
task picks follow ALFRED's rules: the object type fits the parent receptacle type, clean/heat/cool
need a sink basin/microwave/fridge (and a cleanable/heatable/coolable object), the target objects
never start inside a receptacle of the parent type, ``pick_two_obj_and_place`` has two or three of
them, ``look_at_obj_in_light`` needs a desk or floor lamp. Train and test use disjoint floor plans
(ALFRED's own split: test = floor plans 1-6, 201-206, 301-306, 401-406).

Deterministic: a scene is a function of (seed, split, index, task types) through string-seeded
``random.Random`` (stable across processes). Stdlib only at import; ``alfworld`` and ``numpy`` are
imported on first use.
"""
from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
# task type -> (appliance receptacle type, object property set in alfworld.gen.constants.VAL_ACTION_OBJECTS)
_APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable"),
}
LAMPS = ("DeskLamp", "FloorLamp")
_LAMP_HOLDERS = ("SideTable", "Desk", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand")
OPENABLE = ("Fridge", "Cabinet", "Microwave", "Drawer", "Safe", "Box")  # alfworld.gen.constants.OPENABLE_CLASS_LIST
_STEP = 0.25  # metres per grid step (alfworld.gen.constants.AGENT_STEP_SIZE)
_KEEP_TYPE, _COUNTS = 0.6, (1, 1, 1, 2, 2, 3)  # distractors: keep a type with this chance, this many of it
_MAX_ATTEMPTS = 200


@dataclass(frozen=True)
class Thing:
    """A receptacle (``where`` = its location ``loc|x|z|rot|horizon``) or an object (``where`` = the
    id of the receptacle it is in). Ids are ALFRED-style: ``Type|+x|+y|+z`` (basins: ``Sink|...|SinkBasin``)."""

    id: str
    type: str
    where: str


@dataclass(frozen=True)
class Scene:
    split: str
    index: int
    floor_plan: int
    task_type: str
    object_target: str
    parent_target: str  # "" for look_at_obj_in_light
    toggle_target: str  # "" unless look_at_obj_in_light
    receptacles: tuple[Thing, ...]
    objects: tuple[Thing, ...]
    agent_location: str
    description: str  # "put a apple in countertop" (the goal, ALFWorld's templates)

    def receptacle(self, rid: str) -> Thing:
        return next(r for r in self.receptacles if r.id == rid)


@functools.cache
def _constants():
    import alfworld.gen.constants as c

    return c


@functools.cache
def _layouts_dir() -> str:
    return os.path.join(os.path.dirname(_constants().__file__), "layouts")


def floor_plans(split: str) -> tuple[int, ...]:
    """ALFRED's scene split: train floor plans (7-30, 207-230, ...) and held-out test ones (1-6, 201-206, ...)."""
    c = _constants()
    return tuple(sorted(c.TRAIN_SCENE_NUMBERS if split == "train" else c.TEST_SCENE_NUMBERS))


def _room(floor_plan: int) -> str:
    return next(room for room, numbers in _constants().SCENE_TYPE.items() if floor_plan in numbers)


@functools.cache
def _floor_plan(floor_plan: int) -> tuple[frozenset[str], dict[str, list[float]], tuple[tuple[float, float], ...]]:
    import numpy as np

    base = os.path.join(_layouts_dir(), f"FloorPlan{floor_plan}")
    with open(f"{base}-objects.json") as f:
        types = frozenset(json.load(f))
    with open(f"{base}-openable.json") as f:
        poses = json.load(f)
    points = tuple((float(x), float(z)) for x, z in np.load(f"{base}-layout.npy").tolist())
    return types, poses, points


def _coord(v: float) -> str:
    return f"{v:+06.2f}"  # ALFRED's id format: +00.68, -01.55


def _loc(x: float, z: float, rot: int, horizon: int) -> str:
    return f"loc|{round(x / _STEP)}|{round(z / _STEP)}|{rot // 90 % 4}|{horizon}"


def _type_of(rid: str) -> str:
    parts = rid.split("|")
    return parts[4] if len(parts) == 5 else parts[0]


def _receptacles(floor_plan: int, rng: random.Random) -> list[Thing]:
    """The floor plan's receptacles: those with a precomputed pose, plus one of each other static type."""
    c = _constants()
    types, poses, points = _floor_plan(floor_plan)
    static = c.RECEPTACLES - set(c.MOVABLE_RECEPTACLES)
    out = [Thing(rid, _type_of(rid), _loc(x, z, int(rot), int(h))) for rid, (x, z, rot, h) in sorted(poses.items())]
    have = {r.type for r in out}
    for rtype in sorted(t for t in types if t in static and t not in have):
        x, z = rng.choice(points)
        y = rng.uniform(0.0, 1.8)
        prefix = {"SinkBasin": "Sink", "BathtubBasin": "Bathtub"}.get(rtype)
        rid = f"{prefix or rtype}|{_coord(x)}|{_coord(y)}|{_coord(z)}" + (f"|{rtype}" if prefix else "")
        out.append(Thing(rid, rtype, _loc(x, z, 90 * rng.randrange(4), 30)))
    return out


def _holders(receptacles: Sequence[Thing], otype: str, exclude: str = "") -> list[Thing]:
    val = _constants().VAL_RECEPTACLE_OBJECTS
    return [r for r in receptacles if r.type != exclude and otype in val.get(r.type, ())]


def _placeable(floor_plan: int) -> list[str]:
    """Small object types of the floor plan that some receptacle type can hold (no sliced ones)."""
    c = _constants()
    val = set().union(*c.VAL_RECEPTACLE_OBJECTS.values())
    types = _floor_plan(floor_plan)[0]
    return sorted(t for t in types if t in val and not t.endswith("Sliced") and t in c.OBJECTS)


def _pick_target(task_type: str, floor_plan: int, receps: list[Thing], rng: random.Random):
    """(object, parent, toggle) types for the task in this floor plan, or None when it has none."""
    c = _constants()
    rtypes = {r.type for r in receps}
    objs = _placeable(floor_plan)
    if task_type == "look_at_obj_in_light":
        lamps = [t for t in LAMPS if t in _floor_plan(floor_plan)[0]]
        holders = [r for r in receps if r.type in _LAMP_HOLDERS]
        objs = [o for o in objs if _holders(receps, o)]
        return (rng.choice(objs), "", rng.choice(lamps)) if lamps and holders and objs else None
    appliance, prop = _APPLIANCE.get(task_type, ("", ""))
    if appliance and appliance not in rtypes:
        return None
    if prop:
        objs = [o for o in objs if o in c.VAL_ACTION_OBJECTS[prop]]
    pairs = []
    for o in objs:
        parents = sorted({r.type for r in _holders(receps, o, exclude=appliance)})
        for p in parents:
            if _holders(receps, o, exclude=p):  # somewhere else to start from
                pairs.append((o, p))
    return (*rng.choice(pairs), "") if pairs else None


def _object_id(otype: str, recep: Thing, rng: random.Random, taken: set[str]) -> str:
    x, y, z = (float(v) for v in recep.id.split("|")[1:4])
    while True:
        oid = f"{otype}|{_coord(x + rng.uniform(-0.4, 0.4))}|{_coord(y + rng.uniform(0.0, 0.3))}|{_coord(z + rng.uniform(-0.4, 0.4))}"
        if oid not in taken:
            taken.add(oid)
            return oid


def sample_scene(split: str, index: int, task_types: Sequence[str], seed: int = 0) -> Scene:
    """The scene of task ``index`` of ``split`` (a pure function of its arguments)."""
    task_type = random.Random(f"alfworld-generated/{seed}/{split}/{index}/type").choice(sorted(task_types))
    for attempt in range(_MAX_ATTEMPTS):  # the task type is fixed; a floor plan without a fitting target is redrawn
        rng = random.Random(f"alfworld-generated/{seed}/{split}/{index}/{attempt}")
        rooms = _constants().GOALS_VALID[task_type]
        plans = [fp for fp in floor_plans(split) if _room(fp) in rooms]
        floor_plan = rng.choice(plans)
        receps = _receptacles(floor_plan, rng)
        target = _pick_target(task_type, floor_plan, receps, rng)
        if target is not None:
            return _populate(split, index, floor_plan, task_type, target, receps, rng)
    raise RuntimeError(f"no alfworld-style {task_type} scene for {split}/{index} in {_MAX_ATTEMPTS} attempts")


def _populate(split, index, floor_plan, task_type, target, receps, rng: random.Random) -> Scene:
    from alfworld.gen.goal_library import gdict

    obj, parent, toggle = target
    taken: set[str] = set()
    objects: list[Thing] = []
    n_target = rng.choice((2, 2, 3)) if task_type == "pick_two_obj_and_place" else rng.choice((1, 1, 2))
    for _ in range(n_target):  # never already in a receptacle of the parent type
        r = rng.choice(_holders(receps, obj, exclude=parent))
        objects.append(Thing(_object_id(obj, r, rng, taken), obj, r.id))
    if toggle:
        r = rng.choice([r for r in receps if r.type in _LAMP_HOLDERS])
        objects.append(Thing(_object_id(toggle, r, rng, taken), toggle, r.id))
    for otype in _placeable(floor_plan):
        holders = _holders(receps, otype)
        if otype == obj or not holders or rng.random() >= _KEEP_TYPE:
            continue
        for _ in range(rng.choice(_COUNTS)):
            r = rng.choice(holders)
            objects.append(Thing(_object_id(otype, r, rng, taken), otype, r.id))
    used = {r.where for r in receps}
    _, _, points = _floor_plan(floor_plan)
    while True:  # the agent starts in the middle of the room, away from every receptacle
        x, z = rng.choice(points)
        start = _loc(x, z, 90 * rng.randrange(4), 30)
        if start not in used:
            break
    template = rng.choice(gdict[task_type]["templates"])
    description = template.format(obj=obj.lower(), recep=parent.lower(), toggle=toggle.lower(), mrecep="")
    return Scene(split, index, floor_plan, task_type, obj, parent, toggle, tuple(receps),
                 tuple(sorted(objects, key=lambda t: t.id)), start, description)
