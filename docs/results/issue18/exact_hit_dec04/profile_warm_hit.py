import time, statistics, torch
from blend.engine import Engine
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore
from blend.evals.bench_prefill import _filler
eng = Engine.load("smollm2-135m", quality_gate=False)
docs = []
while len(eng.build_prompt("q", docs)) < 3500:
    docs.append(_filler(len(docs)))
question = ("Considering every section above, which repairs ran over budget, what changes to the ferry "
            "timetable were announced, and what is still wrong with the library roof? Please answer "
            "in one short sentence that names each of the three items clearly and briefly. If a section "
            "does not mention one of them, say which section would be the right place to look for it next.")
prompt = eng.build_prompt(question, docs)
print(len(docs), "docs", len(prompt))
fresh = eng.with_store(MemoryStore())
fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
ts = []
for _ in range(5):
    ts.append(fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1).ttft_s)
print("warm", ["%.0f" % (t * 1e3) for t in ts])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3):
        fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
