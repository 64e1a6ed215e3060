"""What ScienceWorld's replies mean to the adapter: refusals, ambiguity menus, and the system prompt.

ScienceWorld answers every command with text only; whether the command did anything is read from that
text. Three kinds of reply matter (the strings are the simulator's own, ScienceWorld 1.2.3):

* parse failures (always invalid): ``No known action matches that input.``; ``Unknown action. Type
  'help' ...`` (an answer to a numbered menu that is not one of its numbers); ``I'm not sure what that
  means``;
* no-effect refusals (invalid unless ``no_effect_invalid=False``): the command parsed, but the world
  refused it and nothing changed, e.g. ``The door is already open.``, ``The stove is not moveable.``,
  ``It's not clear how to get there from here.``, ``You can't move something into itself.``. The list
  below was collected from the simulator's action classes; it is checked on one-line replies only, so a
  long description that happens to contain such words is never taken for a refusal;
* ambiguity menus: ``Ambiguous request: Please enter the number for the action you intended (or blank
  to cancel):`` followed by lines ``N:<tab>full command``. The simulator then expects one of those
  numbers as the next command (anything else is answered ``Unknown action ...`` and drops the menu).

Stdlib only.
"""
from __future__ import annotations

import re

MENU_PREFIX = "Ambiguous request:"
_MENU_LINE = re.compile(r"^(\d+):\t(.*)$")
PARSE_FAILURES = ("No known action matches that input", "Unknown action.", "I'm not sure what that means")
NO_EFFECT = re.compile(
    "|".join((
        r"\bis already (?:open|closed|activated|deactivated|connected)\b",
        r"^That is already flushing",
        r"^That object (?:already appears|does not appear) to be in the inventory",
        r"^It'?s not clear how to",  # "It's not clear how to ..." and the simulator's "Its not clear ..."
        r"^I'm not sure how to",
        r"\bis not (?:moveable|movable|openable|closeable|edible|open|a container)\.",
        r"\bis in is not movable\b",
        r"\bisn't open\b",
        r"^You can't\b",
        r"\bcan't be (?:moved|poured|connected|activated)\b",
        r"^The door doesn't appear to go anywhere",
        r"\bis empty, so there's nothing to pour\b",
        r"\bdoes not contain any liquids to dunk into\b",
        r"^Connections must specify specific points",
        r"^You must disconnect entire objects",
        r"\bdoes not appear to produce anything new\b",
        r"^That container is empty, so there are no items to mix",
        r"^There is only one thing \(",
    ))
)

# The simulator's action templates (``getPossibleActions``) minus ``reset task``; OBJ/LOC are object and
# place names as the observations spell them.
_COMMANDS = (
    "look around | look at OBJ | look in OBJ | inventory | task | go to LOC | open OBJ | close OBJ | "
    "pick up OBJ | put down OBJ | move OBJ to OBJ | pour OBJ in OBJ | dunk OBJ in OBJ | mix OBJ | "
    "activate OBJ | deactivate OBJ | use OBJ on OBJ | connect OBJ to OBJ | disconnect OBJ | eat OBJ | "
    "flush OBJ | read OBJ | wait | wait1 | focus on OBJ"
)


def is_parse_failure(text: str) -> bool:
    return text.strip().startswith(PARSE_FAILURES)


def is_no_effect(text: str) -> bool:
    """True for a one-line reply that is one of the known no-effect refusals."""
    s = text.strip()
    return "\n" not in s and bool(NO_EFFECT.search(s))


def parse_menu(text: str) -> list[str] | None:
    """The numbered options of an ambiguity menu (option ``i`` at position ``i``), or None."""
    if not text.startswith(MENU_PREFIX):
        return None
    options = [m.group(2).strip() for m in map(_MENU_LINE.match, text.split("\n")[1:]) if m]
    return options or None


def instructions(teleport: bool, menus: bool) -> str:
    """System prompt: what ScienceWorld is, the command templates, the focus rule, and menu answers."""
    commands = _COMMANDS + (" | teleport to LOC" if teleport else "")
    text = (
        "You are an agent in ScienceWorld, a text simulation of elementary-school science experiments. "
        "Complete the task given in the first message. Each turn, answer with exactly one command on one "
        f"line. Commands: {commands}. Use object names as the game writes them, e.g. 'open door to kitchen', "
        "'pick up thermometer', 'use thermometer in inventory on substance in metal pot'. "
        "'focus on OBJ' tells the game which object the task is about: focusing on a wrong object fails the task."
    )
    if menus:
        text += " When the game lists numbered options for an ambiguous command, answer with the number alone."
    return text
