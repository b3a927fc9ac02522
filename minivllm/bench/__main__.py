"""`python -m minivllm.bench [offline|prefix|kernels|serve]`: see bench/cli.py."""

from minivllm.bench.cli import main

raise SystemExit(main())
