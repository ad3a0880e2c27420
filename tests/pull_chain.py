"""The order a compiled program's peer pulls are forced into by their operands.

Every device must meet its peers at a program's pulls in one order. XLA's CPU runtime runs ops
in any order their buffers allow, so that order holds only where each pull reads a buffer the
one before it wrote: its status, passed as the pull's ``after`` operand."""

import re

_GTE = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?get-tuple-element\(%?([\w.\-]+)\), index=(\d+)")
_PULL = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?custom-call\(([^)]*)\)")
_STATUS = 2  # the pull's outputs: tensor, digest table, status


def pull_chain(hlo: str) -> list[str]:
    """The names of the program's pulls, first to last, where each reads the status of the one
    before it; AssertionError where they do not form one such chain."""
    gte, pulls = {}, {}
    for line in hlo.splitlines():
        if m := _GTE.match(line):
            gte[m[1]] = (m[2], int(m[3]))
        if 'custom_call_target="pimhbm_peer_pull"' in line:
            m = _PULL.match(line)
            pulls[m[1]] = [op.strip().lstrip("%") for op in m[2].split(",")]
    before = {name: [gte[op][0] for op in ops
                     if op in gte and gte[op][0] in pulls and gte[op][1] == _STATUS]
              for name, ops in pulls.items()}
    firsts = [name for name, prev in before.items() if not prev]
    assert len(firsts) == 1, f"{len(firsts)} of {len(pulls)} pulls follow no other pull"
    after = {prev[0]: name for name, prev in before.items() if prev}
    chain = [firsts[0]]
    while chain[-1] in after:
        chain.append(after[chain[-1]])
    assert len(chain) == len(pulls), f"the chain holds {len(chain)} of {len(pulls)} pulls"
    return chain
