"""The `pimhbm` command as a user runs it: its options, the parser's refusals, and every
subcommand on short settings with its exit code."""

import argparse

import numpy as np
import pytest

import pimhbm
import pimhbm_cli as cli


def subparsers():
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pimhbm {pimhbm.__version__}"


def test_every_option_has_help_and_every_description_is_plain_text():
    parser, commands = subparsers()
    assert set(commands) == set(cli.COMMANDS)
    for name, sub in commands.items():
        assert "``" not in (sub.description or ""), name
        for action in sub._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"pimhbm {name} {action.option_strings}: no help"
        text = sub.format_help()
        assert "(default: None)" not in text, name


@pytest.mark.parametrize("argv", [
    ["demo", "--steps", "0"], ["demo", "--faults", "-3"], ["demo", "--device", "tpu"],
    ["demo", "--kinds", "cosmic_ray"], ["recover", "--shard", "0"], ["recover", "--steps", "x"],
    ["llama3", "--tokens", "-1"], ["health", "--watch", "0"], ["scan-demo", "--flips", "-1"],
])
def test_bad_values_are_refused_by_the_parser_with_the_reason(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"pimhbm {argv[0]}: error: argument {argv[1]}" in err


@pytest.mark.parametrize("argv", [
    ["scan-demo", "--hidden", "64", "--layers", "1", "--vocab", "256", "--flips", "4",
     "--nonfinite", "2"],
    ["gate", "--layers", "1", "--hidden", "32", "--nonfinite", "3"],
    ["shard", "--rows", "256", "--cols", "64", "--chunk-bytes", "1024"],
    ["recover", "--devices", "1", "--steps", "12", "--faults", "1"],
    ["recover", "--devices", "4", "--shard", "2", "--steps", "12", "--faults", "1"],
], ids=["scan-demo", "gate", "shard", "recover-1-device", "recover-4-devices-fsdp"])
def test_each_command_runs_and_its_verdict_is_its_exit_code(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if argv[0] == "recover":
        assert "bit-identical" in out and "compilations after prewarm 0" in out


def test_recover_refuses_more_devices_than_there_are(capsys):
    assert cli.main(["recover", "--devices", "64"]) == 2
    assert "--devices 64" in capsys.readouterr().out


def test_demo_refuses_a_width_whose_heads_the_model_cannot_split(capsys):
    assert cli.main(["demo", "--hidden", "6", "--steps", "2"]) == 2  # head dim 1: odd
    assert "--hidden 6" in capsys.readouterr().err


def test_run_stats_serialise_to_json_with_every_field():
    import json

    from pimhbm.recovery.events import Action, Incident, IncidentKind, RunStats
    from pimhbm.recovery.layout import ChunkRef
    stats = RunStats(steps_committed=3, losses={1: 2.5, 2: 2.25}, suspect_devices={3, 1},
                     aux={2: {"accuracy": np.float32(0.5), "counts": np.array([1, 2])}})
    stats.incidents.append(Incident(2, IncidentKind.STATE, (ChunkRef(0, "w", "mu", 7),),
                                    Action.REPAIRED_FROM_REPLICA, sources=(1,)))
    back = json.loads(stats.to_json())
    assert back["losses"] == {"1": 2.5, "2": 2.25} and back["suspect_devices"] == [1, 3]
    assert back["aux"] == {"2": {"accuracy": 0.5, "counts": [1, 2]}}
    assert back["incidents"][0]["kind"] == "state"
    assert back["incidents"][0]["locations"] == [{"device": 0, "leaf": "w", "tensor": "mu",
                                                  "chunk": 7}]
    assert "healthy replica (device 1)" in back["incidents"][0]["description"]
    assert set(back) == {f for f in RunStats.__dataclass_fields__}


def test_output_to_a_file_is_not_wrapped_at_80_columns(tmp_path, capsys):
    from pimhbm_cli import options
    line = "x" * 150
    options.console().print(line)
    assert line in capsys.readouterr().out  # pytest captures: not a terminal


def test_the_progress_line_never_counts_a_later_fault_as_found():
    from types import SimpleNamespace

    from pimhbm_cli.demo import progress_counts

    class Planned(SimpleNamespace):
        pass

    class FakeCampaign:
        plan = [Planned(step=3), Planned(step=9)]

        def check(self, stats):
            for f in self.plan:  # both found: the step-9 fault by a step in flight
                f.detected = f.repaired = True

    assert progress_counts(FakeCampaign(), None, 5) == (1, 1, 1)
    assert progress_counts(FakeCampaign(), None, 9) == (2, 2, 2)


def test_report_plot_writes_a_picture_of_a_run(tmp_path):
    import pimhbm
    from pimhbm.recovery.events import Action, Incident, IncidentKind, RunStats
    stats = RunStats(losses={s: 3.0 / s for s in range(1, 30)})
    stats.incidents.append(Incident(7, IncidentKind.STATE, (), Action.REPAIRED_FROM_REPLICA))
    path = pimhbm.report.plot(stats, str(tmp_path / "loss.png"), reference=stats)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no losses"):
        pimhbm.report.plot(RunStats(), str(tmp_path / "empty.png"))


def test_llama3_snapshots_as_often_as_the_trainer_by_default():
    from pimhbm.recovery.trainer import SNAPSHOT_EVERY
    from pimhbm_cli import llama3
    p = argparse.ArgumentParser()
    llama3.add_arguments(p)
    assert p.parse_args([]).snapshot_every == SNAPSHOT_EVERY
    assert p.parse_args(["--snapshot-every", "7"]).snapshot_every == 7  # the option is read


def test_the_checks_words_name_every_mode_once():
    """--gradient-checks and --parameter-checks list their words without loading jax; each
    names one pimhbm.inplace.GradientChecks and one ParameterChecks, and every mode has a
    word."""
    from pimhbm import inplace
    from pimhbm_cli import options

    assert [options.gradient_checks(w) for w in options.CHECKS_WHERE] == list(
        inplace.GradientChecks)
    assert [options.parameter_checks(w) for w in options.CHECKS_WHERE] == list(
        inplace.ParameterChecks)
    import subprocess
    import sys
    loads = ("import sys, pimhbm_cli.options as o; o.add_checks(__import__('argparse')"
             ".ArgumentParser()); print('jax' in sys.modules)")  # in a fresh interpreter
    fresh = subprocess.run([sys.executable, "-c", loads], capture_output=True, text=True)
    assert fresh.stdout.strip() == "False", fresh.stderr[-2000:]
