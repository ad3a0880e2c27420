"""Data that ships with the package.

corpus.txt: the demo's training text, byte level -- the project's own documentation and source
code, frozen into one file (about 330 KB).
"""

from importlib import resources


def corpus_bytes() -> bytes:
    return resources.files(__package__).joinpath("corpus.txt").read_bytes()
