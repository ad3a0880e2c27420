"""What every command's options share: values checked by the parser (a bad one is a usage error
with the reason, never a traceback later) and help that shows each default."""

from __future__ import annotations

import argparse
import sys
from typing import Any


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The command's description as written; every option's default after its help (but where
    the help says what happens without the option: a default of None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


# pimhbm.inplace.GradientChecks and ParameterChecks as `--gradient-checks` and
# `--parameter-checks` spell them (no jax at parsing).
CHECKS_WHERE = ("before-writes", "in-update")


def add_checks(p: argparse.ArgumentParser) -> None:
    """--gradient-checks and --parameter-checks: where the in-place update's checks run."""
    p.add_argument("--gradient-checks", choices=CHECKS_WHERE, default=None,
                   help="one copy: where non-finite gradients are found -- a pass over them "
                        "before the update's writes (a step with one is cancelled), or the "
                        "update itself (2 bytes a parameter fewer read; such a step is applied "
                        "in part, and the state comes back from the host snapshot). Default: "
                        "in-update where host snapshots are on, else before-writes")
    p.add_argument("--parameter-checks", choices=CHECKS_WHERE,
                   default=CHECKS_WHERE[0],
                   help="one copy: where damaged parameter chunks are found -- a pass over p "
                        "before the update's writes (the step is cancelled and the chunk "
                        "rebuilt from parity), or speculatively by the update itself (with "
                        "--gradient-checks in-update: no pass before the writes; such a step "
                        "does not commit, and the state comes back from the host snapshot)")


def gradient_checks(word: str | None):
    """The pimhbm.inplace.GradientChecks a --gradient-checks word names (None: the trainer's
    default, pimhbm.train.gradient_checks_for the run)."""
    from pimhbm.inplace import GradientChecks
    return None if word is None else GradientChecks[word.upper().replace("-", "_")]


def checks_word(where: Any) -> str:
    """The word of CHECKS_WHERE that names a pimhbm.inplace.GradientChecks or ParameterChecks."""
    return where.name.lower().replace("_", "-")


def parameter_checks(word: str):
    """The pimhbm.inplace.ParameterChecks a --parameter-checks word names (the same words)."""
    from pimhbm.inplace import ParameterChecks
    return ParameterChecks[word.upper().replace("-", "_")]


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


DEVICE_KINDS = ("cpu", "gpu")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICE_KINDS, default=None,
                   help="where to run (default: JAX's default device)")


def plain(docstring: str | None) -> str | None:
    """A module docstring as a command's description: without reStructuredText's double
    backquotes."""
    return None if docstring is None else docstring.replace("``", "")


# Lines written to a file or a pipe (a log) are not cut at 80 columns as rich would cut them.
LOG_WIDTH = 200


def console(**kwargs: Any):
    """The command's console: a terminal's width on a terminal; elsewhere lines as long as they
    are (up to LOG_WIDTH), not wrapped."""
    from rich.console import Console

    if not sys.stdout.isatty():
        kwargs.setdefault("width", LOG_WIDTH)
        kwargs.setdefault("soft_wrap", True)
    return Console(**kwargs)
