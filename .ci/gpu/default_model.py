"""On a GPU machine without the default model (.ci/gpu/run.sh, setup stage): random weights (std 0.05) with
SmolLM2-135M's config, written into the default model's cache directory next to the config and tokenizer that
.ci/gpu/prepare.sh copied there, so the tests that take `model_dir` run (the real GGUF is too large to carry).
Those tests compare two paths of minivllm (graphs and eager, Triton and PyTorch), not text."""
import os, sys, torch, transformers
d = os.path.join(os.environ["MINIVLLM_CACHE"], "SmolLM2-135M-Instruct")
if os.path.exists(os.path.join(d, "model.safetensors")):
    sys.exit(0)
cfg = transformers.AutoConfig.from_pretrained(d)
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg)
with torch.no_grad():
    for p in m.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.05)
m.to(torch.float32).save_pretrained(d)
print("random SmolLM2 weights written to", d)
