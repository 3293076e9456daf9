"""`dllm chat`: an interactive session with the model loaded once (docs/serving.md).

A prompt line with editing and history (prompt_toolkit) on a terminal, plain lines from a
pipe. Each answer is written to stdout as it is committed; `--visual` draws its canvas on
stderr as `dllm visualize` does, the answer following on stdout. Ctrl-C during an answer
stops it (the conversation stays as before the question); Ctrl-C at the prompt clears the
line; Ctrl-D or /exit ends the session.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dllm_cli import options as o

COMMANDS = {
    "/reset": "forget the conversation (a --system message stays)",
    "/settings": "show the decoding settings and where each came from",
    "/set": "KEY=VALUE: change a decoding setting for the next answers (/set gen_length=64)",
    "/help": "list these commands",
    "/exit": "end the session (or Ctrl-D)",
}

Visual = Annotated[bool, o.output("Show each answer's canvas unmasking (on stderr).", "--visual")]
System = Annotated[
    str | None,
    typer.Option(
        "--system", help="A system message that starts the conversation.", show_default=False
    ),
]


@o.shared("model", "decode", "guide")
def chat_command(*, choices: o.Choices, visual: Visual = False, system: System = None) -> None:
    """Chat with the model: multi-turn through its chat template, answers streamed as they are committed. Commands: /reset, /settings, /help, /exit."""
    from dllm_cli.commands.common import cli_errors, load_runtime, note

    with cli_errors():
        from dllm_cli.prompt_text import check_text
        from dllm_cli.serve.conversation import Message
        from dllm_cli.serve.session import Session

        runtime = load_runtime(choices)
        session = Session(runtime)
        if system is not None:
            session.system = [Message("system", check_text(system))]
        read = line_reader()
        note("type a question; /help for commands, /exit or Ctrl-D to leave")
        while True:
            line = read()
            if line is None or line.strip() == "/exit":
                return
            if line.startswith("/"):
                command(session, line.strip())
                continue
            if line.strip():
                ask(session, line, visual)


def line_reader():
    """() -> the next line (None at the end): prompt_toolkit on a terminal, else stdin."""
    if sys.stdin.isatty() and sys.stdout.isatty():
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory

        prompt = PromptSession(history=InMemoryHistory())

        def read() -> str | None:
            while True:
                try:
                    return prompt.prompt("> ")
                except KeyboardInterrupt:  # at the prompt: clear the line, as a shell does
                    continue
                except EOFError:
                    return None

        return read

    def read_pipe() -> str | None:
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None

    return read_pipe


def command(session, line: str) -> None:
    from dllm_cli.commands.common import error_line, note, write
    from dllm_cli.errors import DllmError

    if line == "/reset":
        session.reset()
        note("conversation cleared")
    elif line == "/settings":
        rt = session.runtime
        for key, value in rt.settings.to_dict().items():
            source = rt.provenance.get(f"decode.{key}", "default")
            write(f"{key} = {value!r}  ({source})\n")
        write(f"guide = {rt.guide is not None and session.guided}\n")
    elif line.startswith("/set "):
        key, eq, value = line.removeprefix("/set ").partition("=")
        if not eq:
            error_line("/set takes KEY=VALUE (for example /set gen_length=64)")
            return
        try:
            session.set(key, value)
        except DllmError as e:
            error_line(str(e))
            return
        note(f"{key.strip()} = {value.strip()} for the next answers")
    elif line == "/help":
        for name, what in COMMANDS.items():
            write(f"{name:<10} {what}\n")
    else:
        error_line(f"unknown command {line.split()[0]!r} (/help lists them)")


def ask(session, question: str, visual: bool) -> None:
    """Answer one question, streamed; Ctrl-C stops it and keeps the session."""
    from dllm_cli.commands.common import error_line, note, write
    from dllm_cli.errors import InputError
    from dllm_cli.prompt_text import check_text

    try:
        prompt = session.prompt(check_text(question))
    except InputError as e:
        error_line(str(e))
        return
    if prompt.dropped:
        exchanges = f"{prompt.dropped} exchange{'s' if prompt.dropped > 1 else ''}"
        note(f"the conversation outgrew the context: dropped the oldest {exchanges}")
    answer = session.answer(question, prompt)
    try:
        if visual:
            show_canvas(session.runtime, answer)
            write(answer.text + "\n")
        else:
            for _, new in answer:
                write(new)
            write(answer.rest + "\n")
    except KeyboardInterrupt:
        write("\n")
        note("answer stopped (not kept in the conversation)")


def show_canvas(runtime, answer) -> None:
    """The canvas live on stderr (a summary line per step when stderr is no terminal)."""
    from dllm_cli.commands.visualize import drawn
    from dllm_cli.view import CanvasView

    view = CanvasView.for_runtime(runtime)
    with drawn(view) as redraw:
        for event, _ in answer:
            view.update(event, answer.run.seconds)
            redraw()
        view.finish(answer.result)
