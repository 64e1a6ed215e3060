"""Grid maze: the built-in, model-free sanity environment.

In spirit this follows the small "grid maze" sanity experiment of the ECHO authors (6x6, 7x7 and 8x8
grids): an agent walks a walled grid one cell per turn until it stands on the goal. It deliberately
differs in its text: every observation names the goal's offset and the open moves, in a small, fixed,
templated vocabulary, so that a tiny transformer with a locally trained tokenizer can learn from it.

Each task index maps to one layout, deterministically: the side length and the layout come from
``random.Random`` seeded with strings that contain the split name, so train and test seed spaces are
disjoint, and a layout is regenerated (a counter in the seed) until the goal is reachable from the start
within ``min_distance..max_steps`` moves (BFS).

Observations (rows grow to the south, columns to the east; directions always listed in the fixed order
north, south, east, west; zero components omitted)::

    reset:    "Find the goal in a 6x6 maze.\\nGoal: 2 south, 1 east. Closer: south. Open: north, south, west."
    move:     "Goal: 2 south, 1 east. Closer: south. Open: north, south, west."
    bump:     "Wall. Goal: 2 south, 1 east. Closer: south. Open: north, south, west."
    success:  "You reached the goal."

``Closer:`` (the compass, on by default; ``compass=False`` drops it) lists the open moves that shorten
the goal offset, ``none`` when no open move does. It keeps the decision local and in words, the way a
text game says "you hear water to the south": a policy that takes a random ``Closer`` move (a random
open move when there is none) solves about 80% of the mazes, uniformly random open moves about 15%.
The default warm start of the tiny model imitates random walks, so it has to *learn* from reward to prefer
that list; :meth:`MazeEnv.expert_action` (a shortest path's next move) drives its ``expert`` warm start.

Validity rules: the parser accepts exactly ``north``, ``south``, ``east``, ``west``, tolerating only
surrounding whitespace, surrounding quotes or backticks, a trailing period, letter case and a leading
``go ``. A parsable move into a wall or off the grid is invalid; the agent stays and the world answers
(``Wall. ...``). Anything else is malformed: invalid, empty observation, and a harness warning (adapter
text, never an ECHO target); text that is not encodable (`cope.envs.actions.unencodable`) gets that
function's notice instead and is never projected. Every action counts towards ``max_steps``; reaching
the goal pays 1.0.

``action_parsing="project"`` (off by default; for real instruct models that answer in prose at first,
see docs/models.md): an action that strict parsing refuses is read as the first direction word in it
(``"The goal is 3 south, ..."`` -> south, ``"Here it is: North, South,"`` -> north; case-insensitive,
whole words). The move is then made like a strict one (a wall is still a wall), the step carries
``info["projected"] = True`` and a harness note says how the answer was read. Text with no direction
word stays malformed.
"""
from __future__ import annotations

import copy
import random
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from cope.envs.actions import check_action_parsing, first_word, unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv

DIRECTIONS: dict[str, tuple[int, int]] = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}
INSTRUCTIONS = (
    "You are in a grid maze. Reach the goal. "
    "Each turn, answer with exactly one word: north, south, east or west."
)
HARNESS_INVALID = "Invalid action. Answer with one of: north, south, east, west."
SUCCESS_TEXT = "You reached the goal."
HARNESS_PROJECTED = "Read as: {move}. Answer with one word."
_ACTION_RE = re.compile(r"""["'`]*(?:go\s+)?(north|south|east|west)\.?["'`]*\.?""", re.IGNORECASE)
_MAX_ATTEMPTS = 1000

Cell = tuple[int, int]  # (row, col)


def parse_action(action: str) -> str | None:
    """Returns the direction named by ``action``, or None when it is malformed."""
    match = _ACTION_RE.fullmatch(action.strip())
    return match.group(1).lower() if match else None


def project_action(action: str) -> str | None:
    """The first direction word in free text (``action_parsing="project"``), or None."""
    return first_word(action, DIRECTIONS)


@dataclass(frozen=True)
class MazeLayout:
    """One concrete maze: a ``size`` x ``size`` grid with walls, a start and a goal."""

    size: int
    walls: frozenset[Cell]
    start: Cell
    goal: Cell

    def is_open(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and cell not in self.walls

    def open_moves(self, cell: Cell) -> list[str]:
        """Directions (in the fixed order) that lead from ``cell`` to an open cell."""
        return [d for d, (dr, dc) in DIRECTIONS.items() if self.is_open((cell[0] + dr, cell[1] + dc))]

    def distances_to_goal(self) -> dict[Cell, int]:
        """BFS distance to the goal for every cell connected to it."""
        dist = {self.goal: 0}
        queue = deque([self.goal])
        while queue:
            cell = queue.popleft()
            for dr, dc in DIRECTIONS.values():
                nxt = (cell[0] + dr, cell[1] + dc)
                if nxt not in dist and self.is_open(nxt):
                    dist[nxt] = dist[cell] + 1
                    queue.append(nxt)
        return dist


class MazeEnv(TaskEnv):
    """Seeded grid mazes behind the `cope.envs.base.Env` protocol; one episode at a time.

    Args:
        sizes: Grid side lengths; each task picks one by its seed.
        wall_density: Fraction of the grid's cells that are walls, in [0, 0.5].
        max_steps: Actions per episode before a timeout; also the longest allowed shortest path.
        min_distance: Smallest shortest-path distance from start to goal.
        num_train_tasks: Number of tasks in the train split.
        num_test_tasks: Number of tasks in the test split.
        name: Env name used in task ids.
        compass: Show ``Closer: ...`` (the open moves toward the goal).
        action_parsing: ``strict`` (the format above only) or ``project`` (read the first direction
            word of a refused answer; flagged in ``info["projected"]``).
    """

    def __init__(
        self,
        sizes: Sequence[int] = (6, 7, 8),
        wall_density: float = 0.25,
        max_steps: int = 20,
        min_distance: int = 3,
        num_train_tasks: int = 100_000,
        num_test_tasks: int = 1_000,
        name: str = "maze",
        compass: bool = True,
        action_parsing: str = "strict",
    ) -> None:
        self.compass = bool(compass)
        self.action_parsing = check_action_parsing(action_parsing)
        sizes = tuple(sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 2 for s in sizes):
            raise ValueError(f"sizes must be a non-empty sequence of ints >= 2, got {sizes!r}")
        if not 0.0 <= wall_density <= 0.5:
            raise ValueError(f"wall_density must be in [0, 0.5], got {wall_density!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        if not 1 <= min_distance <= min(max_steps, 2 * (min(sizes) - 1)):
            raise ValueError(
                f"min_distance must be in [1, min(max_steps, 2 * (min(sizes) - 1))], got {min_distance!r}"
            )
        if num_train_tasks < 1:
            raise ValueError(f"num_train_tasks must be >= 1, got {num_train_tasks!r}")
        if num_test_tasks < 1:
            raise ValueError(f"num_test_tasks must be >= 1, got {num_test_tasks!r}")
        if not name:
            raise ValueError("name must be a non-empty string")
        self.sizes = sizes
        self.wall_density = float(wall_density)
        self.max_steps = max_steps
        self.min_distance = min_distance
        self.name = name
        self._num_tasks = {"train": num_train_tasks, "test": num_test_tasks}
        self._layout: MazeLayout | None = None
        self._dist: dict[Cell, int] = {}
        self._pos: Cell = (0, 0)

    @property
    def instructions(self) -> str:
        return INSTRUCTIONS

    def generate(self, split: str, index: int) -> MazeLayout:
        """The layout of task ``index`` of ``split``; the same task always gives the same layout."""
        self.check_index(split, index)
        # String seeds are hashed with SHA-512 by `random`, so they are stable across processes.
        size = random.Random(f"maze-size/{split}/{index}").choice(self.sizes)
        cells = [(r, c) for r in range(size) for c in range(size)]
        num_walls = min(round(self.wall_density * size * size), size * size - 2)
        for attempt in range(_MAX_ATTEMPTS):
            rng = random.Random(f"maze/{split}/{index}/{size}/{attempt}")
            start, goal = rng.sample(cells, 2)
            rest = [cell for cell in cells if cell not in (start, goal)]
            layout = MazeLayout(size, frozenset(rng.sample(rest, num_walls)), start, goal)
            distance = layout.distances_to_goal().get(start)
            if distance is not None and self.min_distance <= distance <= self.max_steps:
                return layout
        raise RuntimeError(f"no valid {size}x{size} layout for task {split}/{index} in {_MAX_ATTEMPTS} tries")

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self._layout = self.generate(task.split, task.index)
        self._dist = self._layout.distances_to_goal()
        self._pos = self._layout.start
        self._episode_started()
        size = self._layout.size
        statement = f"Find the goal in a {size}x{size} maze."
        return EnvReset(
            observation=f"{statement}\n{self._status()}",
            task_description=statement,
            admissible_actions=self._layout.open_moves(self._pos),
            info={"size": size, "distance": self._dist[self._pos]},
        )

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)
        move = None if refused else parse_action(action)
        harness, projected = "", False
        if move is None and not refused and self.action_parsing == "project":
            move = project_action(action)
            projected = move is not None
            harness = HARNESS_PROJECTED.format(move=move) if projected else ""
        if move is None:
            valid, observation, harness = False, "", refused or HARNESS_INVALID
        else:
            dr, dc = DIRECTIONS[move]
            target = (self._pos[0] + dr, self._pos[1] + dc)
            valid = self._layout.is_open(target)
            if valid:
                self._pos = target
            observation = self._status() if valid else f"Wall. {self._status()}"
        success = self._pos == self._layout.goal
        timeout = self._step_ended(success)
        return EnvStep(
            observation=SUCCESS_TEXT if success else observation,
            reward=1.0 if success else 0.0,
            done=self.episode_over,
            valid=valid,
            success=success,
            score=1.0 if success else 0.0,
            harness=harness,
            admissible_actions=self._layout.open_moves(self._pos),
            info={"timeout": timeout, "projected": projected},
        )

    def close(self) -> None:
        pass

    # The optional fork capability (cope.train.collect.branching): a branched rollout continues a copy of this state.
    forks_by_replay = True  # deterministic: a fresh instance replaying an episode's actions says the same things

    def fork(self) -> MazeEnv:
        """An independent copy of this instance with its episode where it is now (a deep copy: layout, position,
        distances, step count): stepping one never changes the other."""
        return copy.deepcopy(self)

    def shortest_path(self) -> list[str]:
        """Moves of one shortest path from the current position to the goal (tests/benchmarks only)."""
        self._require_episode("shortest_path")
        path, (r, c) = [], self._pos
        while (r, c) != self._layout.goal:
            for d, (dr, dc) in DIRECTIONS.items():
                if self._dist.get((r + dr, c + dc), -1) == self._dist[(r, c)] - 1:
                    path.append(d)
                    r, c = r + dr, c + dc
                    break
        return path

    def expert_action(self) -> str | None:
        """The next move of a shortest path from the current position (one of the admissible actions, spelled
        as they are), or None when the episode is over or the goal cannot be reached from here. Ties go to
        the first direction in the fixed order (north, south, east, west). Demonstrations only (the tiny
        model's expert warm start, tests); the agent never sees it."""
        self._require_episode("expert_action")
        if self.episode_over or self._pos == self._layout.goal or self._pos not in self._dist:
            return None
        return self.shortest_path()[0]

    def render(self) -> str:
        """ASCII grid: ``#`` wall, ``.`` open, ``A`` agent, ``G`` goal (tests/benchmarks only)."""
        self._require_episode("render")
        lay = self._layout
        glyph = {**{w: "#" for w in lay.walls}, lay.goal: "G", self._pos: "A"}
        return "\n".join("".join(glyph.get((r, c), ".") for c in range(lay.size)) for r in range(lay.size))

    def _status(self) -> str:
        """``Goal: <offset>. [Closer: <moves>. ]Open: <moves>.`` for the current position."""
        dr = self._layout.goal[0] - self._pos[0]
        dc = self._layout.goal[1] - self._pos[1]
        parts = [f"{abs(dr)} {'south' if dr > 0 else 'north'}"] if dr else []
        parts += [f"{abs(dc)} {'east' if dc > 0 else 'west'}"] if dc else []
        moves = self._layout.open_moves(self._pos)
        open_moves = ", ".join(moves) or "none"
        if not self.compass:
            return f"Goal: {', '.join(parts)}. Open: {open_moves}."
        goalward = {"south" if dr > 0 else "north"} if dr else set()
        goalward |= {"east" if dc > 0 else "west"} if dc else set()
        closer = ", ".join(m for m in moves if m in goalward) or "none"
        return f"Goal: {', '.join(parts)}. Closer: {closer}. Open: {open_moves}."
