from bench.run_all import main  # `python -m bench` is `python bench/run_all.py`

raise SystemExit(main())
