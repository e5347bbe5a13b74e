"""Rerun the sample outputs of README.md and rewrite them, or (``--check``) report the stale ones.

A sample is a ```` ```text ```` block whose first line is ``$ meshmorph ...``: each ``$`` line is
a command, the lines under it its output. The commands run in this checkout (``src/``), in a
scratch folder where ``examples/`` is the repository's, with their output piped (so tables take
their 100-column form) and stdout and stderr together.

- Run-to-run noise is masked the same way every time (``NOISE``: the planner's CPU time reads
  ``in ... s CPU``).
- A line that is just ``...`` elides any number of output lines, and ``...`` inside a line
  stands for any text: the README's convention for parts left out. Rewriting keeps both where
  they still match and realigns the shown lines to the new output where they do not.
- A block preceded by ``<!-- readme-sample: not regenerated: REASON -->`` is left alone (it
  trains, spawns processes or prints timings); the reason is listed.

    python scripts/readme_samples.py            # rewrite the stale samples of README.md
    python scripts/readme_samples.py --check    # exit 1 and show a diff if any is stale
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ELLIPSIS = "..."
MARKER = re.compile(r"^<!-- readme-sample: (.*?) -->$")
SKIP = "not regenerated:"
NOISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"in \d+(?:\.\d+)? s CPU"), "in ... s CPU"),
)
"""Run-to-run noise of deterministic commands, and the stable text that replaces it."""


@dataclass
class Command:
    """One ``$ meshmorph ...`` line of a sample and the output lines shown under it."""

    text: str
    """The command line after ``$ ``, as written in the README."""
    shown: list[str]
    """The lines under it up to the next command or the end of the block."""


@dataclass
class Sample:
    """A ```` ```text ```` block of the README that starts with ``$ meshmorph``."""

    start: int
    """Index of the block's first line (after the opening fence) in the README's lines."""
    end: int
    """Index of the closing fence."""
    commands: list[Command]
    """The block's commands, in order."""
    skip_reason: str | None = None
    """Why the block is not regenerated (its ``readme-sample`` marker); None: it is."""
    new: list[str] = field(default_factory=list)
    """The block's lines after regeneration (filled by ``regenerate``)."""

    @property
    def title(self) -> str:
        return f"line {self.start}: $ {self.commands[0].text}"


def find_samples(lines: list[str]) -> list[Sample]:
    """Every sample block of the README's ``lines``, with its marker if it has one."""
    samples = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```text":
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = lines[i + 1:end]
        if body and body[0].startswith("$ meshmorph "):
            commands: list[Command] = []
            for line in body:
                if line.startswith("$ "):
                    commands.append(Command(line[2:], []))
                else:
                    commands[-1].shown.append(line)
            marker = MARKER.match(lines[i - 1].strip()) if i > 0 else None
            reason = None
            if marker:
                if not marker.group(1).startswith(SKIP):
                    raise ValueError(f"README line {i}: unknown marker {lines[i - 1]!r}; write "
                                     f"<!-- readme-sample: {SKIP} REASON -->")
                reason = marker.group(1)[len(SKIP):].strip()
            samples.append(Sample(i + 1, end, commands, reason))
        i = end + 1
    return samples


def _line_pattern(shown: str) -> re.Pattern[str]:
    return re.compile(".*?".join(re.escape(part) for part in shown.split(ELLIPSIS)) + r"\Z")


def line_matches(shown: str, out: str) -> bool:
    """``out`` is what ``shown`` says, ``...`` inside ``shown`` standing for any text."""
    return shown == out or (ELLIPSIS in shown and bool(_line_pattern(shown).match(out)))


def matches(shown: list[str], out: list[str]) -> bool:
    """The shown lines are the output, ``...`` lines eliding any number of lines."""
    memo: dict[tuple[int, int], bool] = {}

    def go(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(shown):
                memo[i, j] = j == len(out)
            elif shown[i].strip() == ELLIPSIS:
                memo[i, j] = any(go(i + 1, k) for k in range(j, len(out) + 1))
            else:
                memo[i, j] = j < len(out) and line_matches(shown[i], out[j]) and go(i + 1, j + 1)
        return memo[i, j]

    return go(0, 0)


def _similarity(shown: str, out: str) -> float:
    if line_matches(shown, out):
        return 2.0
    return difflib.SequenceMatcher(None, shown, out, autojunk=False).ratio()


def realign(shown: list[str], out: list[str]) -> list[str]:
    """The sample's new lines: the output itself where nothing is elided; else the same ``...``
    elisions, each run of shown lines replaced by the output lines between the best matches of
    its first and last line (a masked line kept where it still matches)."""
    if matches(shown, out):
        return shown
    if not any(line.strip() == ELLIPSIS for line in shown):
        return out
    runs: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == ELLIPSIS:
            runs.append([])
        else:
            runs[-1].append(line)
    lead, trail = not runs[0], not runs[-1]  # the sample begins / ends with an elision
    runs = [r for r in runs if r]
    n = len(out)
    # best[k][b]: best score of the first k runs placed with the k-th ending before output line b
    NEG = float("-inf")
    best = [[NEG] * (n + 1) for _ in range(len(runs) + 1)]
    choice: dict[tuple[int, int], tuple[int, int]] = {}
    best[0] = [0.0 if (lead or b == 0) else NEG for b in range(n + 1)]
    for k, run in enumerate(runs, start=1):
        prefix = [NEG] * (n + 1)  # prefix[a]: best of best[k-1][<= a] and where
        where = [0] * (n + 1)
        for a in range(n + 1):
            prefix[a], where[a] = (best[k - 1][a], a) if a == 0 or best[k - 1][a] > prefix[a - 1] \
                else (prefix[a - 1], where[a - 1])
        for a in range(n):
            if prefix[a] == NEG or (k == 1 and not lead and a != 0):
                continue
            for b in range(a + 1, n + 1):
                if k == len(runs) and not trail and b != n:
                    continue
                score = prefix[a] + _similarity(run[0], out[a]) + _similarity(run[-1], out[b - 1]) \
                    - 0.01 * abs((b - a) - len(run))
                if score > best[k][b]:
                    best[k][b] = score
                    choice[k, b] = (a, where[a])
    end = max(range(n + 1), key=lambda b: best[len(runs)][b])
    if best[len(runs)][end] == NEG:
        return out
    spans = []
    for k in range(len(runs), 0, -1):
        a, before = choice[k, end]
        spans.append((a, end))
        end = before
    spans.reverse()
    new: list[str] = [ELLIPSIS] if lead else []
    for k, (run, (a, b)) in enumerate(zip(runs, spans, strict=True)):
        if k:
            new.append(ELLIPSIS)
        lines = out[a:b]
        if len(lines) == len(run):
            lines = [s if line_matches(s, o) else o for s, o in zip(run, lines, strict=True)]
        new.extend(lines)
    if trail:
        new.append(ELLIPSIS)
    return new


def mask(text: str) -> list[str]:
    """Output lines with trailing blanks dropped and ``NOISE`` masked."""
    for pattern, stable in NOISE:
        text = pattern.sub(stable, text)
    return [line.rstrip() for line in text.rstrip("\n").split("\n")]


def run_command(text: str) -> str:
    """Output of one README command line (stdout and stderr together), run in this process in a
    scratch folder whose ``examples`` is the repository's."""
    argv = shlex.split(text, comments=True)
    if argv[:1] != ["meshmorph"]:
        raise ValueError(f"not a meshmorph command: {text}")
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from meshmorph.cli.app import main

    buffer = io.StringIO()
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "examples").symlink_to(ROOT / "examples")
        os.chdir(scratch)
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), \
                    contextlib.suppress(SystemExit):  # argparse refusals
                main(argv[1:])
        finally:
            os.chdir(cwd)
    return buffer.getvalue()


def regenerate(sample: Sample, run: Callable[[str], str] = run_command) -> bool:
    """Fill ``sample.new``; True when it differs from the README's block."""
    new: list[str] = []
    old: list[str] = []
    for command in sample.commands:
        new.append(f"$ {command.text}")
        old.append(f"$ {command.text}")
        new.extend(realign(command.shown, mask(run(command.text))))
        old.extend(command.shown)
    sample.new = new
    return new != old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; exit 1 and show a diff where a sample is stale")
    parser.add_argument("--readme", type=Path, default=README, help="the file (default README.md)")
    parser.add_argument("--match", default=None,
                        help="only the samples whose command contains this text")
    args = parser.parse_args(argv)
    lines = args.readme.read_text().split("\n")
    samples = find_samples(lines)
    stale = []
    for sample in samples:
        if args.match and not any(args.match in c.text for c in sample.commands):
            continue
        if sample.skip_reason is not None:
            print(f"not regenerated ({sample.skip_reason}): {sample.title}")
            continue
        if regenerate(sample):
            stale.append(sample)
            old = lines[sample.start:sample.end]
            print(f"stale: {sample.title}")
            sys.stdout.writelines(line + "\n" for line in difflib.unified_diff(
                old, sample.new, "README", "now", lineterm="", n=1))
        else:
            print(f"up to date: {sample.title}")
    if args.check:
        return 1 if stale else 0
    for sample in sorted(stale, key=lambda s: s.start, reverse=True):
        lines[sample.start:sample.end] = sample.new
    if stale:
        args.readme.write_text("\n".join(lines))
        print(f"rewrote {len(stale)} sample(s) in {args.readme.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
