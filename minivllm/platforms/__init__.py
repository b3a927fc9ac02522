"""What minivllm adapts to the machine it runs on (vLLM's `vllm/platforms/`): cpu.py, the CPU runtime."""
