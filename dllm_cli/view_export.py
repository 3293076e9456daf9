"""`--save`: the canvas view as an SVG (the final frame) or an HTML step-by-step player.

Both files are self-contained: no script, style sheet or font is fetched from anywhere, so they
open offline and can be mailed or archived as they are. Frames are the terminal view's own
renderables (CanvasView.render), drawn to HTML with one shared style sheet.
"""

from __future__ import annotations

import dataclasses
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, RenderableType
from rich.segment import Segment
from rich.terminal_theme import MONOKAI, TerminalTheme

from dllm_cli.errors import write_text
from dllm_cli.view import CanvasView, check_save_path

if TYPE_CHECKING:
    from dllm_cli.runtime import Runtime

THEME: TerminalTheme = MONOKAI
MONO = "'DejaVu Sans Mono', Menlo, Consolas, 'Liberation Mono', 'Courier New', monospace"
FONT_ASPECT = 0.6  # width / height of DejaVu Sans Mono (Rich stretches each run to its cells)

# Rich's export_svg fills these fields; this template names local fonts only (Rich's default
# one downloads Fira Code from a CDN).
SVG_FORMAT = """\
<svg class="dllm-view" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">
    <style>
    .{unique_id}-matrix {{
        font-family: MONO;
        font-size: {char_height}px;
        line-height: {line_height}px;
        font-variant-east-asian: full-width;
    }}
    .{unique_id}-title {{ font-size: 18px; font-weight: bold; font-family: sans-serif; }}
    {styles}
    </style>
    <defs>
    <clipPath id="{unique_id}-clip-terminal">
      <rect x="0" y="0" width="{terminal_width}" height="{terminal_height}" />
    </clipPath>
    {lines}
    </defs>
    {chrome}
    <g transform="translate({terminal_x}, {terminal_y})" clip-path="url(#{unique_id}-clip-terminal)">
    {backgrounds}
    <g class="{unique_id}-matrix">
    {matrix}
    </g>
    </g>
</svg>
""".replace("MONO", MONO)


class Recorder:
    """Frames for --save: the last one as SVG, or every step as an HTML player."""

    def __init__(
        self,
        path: Path,
        width: int = 120,
        prompt: str = "",
        settings: list[tuple[str, str, str]] | None = None,
        headline: str = "",
    ):
        check_save_path(path)
        self.path, self.html = path, path.suffix.lower() == ".html"
        self.prompt, self.settings, self.headline = prompt, settings or [], headline
        self.console = Console(
            record=True, width=width, file=io.StringIO(), force_terminal=True,
            color_system="truecolor",
        )  # fmt: skip
        self.frames: list[tuple[str, str]] = []  # (label, HTML of the frame)
        self.classes: dict[str, str] = {}  # CSS declarations -> class name, shared by frames

    def frame(self, view: CanvasView) -> None:
        """Keep this step's frame (HTML only: the SVG is the final frame)."""
        if self.html and view.event is not None:
            self.frames.append((f"step {view.event.step + 1}", self.draw(view.render())))

    def save(self, view: CanvasView, answer: str = "") -> Path:
        """Write the file with the final frame last; returns where it went."""
        if self.html:
            self.frames.append(("final", self.draw(view.render())))
            text = self.page(answer)
        else:
            self.console.print(view.render())
            text = self.console.export_svg(
                title="dllm", theme=THEME, code_format=SVG_FORMAT, font_aspect_ratio=FONT_ASPECT
            )
        write_text(self.path, text)
        return self.path

    # --- HTML ---------------------------------------------------------------------------
    def draw(self, renderable: RenderableType) -> str:
        """One frame as HTML lines: runs of one style become one classed <span>."""
        lines = self.console.render_lines(renderable, pad=False)
        return "\n".join("".join(self.span(run) for run in runs(line)) for line in lines)

    def span(self, run: tuple[str, str]) -> str:
        text, css = run
        if not css:
            return html.escape(text)
        name = self.classes.setdefault(css, f"s{len(self.classes)}")
        return f'<span class="{name}">{html.escape(text)}</span>'

    def page(self, answer: str) -> str:
        """The whole player: prompt, settings, controls, every frame, the answer, the script."""
        frames = "\n".join(
            f'<pre class="frame" data-label="{html.escape(label)}"'
            f"{'' if n == len(self.frames) - 1 else ' hidden'}>{body}</pre>"
            for n, (label, body) in enumerate(self.frames)
        )
        rows = "\n".join(
            f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td>"
            f'<td class="from">{html.escape(where)}</td></tr>'
            for k, v, where in self.settings
        )
        styles = "\n".join(f".{name} {{ {css} }}" for css, name in self.classes.items())
        return PAGE.format(
            title=html.escape(f"dllm visualize: {self.prompt[:60]}"),
            background=THEME.background_color.hex,
            foreground=THEME.foreground_color.hex,
            mono=MONO,
            styles=styles,
            prompt=html.escape(self.prompt),
            headline=html.escape(self.headline),
            settings=rows,
            last=len(self.frames) - 1,
            count=len(self.frames),
            frames=frames,
            answer=html.escape(answer),
            script=SCRIPT,
        )


def run_settings(runtime: Runtime) -> list[tuple[str, str, str]]:
    """(key, value, where it came from) of everything that shaped this decode, for the page."""
    prof, came = runtime.profile, runtime.provenance
    loaded = runtime.loaded
    rows = [
        ("profile", prof.name, str(prof.source or "")),
        ("model", str(prof.model.path), source(came, "model.path")),
        ("architecture", loaded.architecture, ""),
        ("device", f"{loaded.device} {loaded.dtype}".replace("torch.", ""), ""),
    ]
    if runtime.guide is not None and prof.guide is not None:
        for key, value in dataclasses.asdict(prof.guide).items():
            rows.append((f"guide.{key}", str(value), source(came, f"guide.{key}")))
    else:
        rows.append(("guide", "none", ""))
    for key, value in runtime.settings.to_dict().items():
        if value is not None:
            rows.append((key, str(value), source(came, f"decode.{key}")))
    return rows


def source(provenance: dict[str, str], key: str) -> str:
    """command line | profile | default (the profile's file is on its own row)."""
    where = provenance.get(key, "default")
    return "command line" if where == "cli" else where.split(" ", 1)[0]


def run_headline(runtime: Runtime) -> str:
    """The settings that shape the picture most, on one line."""
    s, loaded = runtime.settings, runtime.loaded
    how = f"unmask {s.unmask}"
    if runtime.guide is not None and runtime.profile.guide is not None:
        g = runtime.profile.guide
        how = f"guided by {g.path} (accept {g.accept}): left to right"
    model = f"{loaded.architecture} {runtime.profile.model.path}"
    parts = [f"profile {runtime.profile.name}", model, f"gen_length {s.gen_length}"]
    return " · ".join([*parts, f"block_length {s.block_length}", f"cache {s.cache}", how])


def runs(line: list[Segment]) -> list[tuple[str, str]]:
    """(text, CSS) of a rendered line, neighbours of one style merged, trailing blanks cut."""
    out: list[tuple[str, str]] = []
    for seg in line:
        if seg.control or not seg.text:
            continue
        css = seg.style.get_html_style(THEME) if seg.style else ""
        if out and out[-1][1] == css:
            out[-1] = (out[-1][0] + seg.text, css)
        else:
            out.append((seg.text, css))
    while out and not out[-1][0].strip() and "background" not in out[-1][1]:
        out.pop()
    return out


PAGE = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ background: {background}; color: {foreground}; margin: 1.5em;
       font-family: system-ui, sans-serif; }}
h1 {{ font-size: 1.3em; margin: 0 0 .6em; }}
h2 {{ font-size: 1em; margin: 1em 0 .3em; color: #aaa; }}
pre {{ font-family: {mono}; font-size: 14px; line-height: 1.35; margin: 0; }}
#prompt {{ white-space: pre-wrap; border-left: 3px solid #666; padding: .3em .8em; }}
#settings {{ border-collapse: collapse; font-size: 13px; }}
#settings th {{ text-align: left; font-weight: normal; color: #aaa; padding: 0 1em 0 0; }}
#settings td {{ font-family: {mono}; padding: 0 1em 0 0; }}
#settings td.from {{ font-family: inherit; color: #888; }}
#controls {{ display: flex; gap: .6em; align-items: center; margin: 1em 0 .6em;
            position: sticky; top: 0; background: {background}; padding: .4em 0; }}
#controls button {{ font-size: 15px; min-width: 2.6em; }}
#slider {{ flex: 1; max-width: 40em; }}
#keys {{ color: #888; font-size: 13px; }}
#answer {{ white-space: pre-wrap; }}
#headline {{ font-family: {mono}; font-size: 14px; margin: 0 0 .3em; }}
summary {{ color: #aaa; font-size: 13px; cursor: pointer; }}
details {{ margin-top: 1.2em; }}
{styles}
</style>
</head>
<body>
<h1>dllm visualize</h1>
<h2>Prompt</h2>
<pre id="prompt">{prompt}</pre>
<h2>Settings</h2>
<p id="headline">{headline}</p>
<div id="controls">
<button id="play" type="button" title="play / pause (space)">&#9654; Play</button>
<button id="prev" type="button" title="previous step (&larr;)">&lsaquo; prev</button>
<button id="next" type="button" title="next step (&rarr;)">next &rsaquo;</button>
<input id="slider" type="range" min="0" max="{last}" value="{last}" aria-label="step">
<output id="label">final ({count} of {count})</output>
<label>speed <select id="speed">
<option value="1200">slow</option><option value="500" selected>normal</option>
<option value="150">fast</option></select></label>
<span id="keys">&larr; &rarr; step &middot; space play/pause &middot; Home / End</span>
</div>
<div id="frames">
{frames}
</div>
<section id="answer-box"><h2>Answer</h2><pre id="answer">{answer}</pre></section>
<details open><summary>Every setting, and where it came from</summary>
<table id="settings">
{settings}
</table>
</details>
<script>
{script}
</script>
</body>
</html>
"""

# The player: one frame visible at a time; without scripts the page shows the final frame.
SCRIPT = """\
(() => {
  const frames = Array.from(document.querySelectorAll("#frames .frame"));
  const $ = (id) => document.getElementById(id);
  const slider = $("slider"), play = $("play"), label = $("label"), speed = $("speed");
  const answer = $("answer-box");
  const last = frames.length - 1;
  let at = 0, timer = null;
  function show(i) {
    at = Math.max(0, Math.min(last, i));
    frames.forEach((f, k) => { f.hidden = k !== at; });
    slider.value = at;
    label.textContent = `${frames[at].dataset.label} (${at + 1} of ${frames.length})`;
    answer.hidden = at !== last;
    document.body.dataset.frame = at;
  }
  function stop() {
    clearInterval(timer);
    timer = null;
    play.innerHTML = "&#9654; Play";
  }
  function tick() {
    show(at + 1);
    if (at >= last) stop();
  }
  function start() {
    if (at >= last) show(0);
    clearInterval(timer);
    timer = setInterval(tick, Number(speed.value));
    play.innerHTML = "&#10074;&#10074; Pause";
  }
  const toggle = () => (timer ? stop() : start());
  play.addEventListener("click", toggle);
  $("prev").addEventListener("click", () => { stop(); show(at - 1); });
  $("next").addEventListener("click", () => { stop(); show(at + 1); });
  slider.addEventListener("input", () => { stop(); show(Number(slider.value)); });
  speed.addEventListener("change", () => { if (timer) start(); });
  const keys = {
    ArrowLeft: () => { stop(); show(at - 1); },
    ArrowRight: () => { stop(); show(at + 1); },
    Home: () => { stop(); show(0); },
    End: () => { stop(); show(last); },
    " ": toggle,
  };
  document.addEventListener("keydown", (ev) => {
    const inControl = ev.target.closest && ev.target.closest("button, select");
    if (!(ev.key in keys) || (ev.key === " " && inControl)) return;
    ev.preventDefault();
    keys[ev.key]();
  });
  show(0);
})();
"""
