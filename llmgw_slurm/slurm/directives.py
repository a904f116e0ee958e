"""A batch script's ``#SBATCH`` lines, read as sbatch reads them.

For the backends that submit without sbatch (pyslurm, rest): sbatch reads
these lines itself, the C API and slurmrestd do not, so each of those backends
turns them into its job description. The reading is the same for both, and
kept here: the lines up to the first one that is neither blank nor a comment;
several options on one line; ``--opt=v``, ``--opt v``, ``-p v``, ``-pv``; a
line ``#SBATCH hetjob`` (or ``packjob``) starts the next component of a
heterogeneous job. What an option means is the backend's business; one it
cannot pass on must be refused by it, naming the option (a replica submitted
without its ``--gres`` would run on no GPU).
"""

from __future__ import annotations

import shlex
import signal as _signal
from collections.abc import Callable
from dataclasses import dataclass

from llmgw_slurm.base.errors import SlurmError

# sbatch's one-letter options, for those the backends know.
SHORT = {
    "A": "account", "b": "begin", "C": "constraint", "c": "cpus-per-task", "D": "chdir",
    "d": "dependency", "e": "error", "G": "gpus", "H": "hold", "i": "input", "J": "job-name",
    "L": "licenses", "N": "nodes", "n": "ntasks", "o": "output", "p": "partition", "q": "qos",
    "s": "oversubscribe", "t": "time", "w": "nodelist", "x": "exclude",
}  # fmt: skip

# Options that take no value unless given one with "=" (sbatch's optional arguments).
FLAGS = frozenset({"hold", "requeue", "no-requeue", "exclusive", "oversubscribe", "contiguous"})

_COMPONENT_BREAK = frozenset({"hetjob", "packjob"})


@dataclass(frozen=True)
class Option:
    """One option of an ``#SBATCH`` line: its long name, its value (None for a flag
    given alone), and the words it was written as (for messages)."""

    name: str
    value: str | None
    written: str


def sbatch_tokens(script: str, error: Callable[[str], SlurmError]) -> list[str]:
    """The words of the script's #SBATCH lines, in order, as sbatch reads them:
    up to the first line that is neither blank nor a comment."""
    tokens: list[str] = []
    for line in script.splitlines()[1:]:
        text = line.strip()
        if not text:
            continue
        if not text.startswith("#"):
            break
        if not text.startswith("#SBATCH"):
            continue
        try:
            tokens.extend(shlex.split(text[len("#SBATCH") :]))
        except ValueError as exc:
            raise error(f"cannot read the #SBATCH line {text!r}: {exc}") from exc
    return tokens


def components(
    script: str, valued: frozenset[str], error: Callable[[str], SlurmError]
) -> list[list[Option]]:
    """Each component's options in the order written (one list for a plain job).

    ``valued`` names the options the backend passes on that take a value; with
    :data:`FLAGS`, any other is refused here. ``error`` makes the backend's
    exception from a message (it says which options that backend knows).
    """
    tokens = sbatch_tokens(script, error)
    out: list[list[Option]] = [[]]
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if tok in _COMPONENT_BREAK:
            out.append([])
            continue
        if tok.startswith("--"):
            name, eq, value = tok[2:].partition("=")
            given: str | None = value if eq else None
        elif tok.startswith("-") and len(tok) > 1:
            name = SHORT.get(tok[1], "-" + tok[1])
            given = tok[2:] or None
        else:
            raise error(f"unexpected #SBATCH word {tok!r}")
        if name not in valued and not (name in FLAGS and given is None):
            raise error(f"#SBATCH option {tok!r} is not one it can pass on")
        written = tok
        if given is None and name not in FLAGS:
            if i >= len(tokens):
                raise error(f"#SBATCH option {tok!r} has no value")
            given = tokens[i]
            written = f"{tok} {given}"
            i += 1
        out[-1].append(Option(name, given, written))
    return out


def signal_number(sig: str | int) -> int:
    """``"USR1"``, ``"SIGUSR1"``, ``"10"`` or 10 -> 10: what ``--signal`` and a cancel's
    signal may name, as the number both APIs take."""
    if isinstance(sig, int):
        return sig
    text = sig.strip().upper()
    if text.isdigit():
        return int(text)
    name = text if text.startswith("SIG") else f"SIG{text}"
    try:
        return int(_signal.Signals[name])
    except KeyError as exc:
        raise SlurmError(
            f"unknown signal {sig!r}; use a name such as TERM or USR1, or a number",
            command=["signal"],
        ) from exc
