"""`pdlab diagnose`: is prefill interference what breaks a service's ITL? (docs/design.md, section 2.13)

Online, against any OpenAI-compatible endpoint, within a printed plan's hard caps:

    plan.py       options, caps and the plan (what will be sent, at most); --dry-run prints it
    lengths.py    the mixed phase's prompt lengths (--lengths-from FILE)
    prompts.py    seeded prompts of a set length: token ids, or words where the server wants text
    connect.py    the checks before measuring (pdlab.external.probe) and the server's max_model_len
    budget.py     the gate every send goes through: requests, tokens, concurrency, rate, deadline
    phases.py     steady background streams, isolated probes of growing length, an optional mixed phase
    server_load.py  the server's running requests over time, from its /metrics where it has them
    session.py    one online diagnosis from the caller's thread, Ctrl-C included

Online and offline (`pdlab diagnose RUN_DIR`), the same analysis of what the client saw:

    streams.py    measured requests as typed Streams (send, chunk times, prompt tokens), to and from records
    tagging.py    every inter-token gap of the background streams tagged steady or stall
    fit.py        stall length against prompt tokens (a line, its R^2, where stalls level off)
    misses.py     steady ITL, ITL with the probes, the misses the windows explain, what else they follow
    verdict.py    the plain-words verdict and the numbers it rests on
    agreement.py  the tags held against a server's own steps (steps.jsonl), where there are some
    analysis.py   the above, once, into summary.json
    plots.py, html.py, output.py   the run directory's figures, the self-contained page, the files
"""
