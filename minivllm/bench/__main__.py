"""`python -m minivllm.bench [offline|prefix|kernels|serve]`: see bench/cli.py."""

from minivllm.platforms.cpu import reexec_with_cpu_runtime

reexec_with_cpu_runtime()               # tcmalloc preloaded when installed (platforms/cpu/runtime.py)

from minivllm.bench.cli import main  # noqa: E402

raise SystemExit(main())
