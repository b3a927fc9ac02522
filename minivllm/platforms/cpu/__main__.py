"""`python -m minivllm.platforms.cpu`: what the CPU runtime found on this machine (runtime.py)."""

from minivllm.platforms.cpu.runtime import main

raise SystemExit(main())
