"""`python -m dllm_cli` runs the same CLI as the `dllm` command."""

from dllm_cli.cli import main

if __name__ == "__main__":
    main()
