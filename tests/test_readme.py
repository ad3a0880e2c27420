"""The README as a user reads it: every pimhbm.<name> it spells resolves after a plain
`import pimhbm`, the keywords of the calls it writes exist, its Python blocks run, and every
`pimhbm` command and option it names is one the command accepts."""

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import pimhbm_cli as cli

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PROSE = FENCE.sub("", README)


def python_blocks() -> list[str]:
    return [body for lang, body in FENCE.findall(README) if lang == "python"]


def spans() -> list[re.Match]:
    """The inline code of the prose, in order (a span may run over a line break)."""
    return list(re.finditer(r"`([^`]+)`", PROSE))


def library_paths() -> list[str]:
    """Every dotted pimhbm path the README spells, and the names it lists beside one
    (`pimhbm.scan`, `verify`, `scan_tree`: pimhbm.verify, pimhbm.scan_tree)."""
    text = PROSE + "".join(python_blocks())
    paths = {p.rstrip(".") for p in re.findall(r"\bpimhbm(?:\.\w+)+\.?", text)}
    found = spans()
    parent = None
    for prev, span in zip([None] + found, found):
        name = span.group(1)
        if re.fullmatch(r"pimhbm(\.\w+)+", name):
            parent = name.rsplit(".", 1)[0]
        elif (parent and re.fullmatch(r"\w+", name)
              and re.fullmatch(r"\s*[,/]\s*", PROSE[prev.end():span.start()])):
            paths.add(f"{parent}.{name}")
        else:
            parent = None
    return sorted(paths)


def test_every_library_name_of_the_readme_resolves_after_a_plain_import():
    paths = library_paths()
    # The extraction itself finds what the README is about (an empty list would pass).
    assert {"pimhbm.adamw", "pimhbm.update.adamw", "pimhbm.recovery.Trainer",
            "pimhbm.train.llama_trainer", "pimhbm.guard", "pimhbm.verify",
            "pimhbm.join_master"} <= set(paths)
    # A fresh process: in this one other tests may have imported the submodules already. Only
    # the modules the README's own code imports by name (`import pimhbm.flax`) are loaded.
    named = sorted(set(re.findall(r"^(?:import|from) .*?\b(pimhbm\.\w+)", "".join(python_blocks()),
                                  re.M)))
    code = ("import functools, importlib, sys, pimhbm\n"
            f"for module in {named!r}:\n"
            "    importlib.import_module(module)\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        functools.reduce(getattr, path.split('.')[1:], pimhbm)\n"
            "    except AttributeError:\n"
            "        print(path)\n")
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], "README names missing after `import pimhbm`"


def resolve(path: str):
    """The object a dotted path names; a submodule the README imports by name (pimhbm.flax) is
    imported on the way, as the README's code does."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=2):
        if not hasattr(obj, name):
            importlib.import_module(".".join(parts[:i]))
        obj = getattr(obj, name)
    return obj


def calls(text: str):
    """(function, its keywords) for each pimhbm call in ``text``; a nested call's keywords are
    its own, not the outer call's."""
    for call in re.finditer(r"(pimhbm(?:\.\w+)+|\bTrainer)\(", text):
        depth, args = 1, []
        for ch in text[call.end():]:
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
            args.append(ch if depth == 1 else " ")
        yield call.group(1), re.findall(r"(\w+)=(?!=)", "".join(args))


def test_the_keywords_of_the_calls_the_readme_writes_exist():
    checked = 0
    for span in spans():
        for name, keywords in calls(span.group(1)):
            fn = resolve("pimhbm.recovery.Trainer" if name == "Trainer" else name)
            params = inspect.signature(fn).parameters
            for keyword in keywords:
                assert keyword in params, f"README: {span.group(1)!r}: {name} has no {keyword}="
                checked += 1
    assert checked >= 5  # shm_name=, resume=, group=, device_copy=, recheck_every=, ...


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.splitlines()[0][:40])
def test_each_python_block_of_the_readme_runs_on_the_cpu(block):
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_readme_shows_guard_in_a_block_that_runs():
    assert any("pimhbm.guard(" in block and "assert" in block for block in python_blocks())


def test_every_command_and_option_the_readme_names_is_accepted():
    """Walks the inline code in order: a command (`pimhbm recover`, `recover`,
    `llama3 --deterministic`) is the owner of the options named after it until the next
    command; `--opt a|b` must list exactly the option's choices."""
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    command, checked = None, 0
    for span in spans():
        words = span.group(1).split()
        if words[0] == "pimhbm" and len(words) > 1:
            words = words[1:]
            assert words[0] in commands, f"README: no command `pimhbm {words[0]}`"
        if words[0] in commands:
            command, words = words[0], words[1:]
        elif not words[0].startswith("--"):
            if len(words) > 1 and words[1].startswith("--"):
                command = None  # another program's options (bench/..., scripts/...)
            continue
        elif words[0].startswith("--xla"):
            continue  # an XLA flag, not ours
        for i, word in enumerate(words):
            if not word.startswith("--"):
                continue
            assert command, f"README: `{span.group(1)}` names no pimhbm command before it"
            options = {o: a for a in commands[command]._actions for o in a.option_strings}
            assert word in options, f"README: `pimhbm {command}` has no {word}"
            value = words[i + 1] if i + 1 < len(words) else ""
            if "|" in value:
                assert set(value.split("|")) == set(options[word].choices or ()), \
                    f"README: `pimhbm {command} {word}` takes {options[word].choices}"
            checked += 1
    assert checked >= 10
