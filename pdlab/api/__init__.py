"""pdlab serve: one variant's deployment behind an OpenAI-compatible HTTP server (docs/design.md, section 3).

    protocol.py   requests parsed from JSON into frozen dataclasses; OpenAI-style errors
    text.py       tokenizer, chat template, incremental detokenization
    model.py      what the server knows of the model: name, EOS tokens, limits
    output.py     a choice's text, stop strings and finish reason; response and chunk JSON
    job.py        one HTTP request's engine requests and their events
    bridge.py     the thread that drives the cluster
    ledger.py     the run directory: records of what was served, steps, transfers, trace
    metrics.py    /metrics (Prometheus; vLLM's names and pdlab's own)
    server.py     the aiohttp routes
    serving.py    bind, serve, shut down
"""
