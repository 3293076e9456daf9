"""One module per `dllm` subcommand; cli.py only wires them together."""
