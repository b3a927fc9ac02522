"""`python -m minivllm.generate`: vLLM's offline CLI entry point; the code is in entrypoints/generate.py."""

if __name__ == "__main__":
    from minivllm.platforms.cpu import reexec_with_cpu_runtime
    reexec_with_cpu_runtime()           # tcmalloc preloaded when installed (platforms/cpu/runtime.py)

from minivllm.entrypoints.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
