"""Terminal task families: text processing (grep, sed, awk, sort, uniq, wc, cut, tr, paste, tac).
See :mod:`cope.envs.terminal.tasks` for the task shape."""
from __future__ import annotations

import random

from cope.envs.terminal.task_kit import CITIES, NAMES, WORDS, TerminalTask, answer_is, lines_are, text_of, words

LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")


def _log(rng: random.Random, n: int) -> list[str]:
    return [f"2024-01-{rng.randint(10, 28)} {rng.choice(LEVELS)} {' '.join(words(rng, 3))}" for _ in range(n)]


def count_matches(rng):
    lines = _log(rng, rng.randint(8, 20))
    level = rng.choice(LEVELS)
    return TerminalTask("count_matches", f"Write the number of lines of app.log that contain {level} into answer.txt.",
                        {"app.log": text_of(lines)}, (f"grep -c {level} app.log > answer.txt",),
                        answer_is(str(sum(level in line for line in lines))))


def grep_lines(rng):
    lines = _log(rng, rng.randint(10, 20))
    word = rng.choice(rng.choice(lines).split()[2:])
    out = rng.choice(("matches.txt", "found.txt", "hits.txt"))
    return TerminalTask("grep_lines", f"Write every line of app.log that contains the word {word} into {out}, in "
                        "their original order.", {"app.log": text_of(lines)}, (f"grep {word} app.log > {out}",),
                        lines_are(out, [line for line in lines if word in line]))


def sed_replace(rng):
    old, new = words(rng, 2)
    lines = [f"{k}={rng.choice((old, *words(rng, 2)))}" for k in words(rng, rng.randint(5, 9))]
    lines[rng.randrange(len(lines))] = f"path=/srv/{old}/{old}"
    return TerminalTask("sed_replace", f"In config.txt, replace every occurrence of {old} with {new}, editing the file "
                        "in place.", {"config.txt": text_of(lines)}, (f"sed -i 's/{old}/{new}/g' config.txt",),
                        lines_are("config.txt", [line.replace(old, new) for line in lines]))


def sort_unique(rng):
    pool = rng.sample(NAMES, rng.randint(5, 9))
    lines = [rng.choice(pool) for _ in range(rng.randint(10, 18))]
    return TerminalTask("sort_unique", "Write the distinct lines of names.txt, sorted alphabetically, into sorted.txt.",
                        {"names.txt": text_of(lines)}, ("sort -u names.txt > sorted.txt",),
                        lines_are("sorted.txt", sorted(set(lines))))


def most_frequent(rng):
    pool = words(rng, 5)
    counts = dict(zip(pool, rng.sample(range(1, 9), 5)))
    lines = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(lines)
    best = max(counts, key=counts.get)
    return TerminalTask("most_frequent", "words.txt has one word per line. Write the word that occurs most often into "
                        "answer.txt.", {"words.txt": text_of(lines)},
                        ("sort words.txt | uniq -c | sort -rn | head -n 1 | awk '{print $2}' > answer.txt",),
                        answer_is(best))


def line_count(rng):
    lines = [" ".join(words(rng, rng.randint(1, 4))) for _ in range(rng.randint(5, 40))]
    name = f"{rng.choice(WORDS)}.txt"
    return TerminalTask("line_count", f"Write the number of lines of {name} into answer.txt.", {name: text_of(lines)},
                        (f"wc -l < {name} > answer.txt",), answer_is(str(len(lines))))


def word_count(rng):
    lines = [" ".join(words(rng, rng.randint(1, 6))) for _ in range(rng.randint(3, 10))]
    return TerminalTask("word_count", "Write the number of words in story.txt into answer.txt.",
                        {"story.txt": text_of(lines)}, ("wc -w < story.txt > answer.txt",),
                        answer_is(str(sum(len(line.split()) for line in lines))))


def cut_column(rng):
    rows = [(rng.choice(NAMES), rng.choice(CITIES), str(rng.randint(18, 90))) for _ in range(rng.randint(4, 9))]
    k = rng.randrange(3)
    column = ("name", "city", "age")[k]
    return TerminalTask(
        "cut_column", f"people.csv has the header name,city,age. Write the {column} column (without the header), one "
        f"value per line in the original order, into {column}s.txt.",
        {"people.csv": text_of(["name,city,age", *(",".join(r) for r in rows)])},
        (f"tail -n +2 people.csv | cut -d, -f{k + 1} > {column}s.txt",), lines_are(f"{column}s.txt", [r[k] for r in rows]))


def sum_column(rng):
    rows = [(w, rng.randint(1, 50), rng.randint(1, 9)) for w in words(rng, rng.randint(3, 8))]
    return TerminalTask("sum_column", "sales.csv has the header item,qty,price. Write the sum of the qty column into "
                        "total.txt.", {"sales.csv": text_of(["item,qty,price", *(f"{a},{b},{c}" for a, b, c in rows)])},
                        ("awk -F, 'NR > 1 {s += $2} END {print s}' sales.csv > total.txt",),
                        answer_is(str(sum(r[1] for r in rows)), "total.txt"))


def upper_case(rng):
    lines = [" ".join(words(rng, rng.randint(2, 5))) for _ in range(rng.randint(2, 6))]
    return TerminalTask("upper_case", "Write the contents of in.txt converted to upper case into out.txt.",
                        {"in.txt": text_of(lines)}, ("tr a-z A-Z < in.txt > out.txt",),
                        lines_are("out.txt", [line.upper() for line in lines]))


def line_range(rng):
    lines = [f"{i + 1}. {' '.join(words(rng, 3))}" for i in range(rng.randint(12, 25))]
    a = rng.randint(2, len(lines) - 5)
    b = rng.randint(a + 1, a + 4)
    return TerminalTask("line_range", f"Write lines {a} to {b} (both included, counting from 1) of book.txt into "
                        "excerpt.txt.", {"book.txt": text_of(lines)}, (f"sed -n '{a},{b}p' book.txt > excerpt.txt",),
                        lines_are("excerpt.txt", lines[a - 1:b]))


def reverse_lines(rng):
    lines = words(rng, rng.randint(4, 9))
    return TerminalTask("reverse_lines", "Write the lines of list.txt in reverse order (last line first) into "
                        "reversed.txt.", {"list.txt": text_of(lines)}, ("tac list.txt > reversed.txt",),
                        lines_are("reversed.txt", lines[::-1]))


def filter_numbers(rng):
    nums = [rng.randint(1, 200) for _ in range(rng.randint(6, 15))]
    k = rng.choice(sorted(nums)[1:-1])
    return TerminalTask("filter_numbers", f"nums.txt has one number per line. Write the numbers greater than {k}, in "
                        "their original order, one per line, into big.txt.", {"nums.txt": text_of([str(n) for n in nums])},
                        (f"awk '$1 > {k}' nums.txt > big.txt",), lines_are("big.txt", [str(n) for n in nums if n > k]))


def remove_blank(rng):
    lines = [" ".join(words(rng, 3)) for _ in range(rng.randint(4, 8))]
    padded = []
    for line in lines:
        padded += [line] + [""] * rng.randint(0, 2)
    return TerminalTask("remove_blank", "Delete the empty lines from notes.txt (edit the file in place and keep the "
                        "other lines in order).", {"notes.txt": text_of(padded)}, ("sed -i '/^$/d' notes.txt",),
                        lines_are("notes.txt", lines))


def paste_columns(rng):
    names = rng.sample(NAMES, rng.randint(3, 7))
    ages = [str(rng.randint(18, 90)) for _ in names]
    return TerminalTask("paste_columns", "Combine names.txt and ages.txt line by line into people.txt, each line as "
                        "name,age.", {"names.txt": text_of(names), "ages.txt": text_of(ages)},
                        ("paste -d, names.txt ages.txt > people.txt",),
                        lines_are("people.txt", [f"{n},{a}" for n, a in zip(names, ages)]))


def dedupe_keep_order(rng):
    pool = words(rng, rng.randint(4, 7))
    lines = [rng.choice(pool) for _ in range(rng.randint(8, 16))]
    return TerminalTask("dedupe_keep_order", "Write the lines of items.txt without repeats into unique.txt: keep the "
                        "first occurrence of each line, in the original order.", {"items.txt": text_of(lines)},
                        ("awk '!seen[$0]++' items.txt > unique.txt",), lines_are("unique.txt", list(dict.fromkeys(lines))))


FAMILIES = {f.__name__: f for f in (
    count_matches, grep_lines, sed_replace, sort_unique, most_frequent, line_count, word_count, cut_column, sum_column,
    upper_case, line_range, reverse_lines, filter_numbers, remove_blank, paste_columns, dedupe_keep_order)}
