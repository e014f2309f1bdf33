#!/usr/bin/env python3
"""Extracts every ```c block of README.md into its own C file, so that CI compiles them.

Every ```c block of the README carries an HTML comment (invisible once rendered) on the lines
just before its fence (blank lines between are allowed) that says how it compiles:

  <!-- compile: main -->
      A whole program: written out as it is (it includes its own headers and defines `main`).

  <!-- compile: body(PARAMETERS) -->       (or `<!-- compile: body -->` for no parameters)
      A fragment: the body of `int readme_example_NN(PARAMETERS) { ... return 0; }`, after
      <stddef.h>, <stdint.h>, <stdio.h>, <stdlib.h>, <string.h> and <kvstage.h>. PARAMETERS is a
      C parameter list declaring what the fragment uses without defining it (handles, layouts,
      page lists, the engine's own functions as function pointers). The examples compile with
      -Wall -Wextra -Werror: a parameter the fragment does not use is an error too, so the list
      says exactly what the fragment needs. The comment may span several lines.

  <!-- compile: no (REASON) -->            (or `<!-- compile: no: REASON -->`)
      Not compiled, for the reason given (required), e.g. it needs the CUDA driver's header.

A ```c block without such a comment, a comment that is not one of these, or one that is not
followed by a ```c block, is an error naming the README line (exit status 1), so that a new
example cannot silently go unchecked.

Blocks are numbered in README order among all ```c blocks, from 1: block NN becomes
`readme_example_NN.c`. `#line` directives point the compiler's messages at README.md itself.

Usage:
  extract.py --list README.md          print `readme_example_NN <kind>` per compiled block
  extract.py README.md OUTDIR          write OUTDIR/readme_example_NN.c per compiled block
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.*?)[ \t#]*$")
DIRECTIVE = re.compile(r"^compile:[ \t]*(?P<rest>.*)$", re.S)

BODY_INCLUDES = ("stddef.h", "stdint.h", "stdio.h", "stdlib.h", "string.h")


class ReadmeError(Exception):
    pass


@dataclass
class Block:
    index: int  # among all ```c blocks, from 1
    line: int  # README line of the block's first content line (1-based)
    section: str
    kind: str  # main, body or no
    params: str  # body: the parameter list ("" = none)
    reason: str  # no: why
    text: str  # the block's content, the fence's indentation removed

    @property
    def name(self) -> str:
        return f"readme_example_{self.index:02d}"


def _comment_before(lines: List[str], fence_at: int) -> Optional[Tuple[int, str]]:
    """The HTML comment that ends on the last non-blank line before line index `fence_at`:
    (index of its first line, its text between `<!--` and `-->`), or None."""
    i = fence_at - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0 or not lines[i].rstrip().endswith("-->"):
        return None
    end = i
    while i >= 0 and "<!--" not in lines[i]:
        i -= 1
    if i < 0 or end - i > 20:
        return None
    text = " ".join(l.strip() for l in lines[i : end + 1])
    inner = text[text.index("<!--") + 4 : text.rindex("-->")].strip()
    return i, inner


def _directive(comment: str, where: str) -> Tuple[str, str, str]:
    """(kind, params, reason) of a `compile:` comment; ReadmeError when it is malformed."""
    m = DIRECTIVE.match(comment)
    if m is None:
        raise ReadmeError(f"{where}: the ```c block needs a `<!-- compile: main | body(...) | no (reason) -->` comment before it, found `<!-- {comment} -->`")
    rest = m.group("rest").strip()
    if rest == "main":
        return "main", "", ""
    if rest == "body":
        return "body", "", ""
    if rest.startswith("body"):
        params = rest[4:].strip()
        if not (params.startswith("(") and params.endswith(")")):
            raise ReadmeError(f"{where}: `compile: {rest}`: write the parameters as body(TYPE NAME, ...)")
        return "body", params[1:-1].strip(), ""
    if rest == "no" or rest.startswith(("no ", "no:", "no(")):
        reason = rest[2:].strip().lstrip(":").strip()
        if reason.startswith("(") and reason.endswith(")"):
            reason = reason[1:-1].strip()
        if not reason:
            raise ReadmeError(f"{where}: `compile: no` needs a reason: `<!-- compile: no (why) -->`")
        return "no", "", reason
    raise ReadmeError(f"{where}: unknown `compile:` value `{rest}` (main, body(PARAMETERS) or no (REASON))")


def parse(path: str) -> List[Block]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    blocks: List[Block] = []
    claimed = set()  # line indexes of comments that annotate a ```c block
    section = ""
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            h = HEADING.match(lines[i])
            if h is not None:
                section = h.group("title")
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info")
        close = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ReadmeError(f"{path}:{i + 1}: the code block opened here is never closed")
        if info == "c":
            where = f"{path}:{i + 1}"
            found = _comment_before(lines, i)
            if found is None:
                raise ReadmeError(f"{where}: the ```c block needs a `<!-- compile: main | body(...) | no (reason) -->` comment before it")
            claimed.add(found[0])
            kind, params, reason = _directive(found[1], where)
            body = []
            for line in lines[i + 1 : j]:
                if line.strip() and not line.startswith(indent):
                    raise ReadmeError(f"{path}:{i + 2 + len(body)}: a line of the block is indented less than its fence")
                body.append(line[len(indent) :])
            blocks.append(Block(len(blocks) + 1, i + 2, section, kind, params, reason, "\n".join(body) + "\n"))
        i = j + 1
    for k, line in enumerate(lines):
        if k not in claimed and re.search(r"<!--\s*compile:", line):
            raise ReadmeError(f"{path}:{k + 1}: a `compile:` comment that is not right before a ```c block")
    return blocks


def render(block: Block, readme: str) -> str:
    """The C file of a compiled block."""
    head = [
        f"/* Generated by tools/readme/extract.py from {os.path.basename(readme)}, the ```c block at line",
        f"   {block.line - 1} (section \"{block.section}\", `compile: {block.kind}`). Do not edit: edit the README. */",
    ]
    line_directive = f'#line {block.line} "{readme}"'
    if block.kind == "main":
        return "\n".join(head + [line_directive, block.text])
    params = block.params or "void"
    out = head + [f"#include <{h}>" for h in BODY_INCLUDES] + [
        "#include <kvstage.h>",
        "",
        f"int {block.name}({params});",
        f"int {block.name}({params})",
        "{",
        line_directive,
        block.text.rstrip("\n"),
    ]
    tail_start = "\n".join(out).count("\n") + 3  # the number of the line after the #line below
    out += [
        f'#line {tail_start} "{block.name}.c"',
        "    return 0;",
        "}",
        "",
        "/* A program of its own: linking it resolves every kvstage function the fragment calls. */",
        "int main(void) { return 0; }",
        "",
    ]
    return "\n".join(out)


def main(argv: List[str]) -> int:
    args = argv[1:]
    listing = "--list" in args
    args = [a for a in args if a != "--list"]
    if len(args) != (1 if listing else 2):
        print(__doc__.split("Usage:")[1].rstrip(), file=sys.stderr)
        return 2
    readme = os.path.abspath(args[0])
    try:
        blocks = parse(readme)
    except (ReadmeError, OSError) as e:
        print(f"extract.py: {e}", file=sys.stderr)
        return 1
    compiled = [b for b in blocks if b.kind != "no"]
    if listing:
        for b in compiled:
            print(f"{b.name} {b.kind}")
        return 0
    outdir = args[1]
    os.makedirs(outdir, exist_ok=True)
    for b in compiled:
        text = render(b, readme)
        with open(os.path.join(outdir, f"{b.name}.c"), "w", encoding="utf-8") as f:
            f.write(text)
    skipped = [b for b in blocks if b.kind == "no"]
    print(f"extract.py: {len(compiled)} C example(s) of {len(blocks)} written to {outdir}"
          + (f"; not compiled: " + "; ".join(f"block {b.index} (line {b.line - 1}): {b.reason}" for b in skipped) if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
