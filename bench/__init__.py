"""The benchmark harness: `python bench/run_all.py` (or `python -m bench`). Imports run downwards only:

    run_all.py   the command line: choose devices, plan, print the plan, run it, report
    plan.py      what a sweep runs (modes, n, batches, variants, repeats) and what it leaves out, and why
    commands.py  the exact command of each run: the batch-size rules and the choice of GPUs
    runner.py    starting and stopping processes; one runs.csv row per run; the loader and all-reduce figures
    report.py    summary.csv and report.md;  plots.py  the four PNG plots
    measure/     tools that also run alone: loader_speed, allreduce, classic_vs_ours
    machine.py, files.py, scripts.py, fake_mnist.py   the machine, atomic files, the numbered scripts, MNIST files
"""
