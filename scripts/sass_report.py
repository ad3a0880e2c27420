#!/usr/bin/env python3
"""Reports the shape of a kernel's inner loop from its SASS (cuobjdump --dump-sass).

For each kernel whose name matches a pattern: finds the loops (backward branches), takes the
innermost loop that holds 128-bit global loads (the streaming loop), and prints its size, its
branches (the back-edge is one of them), predicated instructions and loads. With --classes,
also the loop's instructions by the pipe that issues them (integer, float, memory, control) and
its most frequent opcodes: an instruction budget a chunk, to set against the loop's elements.
With --common-path, also the instructions one trip issues on the common path: a conditional
branch is taken where it steps over a CALL (the IEEE division's and square root's slow paths) or
an atomic (counts and stash slots of damage found), or follows a VOTE (a warp's rare case), and
not taken otherwise (a branch some lanes take still issues what it skips for the others).

usage: sass_report.py BINARY [NAME_REGEX] [--arch sm_90] [--classes] [--common-path]
BINARY: an executable, a shared library or a .cubin (`nvcc -cubin -arch=sm_90 ...`). Where the
CUDA toolkit has no cuobjdump, PyPI's `nvidia-cuda-cuobjdump` wheel carries one (bin/).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def dump(binary: str, arch: str) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        sys.exit("sass_report: cuobjdump not found on PATH")
    out = subprocess.run([tool, "--dump-sass", "--gpu-architecture", arch, binary],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"sass_report: cuobjdump failed: {out.stderr.strip()}")
    return out.stdout


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    funcs: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        if "Function :" in line:
            current = line.split("Function :", 1)[1].strip()
            funcs[current] = []
        elif current and (m := LINE.search(line)):
            funcs[current].append((int(m.group(1), 16), m.group(2)))
    return funcs


def streaming_loop(code: list[tuple[int, str]]):
    """The kernel's own streaming loop: the first innermost loop that holds 128-bit global
    loads (non-inlined device functions come after the kernel body and are not taken)."""
    loops = []
    for addr, ins in code:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    body = lambda lo, hi: [ins for a, ins in code if lo <= a <= hi]
    streaming = [(lo, hi) for lo, hi in loops
                 if any("LDG" in i and ".128" in i for i in body(lo, hi))]
    innermost = [(lo, hi) for lo, hi in streaming
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in streaming)]
    if not innermost:
        return None
    lo, hi = min(innermost)
    return [(a, ins) for a, ins in code if lo <= a <= hi]


def skips_rare_work(loop: list[tuple[int, str]], k: int, target: int) -> bool:
    """Whether the forward branch loop[k] steps over a call (an IEEE slow path) or an atomic (a
    count or stash slot taken only when something was found) -- and not over the loop's own
    128-bit loads and stores (a branch around the whole update is not a rare path)."""
    skipped = [ins for a, ins in loop[k + 1:] if a < target]
    rare = any(re.search(r"\b(CALL|ATOMG?|REDG?)\b", ins) for ins in skipped)
    return rare and not any(re.search(r"\b(LDG|STG)\b.*\.128", ins) for ins in skipped)


def common_path(loop: list[tuple[int, str]]) -> list[str]:
    """One trip through the loop on its common path (see the module's doc)."""
    at = {a: k for k, (a, _) in enumerate(loop)}
    path, k = [], 0
    while k < len(loop) and len(path) <= 4 * len(loop):
        addr, ins = loop[k]
        path.append(ins)
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
        if k == len(loop) - 1 or m is None or int(m.group(1), 16) not in at:
            k += 1
            continue
        target = int(m.group(1), 16)
        taken = (not ins.startswith("@") or "VOTE" in loop[k - 1][1] or
                 (target > addr and skips_rare_work(loop, k, target)))
        k = at[target] if taken else k + 1
    return path


# The issuing pipe of an opcode's root (the part before the first dot).
CLASSES = {
    "float": ("FADD", "FMUL", "FFMA", "FSEL", "FSETP", "FMNMX", "FCHK", "MUFU", "HADD2", "HMUL2",
              "HFMA2", "F2F", "F2I", "I2F", "FRND"),
    "memory": ("LDG", "STG", "LDS", "STS", "LDL", "STL", "LDC", "ULDC", "LDGSTS", "ATOM", "ATOMG",
               "RED", "REDG"),
    "control": ("BRA", "BSSY", "BSYNC", "CALL", "RET", "EXIT", "WARPSYNC", "BAR", "SHFL", "VOTE",
                "VOTEU", "ENDCOLLECTIVE", "NOP", "REDUX", "MATCH"),
}


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def classes(loop: list[str]) -> str:
    """The loop's instructions by issuing pipe (integer: the rest), then its top opcodes."""
    roots = [opcode(i).split(".")[0] for i in loop]
    count = {c: sum(r in names for r in roots) for c, names in CLASSES.items()}
    count = {"integer": len(roots) - sum(count.values()), **count}
    top: dict[str, int] = {}
    for i in loop:
        top[opcode(i)] = top.get(opcode(i), 0) + 1
    common = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return ("  by pipe: " + ", ".join(f"{c} {n}" for c, n in count.items()) +
            "\n  most frequent: " + ", ".join(f"{op} {n}" for op, n in common))


def demangle(name: str) -> str:
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if tool is None:
        return name
    return subprocess.run([tool, name], capture_output=True, text=True).stdout.strip() or name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("pattern", nargs="?", default="scan_kernel")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--classes", action="store_true",
                    help="also the loop's instructions by issuing pipe and its top opcodes")
    ap.add_argument("--common-path", action="store_true",
                    help="also the instructions one trip issues on its common path")
    args = ap.parse_args()
    funcs = functions(dump(args.binary, args.arch))
    rows = 0
    for name, code in sorted(funcs.items()):
        pretty = re.sub(r"[\w:]*\(anonymous namespace\)::", "", demangle(name))
        if not re.search(args.pattern, pretty):
            continue
        located = streaming_loop(code)
        if located is None:
            continue
        loop = [ins for _, ins in located]
        branches = [i for i in loop if re.search(r"\bBRA\b", i)]
        predicated = [i for i in loop if i.startswith("@")]
        loads = [i for i in loop if "LDG" in i]
        local = [i for i in loop if re.search(r"\b(LDL|STL)\b", i)]
        print(f"{pretty.split('(')[0]}\n  inner loop: {len(loop)} instructions, {len(branches)} "
              f"branch (back-edge included), {len(predicated)} predicated, {len(loads)} loads "
              f"({sum('.128' in l for l in loads)} x 128-bit), {len(local)} local-memory accesses")
        if args.classes:
            print(classes(loop))
        if args.common_path:
            path = common_path(located)
            print(f"  common path: {len(path)} instructions a trip")
            if args.classes:
                print(classes(path))
        rows += 1
    if rows == 0:
        print(f"sass_report: no kernel matching {args.pattern!r} with a streaming loop")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
