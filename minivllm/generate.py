"""`python -m minivllm.generate`: vLLM's offline CLI entry point; the code is in entrypoints/generate.py."""

from minivllm.entrypoints.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
