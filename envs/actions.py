"""Action text clean-up shared by the env adapters: tolerant of the usual model noise, strict otherwise.

A policy's action is the decoded text of the ids it sampled. Models add noise around an otherwise
good command: surrounding whitespace, surrounding quotes or backticks, a trailing period, a leading
``Action:`` label, runs of inner spaces (in one-line actions; multi-line ones keep their indentation).
:func:`clean_action` removes exactly that and nothing else;
each env then decides validity on the cleaned text with its own grammar. Anything still wrong after
clean-up (two commands on two lines, prose, an empty string) is the env's "malformed" case: the
action is invalid and the adapter says so in *harness* text (never an ECHO target).

Stdlib only, like every env module.
"""
from __future__ import annotations

import re

_QUOTES = "\"'`"
_LABEL = re.compile(r"^(?:action|command|act)\s*:\s*", re.IGNORECASE)
_SPACES = re.compile(r"[ \t]+")
HARNESS_UNENCODABLE = "Invalid action: it is not encodable text ({}); nothing was done."


def clean_action(text: str, *, lower: bool = False, keep_period: bool = False) -> str:
    """Strip whitespace, one layer of matching quotes/backticks (also a ```` ``` ```` fence), an
    ``Action:`` label, a trailing period (unless ``keep_period``) and collapse inner runs of spaces
    (one-line actions only: multi-line code keeps its indentation, minus trailing spaces).
    Newlines inside the action are kept, so a multi-line answer stays visibly multi-line for the env
    to refuse (or, for code/shell envs, to run). ``lower`` lower-cases the result.

    >>> clean_action('  "Open the door."  ')
    'Open the door'
    >>> clean_action("Action: go north")
    'go north'
    """
    s = text.strip()
    if s.startswith("```") and s.endswith("```") and len(s) >= 6:
        s = s[3:-3]
        first, _, rest = s.partition("\n")
        if rest and re.fullmatch(r"[A-Za-z0-9_+-]*", first.strip()):  # a language tag line: ```bash
            s = rest
        s = s.strip()
    s = _LABEL.sub("", s, count=1).strip()
    for _ in range(2):  # '"go north".' and "'go north.'" both clean to go north
        if len(s) >= 2 and s[0] in _QUOTES and s[-1] == s[0]:
            s = s[1:-1].strip()
        if not keep_period and s.endswith(".") and not s.endswith(".."):
            s = s[:-1].rstrip()
    if "\n" in s:  # a script or code: keep indentation, drop trailing spaces only
        s = "\n".join(line.rstrip() for line in s.split("\n"))
    else:
        s = _SPACES.sub(" ", s)
    return s.lower() if lower else s


def unencodable(text: str) -> str | None:
    """The harness notice for an action that is not encodable text, else None.

    A byte-level tokenizer can decode sampled ids to an unpaired surrogate (U+D800-U+DFFF), which has no
    UTF-8 bytes: whatever carries the action to an engine (py4j, a subprocess argument, a C string, a
    JSON request) then raises, and the episode would abort on the model's typo. Every env asks this
    first in ``step`` and refuses such an action as invalid (``valid=False``, this notice as *harness*),
    before parsing it and without touching its engine. Strict UTF-8, not ``os.fsencode``: that one
    passes U+DC80-U+DCFF as raw bytes (``north\\udcff`` would run as ``north\\xff``).

    >>> unencodable("go north") is None
    True
    >>> unencodable("north\\udcff")
    'Invalid action: it is not encodable text (an unpaired surrogate, U+DCFF, at character 5); nothing was done.'
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return HARNESS_UNENCODABLE.format(f"an unpaired surrogate, U+{ord(text[e.start]):04X}, at character {e.start}")
    return None


def single_line(text: str, **kw) -> str | None:
    """:func:`clean_action`, or None when the result is empty or spans several lines (malformed
    for envs whose actions are one command)."""
    s = clean_action(text, **kw)
    return s if s and "\n" not in s else None


# ---------------------------------------------------------------------------------------------
# Action projection (``env.action_parsing=project``): a real instruct model answers in prose at first
# ("The goal is 3 south, ..."), which strict parsing refuses, so every reward is 0 and GRPO has no
# signal. Projection extracts the env's action from free text, the way verl-agent's per-env
# projection functions do, and the env flags the step (``info["projected"]``) so it is counted
# (``rollout/projected_actions``) and consumers that want strictly formatted actions can skip it.
# The training tokens stay the policy's own samples; only the env's reading of them changes.

ACTION_PARSING = ("strict", "project")


def check_action_parsing(mode: str) -> str:
    if mode not in ACTION_PARSING:
        raise ValueError(f"action_parsing must be one of {ACTION_PARSING}, got {mode!r}")
    return mode


def first_word(text: str, words) -> str | None:
    """The first of ``words`` (single words, matched whole and case-insensitively) in ``text``,
    lower-cased, or None. ``first_word("Here it is: North, South,", DIRS) == "north"``."""
    pattern = r"\b(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b"
    m = re.search(pattern, text, re.IGNORECASE)
    return m.group(1).lower() if m else None


def match_admissible(text: str, admissible) -> str | None:
    """The admissible action that occurs first in ``text`` (whole words, case and runs of spaces
    ignored; the longest one when several start at the same place), returned as the env spells
    it, or None. For envs that list their admissible actions: ``match_admissible("I will open the
    fridge now", ["open fridge", "open the fridge"]) == "open the fridge"``."""
    hay = _SPACES.sub(" ", text.lower())
    best: tuple[int, int, str] | None = None
    for a in admissible or []:
        needle = _SPACES.sub(" ", a.strip().lower())
        if not needle:
            continue
        m = re.search(r"(?<!\w)" + re.escape(needle) + r"(?!\w)", hay)
        if m and (best is None or (m.start(), -len(needle)) < (best[0], best[1])):
            best = (m.start(), -len(needle), a)
    return best[2] if best else None
