"""Bounds on hostile or mistaken input, checked before anything runs (used by `harness.planning.cases` and `harness.cli`).

A case file is read with a size limit and its YAML is composed and measured before any Python object is built:
aliases and ``<<`` merges can make a few hundred bytes expand to gigabytes ("billion laughs"), so the expanded
node count, the number of alias references and the nesting depth are bounded.  Run sizes (ranks, schedule
length) are bounded here too, so a case that passes validation cannot exhaust memory or processes later.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import yaml

from ..errors import UsageError

MAX_CASE_BYTES = 1 << 20        # a case file is a few KB; dsv3.yaml is 10 KB
MAX_YAML_NODES = 100_000        # expanded (aliases counted at every use); dsv3.yaml: 625
MAX_YAML_ALIASES = 10_000       # alias references; dsv3.yaml: 62
MAX_YAML_DEPTH = 64             # nesting; PyYAML's recursive composer would hit Python's recursion limit
MAX_EXTENDS = 16                # `extends:` chain length
MAX_WORLD_SIZE = 256            # rank processes of one run (P x EP), all on this machine
MAX_SCHEDULE = 200_000          # P x V x num_microbatches: forward chunk computations per step (dsv3: 512)


def os_reason(err: OSError) -> str:
    """'permission denied', 'no such file or directory', ... (the OS message, lower case, without the path)."""
    return (err.strerror or type(err).__name__).lower()


def printable(value: Optional[str]) -> Optional[str]:
    """Return `value` unchanged if every character is printable (a pydantic validator for names).

    Raises:
        ValueError: a control character (ANSI escapes, newlines, tabs) or another non-printable one (Unicode
            format characters such as U+202E): names reach the terminal, file names and reports.
    """
    if value is not None and not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"{value!r} contains the control or non-printable character {bad!r}; names must be "
                         "printable text")
    return value


def read_case_text(path: Path) -> str:
    """The text of a case file.

    Raises:
        UsageError: missing, a directory, unreadable (naming the OS reason, e.g. permission denied), larger than
            MAX_CASE_BYTES, or not UTF-8.
    """
    try:
        if path.is_dir():
            raise UsageError(f"{path}: is a directory, not a case file")
        if not path.exists():
            raise UsageError(f"{path}: no such case file")
        if not path.is_file():
            raise UsageError(f"{path}: not a regular file (a case file is a YAML text file)")
        with path.open("rb") as f:
            data = f.read(MAX_CASE_BYTES + 1)    # never more, whatever the file's size
    except OSError as e:
        raise UsageError(f"{path}: cannot read the case file: {os_reason(e)}") from None
    if len(data) > MAX_CASE_BYTES:
        raise UsageError(f"{path}: larger than {MAX_CASE_BYTES} bytes; a case file is a few KB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a text (UTF-8) file") from None


def load_yaml(path: Path, text: str, loader_cls: type) -> object:
    """Compose `text`, check its expanded size, then construct it (``yaml.load`` with a check in between).

    Raises:
        yaml.YAMLError: syntax (the caller names the line).
        UsageError: aliases expanding beyond MAX_YAML_NODES nodes or MAX_YAML_ALIASES references, a recursive
            alias, or nesting deeper than MAX_YAML_DEPTH.
    """
    loader = loader_cls(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise UsageError(f"{path}: YAML nested deeper than {MAX_YAML_DEPTH} levels") from None
        if node is None:
            return None
        _check_expansion(path, node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expansion(path: Path, root: yaml.Node) -> None:
    """Post-order walk over the composed graph, each node measured once (linear in the file): size = 1 + the
    sizes of its children, so a node reached through k aliases counts k times, as it would once expanded."""
    size: dict[int, int] = {}
    active: set[int] = set()
    aliases = 0
    stack = [(root, 0, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in _children(node))
            if size[key] > MAX_YAML_NODES:
                raise UsageError(f"{path}: YAML aliases expand to more than {MAX_YAML_NODES} nodes (an alias or "
                                 "'<<' merge bomb?)")
            continue
        if key in active:
            raise UsageError(f"{path}: recursive YAML alias (a node that contains itself)")
        if key in size:              # reached again: an alias (anchors come first in document order)
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise UsageError(f"{path}: more than {MAX_YAML_ALIASES} YAML alias references")
            continue
        if depth > MAX_YAML_DEPTH:
            raise UsageError(f"{path}: YAML nested deeper than {MAX_YAML_DEPTH} levels")
        active.add(key)
        stack.append((node, depth, True))
        stack.extend((k, depth + 1, False) for k in reversed(_children(node)))   # document order


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def compare_to_cycle(refs: Mapping[str, Optional[str]]) -> Optional[list[str]]:
    """The first cycle in variant -> compare_to (None or a name outside `refs`, the baseline, ends a chain), as
    the list of names with the first repeated at the end; None without a cycle.  Linear: each name is walked
    once."""
    ends: set[str] = set()           # names whose chain reaches the baseline
    for start in refs:
        chain: list[str] = []
        n: Optional[str] = start
        while n is not None and n in refs and n not in ends:
            if n in chain:
                return chain[chain.index(n):] + [n]
            chain.append(n)
            n = refs[n]
        ends.update(chain)
    return None


def check_run_size(where: str, pp: int, ep: int, vpp: Optional[int] = None, microbatches: Optional[int] = None) -> None:
    """Bound the rank processes (P x `ep`: the larger of EP and TP x DP) and, given V and M, the schedule length (P x V x M).

    Raises:
        UsageError: one line prefixed by `where`, naming the keys, their product and the limit.
    """
    if pp * ep > MAX_WORLD_SIZE:
        raise UsageError(f"{where}: pipeline_model_parallel_size x max(expert_model_parallel_size, "
                         f"tensor_model_parallel_size x data_parallel_size) = {pp} x {ep} = {pp * ep} ranks; at most {MAX_WORLD_SIZE} rank "
                         "processes run on one machine")
    if vpp is not None and microbatches is not None and pp * vpp * microbatches > MAX_SCHEDULE:
        raise UsageError(f"{where}: pipeline_model_parallel_size x virtual stages x num_microbatches = {pp} x {vpp} "
                         f"x {microbatches} = {pp * vpp * microbatches} chunk computations per step; at most "
                         f"{MAX_SCHEDULE}")
