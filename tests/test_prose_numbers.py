"""No number is typed in the chapters' prose (issue 33): a number a reader sees in a sentence comes
from a glue (computed from records, the estimator or a formula in the chapter), from math, or from
code. Digits left in the prose must be one of ALLOWED: a name (GPT-3, Llama 3.1, NVLink 4, torch
2.1), an index (rank 0, stage 3, Exercise 2), a formula's constant or a definition's (16-bit,
capacity factor 1), a citation's place (section 4.2.3, Table 2). A setting of an example (8 GPUs,
1024 ranks) is glued from the cell that uses it, so that a reader who changes it reads the new one.
"""

from __future__ import annotations

import re

import pytest

from test_book import chapters

# each pattern is blanked out before digits are looked for; what it allows, and why, beside it
ALLOWED = [
    r"\*\*Exercise \d+",  # an exercise's number
    r"^\s*\d+\. ",  # a numbered list's item
    r"\b(?:[Rr]ank|[Ss]tages?|[Nn]ode|[Ss]tep|GPU|[Ee]xpert|[Pp]rocess) \d(?:(?:, | and )\d)*\b",  # an index
    r"^\| \d(?: \(DDP\))? \|", r"\b\d to world size - 1\b",  # ZeRO's stages as a table's rows; ranks' numbering
    r"\bep \d\b", r"\btop-\d\b", r"\b1F1B\b", r"\b[23]D\b", r"\bGen\d\b",  # names of settings and schedules
    r"\b(?:GPT|Llama|LLaMA|T5|Mixtral|DeepSeek|Qwen|PaLM|BERT|ResNet|SmolLM|Gopher)[- ]?\d+(?:\.\d+)?"
    r"(?:[ -]\d+(?:\.\d+)?[BM])?(?:x\d+B)?",  # a model's name: GPT-3, Llama 3.1 8B, T5-3B, Mixtral 8x7B
    r"\b\d+(?:\.\d+)?[BM]\b",  # a published model's size in its name (405B, 1.3B)
    r"\bNVLink \d\b", r"\b(?:torch|PyTorch|Python|CUDA|NCCL) \d+(?:\.\d+)*", r"#\d+",  # versions, issues
    r"\b(?:[Ss]ection|[Tt]able|[Ff]igure|[Ee]quation) \d+(?:\.\d+)*",  # a citation's place
    r"\b\d+-(?:bit|byte)\b", r"\bin (?:8|16|32) bits\b",  # a number format
    r"\b1e-\d\b",  # the tolerance every parity test holds (tests/test_parity.py)
    r"\b6 FLOPs per weight\b", r"\(2 forward, 4 backward\)",  # the compute formula's constants
    r"\(fp32: 0 for SGD, 4 with momentum, 8 for Adam\)", r"\b2 \+ 2 \+ 12 bytes\b",  # the ZeRO paper's counts
    r"\bthe 10 are\b", r"\b16 bytes a parameter\b",  # Korthikanti's and the ZeRO paper's constants
    r"\bcapacity factor \d\b", r"\(1 for an even load\)", r"\bbetween 1 and 2\b", r"\b1/ep\b",  # MoE's
    r"= 0\.01 in Switch",  # the Switch Transformer's coefficient
    r"\blarger than 1\b", r"\bat batch 1 and at batch 2\b",  # a ratio's bound; the trace's two batches
    r"\bstep 0 creates\b", r"\bstep 1 is a steady-state\b",  # the tracked steps' indices
]
ALLOWED_RE = re.compile("|".join(f"(?:{p})" for p in ALLOWED), re.MULTILINE)
DIGITS = re.compile(r"(?<![\w.$/-])\d[\d,.]*")


def paragraphs(text: str):
    """(first line, paragraph) of prose: outside the front matter, code cells and fences, math
    blocks, directives' options and HTML comments."""
    lines, fence, math, para, start = text.splitlines(), None, False, [], 0
    if lines and lines[0] == "---":
        lines = lines[lines.index("---", 1) + 1:] if "---" in lines[1:] else []
        offset = text.splitlines().index("---", 1) + 1
    else:
        offset = 0
    for n, line in enumerate(lines, 1 + offset):
        stripped = line.strip()
        if fence:
            fence = None if stripped.startswith(fence) and stripped.strip("`~") == "" else fence
            continue
        if stripped.startswith(("```", "~~~")):
            if not stripped.startswith(("```{dropdown", "```{admonition", "```{note", "```{margin")):
                fence = stripped[:3]
            continue
        if stripped.startswith("$$"):
            math = not math if stripped.count("$$") == 1 else math
            continue
        if math or stripped.startswith((":::", ":tags:", "<!--", "+++")):
            continue
        if stripped:
            if not para:
                start = n
            para.append(line)
        elif para:
            yield start, "\n".join(para)
            para = []
    if para:
        yield start, "\n".join(para)


def typed_numbers(paragraph: str) -> list[str]:
    text = re.sub(r"\{[a-z:]+\}`[^`]*`", " ", paragraph)  # glue and other roles: computed, cited, linked
    text = re.sub(r"`[^`]*`", " ", text)  # code
    text = re.sub(r"\$[^$]*\$", " ", text)  # math
    text = re.sub(r"\]\([^)]*\)|https?://\S+", " ", text)  # links' targets
    text = ALLOWED_RE.sub(" ", text)
    return DIGITS.findall(text)


@pytest.mark.parametrize("chapter", chapters(), ids=lambda p: p.stem)
def test_no_number_is_typed_in_the_prose(chapter):
    found = [f"{chapter.name}:{n}: {hits} in {para.splitlines()[0][:80]!r}"
             for n, para in paragraphs(chapter.read_text()) if (hits := typed_numbers(para))]
    assert not found, "typed in prose (glue it from the cell that uses it, or allow it in ALLOWED with why):\n" \
        + "\n".join(found)


def test_the_scan_finds_a_typed_number_and_passes_computed_ones():
    """The scan itself: a setting typed in a sentence is found; glue, math, code and names are not."""
    assert typed_numbers("The run trains on 8 GPUs for 3 steps.") == ["8", "3"]
    assert typed_numbers("It takes {glue:text}`t:.1f` s on `--world-size 2`, $2\\Psi$ bytes, on GPT-3 and "
                         "rank 0, in 16-bit floats (section 4.2).") == []
    assert typed_numbers("**Exercise 2 (why).** Stages 1 and 2 send it.") == []
