"""The benchmark harness (entry point run_all.py, also `python -m bench`) and its measurement tools (measure/)."""
