"""The page `swarm monitor` serves: one HTML document with its CSS and JS inline (nothing is fetched from
elsewhere, so it works on a machine with no internet access). The script fetches `status.json` every
`every` seconds and redraws the tables and the SVG charts from it. Every text that comes from the swarm
(names, peer ids) is set as text, never as HTML: records are written by peers we do not trust.
"""

from __future__ import annotations

_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>swarm monitor</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.2em 2em; color: #222; background: #fafafa; }
  h1 { font-size: 1.4em; margin: 0 0 .2em; }
  h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
  #summary, #verdict { margin: .2em 0; }
  #verdict { font-weight: 600; }
  #error { color: #b00; font-weight: 600; }
  table { border-collapse: collapse; background: #fff; }
  th, td { padding: .25em .8em; border-bottom: 1px solid #ddd; text-align: right; white-space: nowrap; }
  th { background: #eee; }
  td.text, th.text { text-align: left; }
  tr.moving td { color: #a60; }
  tr.behind td { color: #06c; }
  .charts { display: flex; flex-wrap: wrap; gap: 1em; }
  figure { margin: 0; background: #fff; border: 1px solid #ddd; padding: .5em; }
  figcaption { font-weight: 600; margin-bottom: .3em; }
  svg { width: 520px; height: 220px; display: block; }
  svg text { font-size: 11px; fill: #555; }
  .legend span { display: inline-block; margin-right: 1em; }
  .legend i { display: inline-block; width: 1.2em; height: 3px; vertical-align: middle; margin-right: .3em; }
  .empty { color: #888; font-style: italic; }
</style>
</head>
<body>
<h1 id="title">swarm</h1>
<div id="summary">waiting for the first snapshot of the swarm…</div>
<div id="verdict"></div>
<div id="error"></div>

<h2>Servers</h2>
<table id="servers">
  <thead><tr><th class="text">server</th><th class="text">peer</th><th>stage</th><th>throughput</th>
    <th>queue</th><th>calls</th><th>epoch</th><th>pending</th><th class="text">state</th>
    <th class="text">moved from</th></tr></thead>
  <tbody></tbody>
</table>

<h2>Stages</h2>
<table id="stages">
  <thead><tr><th>stage</th><th>servers</th><th>epoch</th><th>capacity</th><th>pending</th></tr></thead>
  <tbody></tbody>
</table>

<h2>Trainers</h2>
<table id="trainers">
  <thead><tr><th class="text">peer</th><th>samples</th><th>samples/s</th><th>loss</th><th class="val">val loss</th>
    <th>failed</th><th class="text">state</th></tr></thead>
  <tbody></tbody>
</table>

<h2>Over time</h2>
<div class="charts">
  <figure><figcaption>Throughput by stage (samples/s)</figcaption><svg id="chart-throughput"></svg>
    <div class="legend" id="legend-throughput"></div></figure>
  <figure><figcaption>Loss (dashed: validation)</figcaption><svg id="chart-loss"></svg>
    <div class="legend" id="legend-loss"></div></figure>
  <figure><figcaption>Epoch by stage</figcaption><svg id="chart-epoch"></svg>
    <div class="legend" id="legend-epoch"></div></figure>
</div>

<h2>Moves between stages</h2>
<ul id="moves"><li class="empty">none seen</li></ul>

<script>
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const SVG = "http://www.w3.org/2000/svg";
let every = 2;

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : String(c));  // text stays text
  return node;
}
const num = (v, digits) => (v === null || v === undefined) ? "–" : Number(v).toFixed(digits);
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const cell = (v, cls) => el("td", cls ? {class: cls} : {}, v);

function render(d) {
  every = d.every || every;
  document.getElementById("title").textContent = "swarm " + JSON.stringify(d.run_id);
  const servers = d.stages.flatMap((s) => s.servers);
  document.getElementById("summary").textContent = d.time === null ? "waiting for the first snapshot of the swarm…"
    : `snapshot at ${clock(d.time)}: ${d.num_stages} stages, ${servers.length} servers, ${d.trainers.length} trainers`;
  document.getElementById("verdict").textContent = d.verdict ? "verdict: " + d.verdict.text : "";

  document.querySelector("#servers tbody").replaceChildren(...servers.map((s) => el("tr",
    {class: "server " + s.state, "data-peer": s.peer_id, "data-stage": s.stage},
    cell(s.name || "–", "text"), cell(s.label, "text"), cell(s.stage), cell(num(s.throughput, 1)), cell(s.queue),
    cell(s.calls), cell(s.epoch), cell(s.pending), cell(s.state, "text"),
    cell(s.previous_stage >= 0 ? "stage " + s.previous_stage : "–", "text"))));

  document.querySelector("#stages tbody").replaceChildren(...d.stages.map((s) => el("tr", {class: "stage"},
    cell(s.stage), cell(s.servers.length), cell(s.epoch === null ? "–" : s.epoch), cell(num(s.capacity, 1)),
    cell(s.pending))));

  const hasVal = d.trainers.some((t) => t.val_loss !== undefined && t.val_loss !== null);
  document.querySelectorAll("#trainers .val").forEach((n) => { n.hidden = !hasVal; });
  document.querySelector("#trainers tbody").replaceChildren(...d.trainers.map((t) => {
    const val = cell(num(t.val_loss, 3), "val");
    val.hidden = !hasVal;
    return el("tr", {class: "trainer", "data-peer": t.peer_id}, cell(t.label, "text"),
      cell(t.completed.toLocaleString()), cell(num(t.samples_per_second, 1)), cell(num(t.loss, 3)), val,
      cell(t.failed), cell(t.done ? "done" : "training", "text"));
  }));

  const series = d.series || {};
  const byStage = (name) => Object.entries(series[name] || {}).sort((a, b) => a[0] - b[0])
    .map(([stage, points]) => ({name: "stage " + stage, points, color: COLORS[Number(stage) % COLORS.length]}));
  const marks = d.moves.map((m) => m.time);
  chart("throughput", byStage("throughput"), marks);
  chart("epoch", byStage("epoch"), marks);
  const trainers = Object.keys(series.trainer_loss || {}).sort();
  chart("loss", trainers.flatMap((peer, i) => [
    {name: peer + " loss", points: series.trainer_loss[peer], color: COLORS[i % COLORS.length]},
    ...(series.trainer_val_loss && series.trainer_val_loss[peer] ? [{name: peer + " validation",
      points: series.trainer_val_loss[peer], color: COLORS[i % COLORS.length], dash: "5 4"}] : []),
  ]), []);

  const moves = document.getElementById("moves");
  moves.replaceChildren(...(d.moves.length ? d.moves.slice().reverse().map((m) => el("li", {class: "move"},
    `${clock(m.time)}: ${m.name ? m.name + " " : ""}${m.label} moved from stage ${m.from} to stage ${m.to}`))
    : [el("li", {class: "empty"}, "none seen")]));
}

// A line chart of `lines` ({name, points: [[unix time, value]], color, dash}) with vertical marks at `marks`.
function chart(id, lines, marks) {
  const svg = document.getElementById("chart-" + id);
  const W = 520, H = 220, L = 48, R = 10, T = 10, B = 22;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const all = lines.flatMap((l) => l.points);
  document.getElementById("legend-" + id).replaceChildren(...lines.map((l) => el("span", {},
    el("i", {style: `background:${l.color}`}), l.name)));
  if (!all.length) {
    svg.replaceChildren(el("svg:text", {x: W / 2, y: H / 2, "text-anchor": "middle"}, "no data yet"));
    return;
  }
  let [t0, t1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  if (t1 <= t0) t1 = t0 + 1;
  let [v0, v1] = [Math.min(0, ...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (id === "loss") v0 = Math.min(...all.map((p) => p[1])) * 0.95;  // a loss is read near its values
  if (v1 <= v0) v1 = v0 + 1;
  const x = (t) => L + (t - t0) / (t1 - t0) * (W - L - R);
  const y = (v) => H - B - (v - v0) / (v1 - v0) * (H - T - B);
  const parts = [];
  for (let i = 0; i <= 4; i++) {
    const v = v0 + (v1 - v0) * i / 4;
    parts.push(el("svg:line", {x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#eee"}),
      el("svg:text", {x: L - 4, y: y(v) + 4, "text-anchor": "end"}, v >= 100 ? v.toFixed(0) : v.toPrecision(3)));
  }
  parts.push(el("svg:text", {x: L, y: H - 6}, clock(t0)), el("svg:text", {x: W - R, y: H - 6, "text-anchor": "end"},
    clock(t1)));
  for (const m of marks.filter((t) => t >= t0 && t <= t1)) {
    parts.push(el("svg:line", {class: "move-mark", x1: x(m), x2: x(m), y1: T, y2: H - B, stroke: "#2ca02c",
      "stroke-dasharray": "2 3"}));
  }
  for (const l of lines) {
    parts.push(el("svg:polyline", {class: "series", "data-name": l.name, fill: "none", stroke: l.color,
      "stroke-width": 1.6, "stroke-dasharray": l.dash || "none",
      points: l.points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ")}));
  }
  svg.replaceChildren(...parts);
}

async function poll() {
  try {
    const reply = await fetch("status.json", {cache: "no-store"});
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    render(await reply.json());
    document.getElementById("error").textContent = "";
  } catch (e) {
    document.getElementById("error").textContent = "cannot read the monitor's data (" + e.message + ")";
  } finally {
    setTimeout(poll, every * 1000);
  }
}
poll();
</script>
</body>
</html>
"""

PAGE = _HTML.encode()
