"""The flags of bench/'s programs: a bad value is refused as it is read, before anything runs, in one line."""
import argparse
import math
import shlex

from bench import machine
from bench.family import MODES


class BadArgument(Exception):
    """Bad input: one line on stderr and exit 2, before anything runs."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage block would hide the one line that matters
        raise BadArgument(message)


def in_range(low, high=math.inf, kind=int):
    """A number in [low, high]: NaN and infinities are refused as a number outside it would be."""
    def number(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}")
        if not (low <= value <= high and math.isfinite(value)):
            bound = f"at least {low}" if high == math.inf else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    number.bounds = (low, high)  # for the test that every number flag is bounded
    return number


def in_range_list(low):
    """Distinct whole numbers of at least low, comma-separated: 0,1,2."""
    def numbers(text):
        values = [in_range(low)(v) for v in text.split(",")]
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct numbers such as 1,2,3, got {text!r}")
        return values
    numbers.bounds = (low, math.inf)
    return numbers


def mode_list(text):
    """Modes by name or by their script's number (01, 03, ...), in reading order whatever the order given."""
    numbers = {mode.number: name for name, mode in MODES.items()}
    modes = {numbers.get(m.strip(), m.strip()) for m in text.split(",")}
    if modes - set(MODES):
        raise argparse.ArgumentTypeError(f"unknown mode {', '.join(sorted(modes - set(MODES)))}: "
                                         f"choose from {', '.join(MODES)} (or their numbers)")
    return [m for m in MODES if m in modes]


def variant(text):
    name, sep, flags = text.strip().partition("=")
    if not sep or not name.isidentifier() or name == "base":
        raise argparse.ArgumentTypeError(f"expected NAME=\"FLAGS\", NAME of letters, digits and _ (not base), "
                                         f"got {text!r}")
    return name, shlex.split(flags)


CPU_PROCESSES = 2  # without GPUs: n up to 2, the fewest processes that meet in a collective


def add_devices(p):
    """--gpus and --cpu, which the sweep and the doctor both take, with the same meaning."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", type=in_range_list(0),
                       help="positions among the visible GPUs, e.g. 0,1,2,3 (default: all)")
    where.add_argument("--cpu", type=in_range(1), metavar="N",
                       help=f"1..N CPU processes, gloo, GPUs ignored (default {CPU_PROCESSES} without GPUs)")


def chosen_gpus(args):
    """[(id, name)] of the GPUs that --gpus names ([] with --cpu): positions among the visible ones."""
    visible = [] if args.cpu else machine.gpus()
    absent = [str(i) for i in args.gpus or [] if i >= len(visible)]
    if absent:
        raise BadArgument(f"GPU {', '.join(absent)} does not exist: {len(visible)} GPU(s) visible"
                          + ("" if visible else "; use --cpu N for the CPU"))
    return visible if args.gpus is None else [visible[i] for i in args.gpus]
