"""The data of this run: musique_dev items 30-99 (the validation split) with their retrieved passages 5-9
instead of 0-4, contexts no selector choice was ever made on (every tuning and validation run used the first
five). Run from the repository root; the eval's items 0-39 are musique_dev items 30-69.

    python docs/results/issue14/other_passages/make_data.py /tmp/musique_val_passages5to9.json
    OMP_NUM_THREADS=2 kvblend eval --data /tmp/musique_val_passages5to9.json --items 0-39 --passages 5 \
        --methods full,blend@0.15,blend@0.15:v --repeats 1 --warmup 0 --out docs/results/issue14/other_passages
"""

import json
import sys

from blend.defaults import DEFAULT_EVAL_DATA

items = json.load(open(DEFAULT_EVAL_DATA))
json.dump([dict(it, ctxs=it["ctxs"][5:10]) for it in items[30:100]], open(sys.argv[1], "w"))
