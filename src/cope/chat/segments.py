"""One turn of scaffold and env text as ids that equal the tokenizer's ids of the whole rendered text.

Why: tokenizing each piece on its own is exact only where the tokenizer never merges across the cut. Chat templates
cut at special tokens (``<|im_end|>``, ``<|eot_id|>``, ``[/INST]``), where nothing merges; but tool templates also put
plain text right after the env's text (Qwen: ``RESULT\\n</tool_response>``; a system prompt followed by
``\\n\\n# Tools``), and the pre-tokenizers of Qwen2, Llama 3 and Mistral's Tekken glue punctuation to the newlines that
follow it (``]\\n`` is one pre-token): the template's ids then differ from the pieces' ids, the classic
re-tokenization drift of multi-turn tool training.

:func:`encode_segments` tokenizes each maximal run of plain text *across* the cuts, in one call, and gives every
token the role of the segment its first character is in (a token straddling a cut, ``]\\n``, belongs to the env text
where it starts). Added tokens in scaffold text (special or not) are cut out first and kept as their ids, as the
tokenizer's own added-token split does; env text is tokenized with ``split_special_tokens=True``, so an env still
cannot write a scaffold token (there, and only there, the ids differ from rendering the text through the template,
on purpose). Used for native-tool episodes (:mod:`cope.rollout.loop`); text-format episodes keep tokenizing pieces on
their own, as before.
"""
from __future__ import annotations

import re
from typing import NamedTuple


class Segment(NamedTuple):
    text: str
    role: int
    scaffold: bool  # template text (its added tokens are tokens); else env text (special strings split)


_PATTERNS: dict[int, tuple[re.Pattern | None, dict[str, int]]] = {}


def _added(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    key = id(tokenizer)
    if key not in _PATTERNS:
        vocab = dict(tokenizer.get_added_vocab())
        names = sorted(vocab, key=len, reverse=True)
        _PATTERNS[key] = (re.compile("|".join(map(re.escape, names))) if names else None, vocab)
    return _PATTERNS[key]


def encode_segments(tokenizer, segments: list[Segment]) -> tuple[list[int], list[int]]:
    """``(ids, roles)`` of the segments' concatenated text (see the module doc)."""
    pattern, vocab = _added(tokenizer)
    pieces: list[tuple[str, int, int | None]] = []  # (text, role, id of an added token or None)
    for text, role, scaffold in segments:
        pos = 0
        if scaffold and pattern is not None:
            for m in pattern.finditer(text):
                if m.start() > pos:
                    pieces.append((text[pos:m.start()], role, None))
                pieces.append((m.group(), role, vocab[m.group()]))
                pos = m.end()
        if text[pos:]:
            pieces.append((text[pos:], role, None))
    ids: list[int] = []
    roles: list[int] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if not run:
            return
        text = "".join(t for t, _ in run)
        bounds, at = [], 0
        for t, r in run:
            bounds.append((at + len(t), r))
            at += len(t)
        enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
        for tid, (start, _end) in zip(enc["input_ids"], enc["offset_mapping"]):
            ids.append(tid)
            roles.append(next(r for b, r in bounds if start < b) if start < at else bounds[-1][1])
        run.clear()

    for text, role, added in pieces:
        if added is None:
            run.append((text, role))
            continue
        flush()
        ids.append(added)
        roles.append(role)
    flush()
    return ids, roles


def decode(tokenizer, ids) -> str:
    """Text of ``ids`` with special tokens kept (scaffold pieces cut from a template decode back to their text)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
