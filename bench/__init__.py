"""The benchmark harness (entry point run_all.py) and its measurement tools (measure/)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root: the scripts run there
