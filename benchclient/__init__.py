"""pdserve's benchmark client (`pdserve bench`) and pool-sizing sweeps (`pdserve sweep`).

workload.py (what to send), arrivals.py (when), client.py (one timed stream), stats.py (the figures),
run.py (one load run), sweep_config.py / launcher.py / sweep.py (layouts x workloads x loads on a fresh
server each), plots.py and report.py (the outputs). Only client-side: it never imports the serving stack,
so it can drive any OpenAI-compatible server.
"""
