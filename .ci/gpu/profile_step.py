"""On a GPU (.ci/gpu/run.sh): decode steps at batch 64 timed with CUDA graphs and eager, and an eager step
profiled (the host ops that issue it, the GPU kernels it runs).  python3 .ci/gpu/profile_step.py CHECKPOINT"""
import sys, time, torch
from minivllm import LLM, SamplingParams
path = sys.argv[1]
for eager in (False, True):
    llm = LLM(path, device="cuda", enforce_eager=eager, max_num_seqs=64, num_kv_blocks=8192,
              async_scheduling=False)                 # one step timed alone: the plain engine's step
    engine = llm.llm_engine
    for i in range(64):
        engine.add_request({"prompt_token_ids": [1000 + (i * 7 + j) % 30000 for j in range(500)]},
                           SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id=f"r{i}")
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(30):
        torch.cuda.synchronize(); t = time.perf_counter(); engine.step(); torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    g = engine.model_runner.graphs
    print(f"{'eager' if eager else 'graphs'}: decode step at batch {len(engine.scheduler.running)}: median "
          f"{times[15]*1e3:.2f} ms, min {times[0]*1e3:.2f} ms; graph replays {g.stats.replays if g else 0}")
    if eager:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    llm.shutdown()
    del llm, engine
