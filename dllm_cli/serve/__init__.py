"""`dllm serve` and `dllm chat`: one resident model behind an OpenAI-compatible API or a prompt.

- conversation.py: chat messages -> token ids (multi-turn, user text kept as text).
- protocol.py: request bodies -> validated jobs; OpenAI-style error objects.
- answers.py: committed token prefixes -> streamed text, stop strings, finish reasons.
- worker.py: the stepping thread that owns the engines (one per settings group, bounded);
  tickets.py: a request's ticket and outcome records.
- scores.py: answer logprobs and echo scores (scoring.py) in OpenAI's logprobs shapes.
- metrics.py: Prometheus text exposition of the server's counters and histograms.
- plumbing.py: what the routes share (Served, the API key, error answers, bodies, events).
- app.py: the OpenAI routes; ollama.py: Ollama's (ollama_request.py: its bodies -> jobs).
- server.py: uvicorn, signals and graceful shutdown.

Nothing here imports Typer; the commands live in dllm_cli/commands/serve.py and chat.py.
"""
