"""Measurements that also run alone (`python -m bench.measure.<tool> --help`); the harness runs the first two."""
