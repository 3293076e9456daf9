// dllm's chat page: a client of /v1/chat/completions that draws each answer's canvas from the
// step stream (stream_options.include_canvas) and settles into the answer's text.
(() => {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls) => Object.assign(document.createElement(tag), { className: cls });
  const config = JSON.parse($("config").textContent);
  const history = []; // {role, content} of the finished exchanges
  let running = null; // {controller, answer} while a request is in flight

  $("model").textContent = config.model;
  if (config.key) {
    $("key-box").hidden = false;
    $("key").value = sessionStorage.getItem("dllm-key") || "";
    $("key").addEventListener("change", () => sessionStorage.setItem("dllm-key", $("key").value));
  }

  // --- settings panel: one field per request-settable setting, empty = the server's value ---
  const fields = new Map();
  function settingField(row) {
    const label = document.createElement("label");
    label.textContent = row.name;
    let input;
    if (row.type === "bool" || row.choices.length) {
      input = document.createElement("select");
      const options = row.type === "bool" ? ["true", "false"] : row.choices;
      input.append(new Option(`(${row.value})`, ""));
      options.forEach((o) => input.append(new Option(o, o)));
    } else {
      input = document.createElement("input");
      input.placeholder = row.value === null ? "unset" : String(row.value);
    }
    input.name = row.name;
    label.append(input);
    fields.set(row.name, { row, input });
    return label;
  }
  const rows = config.settings.map(settingField);
  if (config.guide) {
    rows.push(settingField({ name: "guide", type: "bool", value: true, choices: [] }));
  }
  $("settings-rows").append(...rows);

  function chosenSettings() {
    const out = {};
    for (const [name, { row, input }] of fields) {
      const text = input.value.trim();
      if (text === "") continue;
      out[name] = typedValue(row.type, text);
    }
    return out;
  }
  function typedValue(type, text) {
    if (type === "bool") return text === "true";
    if (/int|float/.test(type) && text !== "" && !Number.isNaN(Number(text))) return Number(text);
    return text; // anything else goes as typed: the server says what is wrong (400)
  }

  // --- the canvas of one answer --------------------------------------------------------------
  class Canvas {
    constructor(root, stats) {
      this.root = root;
      this.stats = stats;
      this.cells = [];
      this.blocks = [];
      this.frozen = [];
      this.current = 0;
      this.accepted = 0;
      this.corrected = 0;
      this.edits = 0;
      this.frames = 0;
      this.lastNew = [];
    }
    lay(layout) {
      this.layout = layout;
      this.stop = new Set(layout.stop);
      this.end = layout.gen_length;
      this.tokens = new Array(layout.gen_length).fill(null);
      layout.blocks.forEach(([a, b], i) => {
        const row = el("div", "block waiting");
        const mark = el("span", "mark");
        const cells = el("span", "cells");
        for (let p = a; p < b; p++) {
          const cell = el("span", "cell mask");
          cell.textContent = "░";
          cells.append(cell);
          this.cells.push(cell);
        }
        row.append(mark, cells);
        this.root.append(row);
        this.blocks.push({ a, b, row, mark, index: i });
      });
    }
    blockOf(pos) {
      return this.blocks.findIndex((b) => b.a <= pos && pos < b.b);
    }
    draw(frame) {
      if (frame.layout) this.lay(frame.layout);
      if (!this.layout) return;
      this.lastNew.forEach((c) => c.classList.remove("new"));
      this.lastNew = [];
      let last = -1;
      for (const [pos, tok, text, conf, fixed] of frame.commits) {
        this.put(pos, tok, text, conf, frame.step, fixed ? "guide" : this.layout.guided ? "accepted" : "");
        last = Math.max(last, pos);
      }
      for (const [pos, tok, text, conf] of frame.edits || []) {
        this.put(pos, tok, text, conf, frame.step, "edited");
        this.edits += 1;
      }
      for (const [pos, tok, text, conf] of frame.drafts || []) {
        this.put(pos, tok, text, conf, frame.step, "draft");
      }
      // A guided step starts in the frontier's block and may commit past its end: the block
      // it committed into last is the one it left off in (as the terminal view).
      const here = Math.min(frame.block, this.blocks.length - 1);
      this.current = last >= 0 ? Math.max(here, this.blockOf(last)) : here;
      if (frame.frozen) this.frozen.push(frame.frozen);
      this.window = frame.window;
      this.pruned = frame.final ? undefined : frame.pruned_from;
      this.accepted += frame.accepted || 0;
      this.corrected += frame.corrected || 0;
      this.frames += 1;
      this.marks(frame.final);
      this.count(frame);
      this.root.dataset.frames = String(this.frames);
    }
    put(pos, tok, text, conf, step, kind) {
      const cell = this.cells[pos];
      if (!cell) return;
      this.tokens[pos] = tok;
      if (this.stop.has(tok)) this.end = Math.min(this.end, pos);
      const shown = text.replace(/\n/g, "↵").trim() || "␣";
      cell.textContent = pos >= this.end ? "∎" : shown;
      cell.className = `cell ${pos >= this.end ? "end" : kind} new`;
      cell.style.color = pos >= this.end ? "" : stepColour(step, conf);
      cell.title = `position ${pos} · step ${step + 1} · confidence ${conf}`;
      this.lastNew.push(cell);
    }
    marks(final) {
      this.blocks.forEach((b, i) => {
        const filled = this.tokens.slice(b.a, b.b).every((t) => t !== null);
        let state = "waiting";
        let mark = "·";
        if (i === this.current && !final) [state, mark] = ["current", "▶"];
        else if (filled && this.cached(b)) [state, mark] = ["cached", "❄"];
        else if (filled) [state, mark] = ["done", "✓"];
        else if (this.pruned !== undefined && b.a >= this.pruned) [state, mark] = ["pruned", "✂"];
        b.row.className = `block ${state}`;
        b.mark.textContent = `${mark} B${i}`;
      });
    }
    cached(b) {
      const L = this.layout;
      if (L.cache === "freecache" || this.frozen.length) {
        return this.frozen.some(([a, z]) => a <= b.a && b.b <= z);
      }
      if ((L.cache === "prefix" || L.cache === "dual") && this.window) {
        const [w0, w1] = this.window;
        return b.b <= w0 || b.a >= w1;
      }
      return false;
    }
    count(frame) {
      const perForward = frame.forwards ? frame.committed / frame.forwards : 0;
      const rate = frame.seconds > 0 ? frame.committed / frame.seconds : 0;
      const parts = [
        `step ${frame.step + 1}`,
        `${frame.committed}/${this.layout.gen_length} committed`,
        `forwards ${frame.forwards}` + (frame.guide_forwards ? ` (+${frame.guide_forwards} guide)` : ""),
        `${perForward.toFixed(2)} tokens/forward`,
        `${rate.toFixed(1)} tok/s`,
      ];
      if (this.layout.guided) parts.push(`accepted ${this.accepted}`, `corrected ${this.corrected}`);
      if (this.edits) parts.push(`edits ${this.edits}`);
      this.stats.textContent = parts.join(" · ");
    }
  }

  // Hue from the commit step (golden-ratio spread), brightness from the confidence: the
  // terminal view's colours (view.py step_style).
  function stepColour(step, confidence) {
    const shade = Math.min(Math.max(confidence >= 0 ? confidence : Math.exp(confidence), 0), 1);
    const hue = ((step * 0.618034) % 1) * 360;
    return hsv(hue, 0.6, 0.5 + 0.5 * shade);
  }
  function hsv(h, s, v) {
    const f = (n) => {
      const k = (n + h / 60) % 6;
      return Math.round(255 * (v - v * s * Math.max(0, Math.min(k, 4 - k, 1))));
    };
    return `rgb(${f(5)}, ${f(3)}, ${f(1)})`;
  }

  // --- the chat ------------------------------------------------------------------------------
  function bubble(role, text) {
    const div = el("div", `msg ${role}`);
    if (text !== undefined) div.textContent = text;
    $("log").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  function answerBox() {
    const div = bubble("assistant");
    const stats = el("div", "stats");
    const canvas = el("div", "canvas");
    const text = el("div", "text");
    div.append(stats, canvas, text);
    return { div, stats, canvas, text, view: new Canvas(canvas, stats), content: "" };
  }

  function setState(state) {
    document.body.dataset.state = state;
    $("send").disabled = state === "decoding";
    $("stop").disabled = state !== "decoding";
  }

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = !message;
  }

  async function ask(question) {
    showError("");
    const user = bubble("user", question);
    const answer = answerBox();
    const controller = new AbortController();
    running = { controller, answer };
    setState("decoding");
    const messages = [...history, { role: "user", content: question }];
    const body = {
      messages,
      stream: true,
      stream_options: { include_canvas: true },
      ...chosenSettings(),
    };
    const headers = { "Content-Type": "application/json" };
    if (config.key) headers.Authorization = `Bearer ${$("key").value}`;
    try {
      const reply = await fetch("/v1/chat/completions", {
        method: "POST", headers, body: JSON.stringify(body), signal: controller.signal,
      });
      if (!reply.ok) {
        const error = await reply.json().catch(() => ({ error: { message: reply.statusText } }));
        throw new Error(`${reply.status}: ${error.error.message}`);
      }
      await readStream(reply.body, answer);
      settle(answer);
      history.push({ role: "user", content: question }, { role: "assistant", content: answer.content });
      setState("done");
    } catch (e) {
      if (controller.signal.aborted) {
        answer.div.classList.add("stopped");
        settle(answer);
        setState("stopped");
      } else {
        user.remove();
        answer.div.remove();
        $("question").value = question;
        showError(e.message);
        setState("error");
      }
    } finally {
      running = null;
    }
  }

  async function readStream(stream, answer) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data === "[DONE]") return;
        if (data) take(JSON.parse(data), answer);
      }
    }
  }

  function take(chunk, answer) {
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.canvas) {
      answer.view.draw(chunk.canvas);
      return;
    }
    const choice = chunk.choices && chunk.choices[0];
    const piece = choice && choice.delta && choice.delta.content;
    if (piece) {
      answer.content += piece;
      answer.text.textContent = answer.content;
    }
    if (chunk.usage) answer.usage = chunk.usage;
  }

  function settle(answer) {
    answer.canvas.classList.add("settled");
    answer.text.textContent = answer.content;
    if (answer.usage) {
      const u = answer.usage;
      const rate = u.seconds > 0 ? u.completion_tokens / u.seconds : 0;
      answer.stats.textContent = `${u.completion_tokens} tokens · ${u.steps} steps · ` +
        `forwards ${u.forwards}` + (u.guide_forwards ? ` (+${u.guide_forwards} guide)` : "") +
        ` · ${rate.toFixed(1)} tok/s`;
    }
    const toggle = el("button", "toggle");
    toggle.type = "button";
    toggle.textContent = "show canvas";
    toggle.addEventListener("click", () => answer.div.classList.toggle("show-canvas"));
    answer.stats.append(" ", toggle);
  }

  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const question = $("question").value.trim();
    if (!question || running) return;
    $("question").value = "";
    ask(question);
  });
  $("question").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.controller.abort());
  $("new").addEventListener("click", () => {
    if (running) running.controller.abort();
    history.length = 0;
    $("log").replaceChildren();
    showError("");
    setState("idle");
  });
})();
