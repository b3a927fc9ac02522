"""`python -m minivllm.bench [offline|prefix|kernels|serve]`: see bench/offline.py."""

from minivllm.bench.offline import main

raise SystemExit(main())
