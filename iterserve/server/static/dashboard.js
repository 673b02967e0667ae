// The iterserve dashboard: polls /v1/dashboard once a second and draws it on canvases. No dependencies.
"use strict";

const COLORS = { waiting: "#c9ced8", prefill: "#e8a33d", decode: "#3d7be8", preempted: "#d93b3b" };
const MAX_ROWS = 40;  // the latest requests; enough rows stay tall enough to label

function canvas(id) {
  const c = document.getElementById(id);
  const ratio = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = c.clientHeight;  // the CSS box; the bitmap follows it at the pixel ratio
  c.width = w * ratio; c.height = h * ratio;
  const ctx = c.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

// One row per request seen in the window, ordered by first appearance; a cell per step.
function drawTimeline(state) {
  const { ctx, w, h } = canvas("timeline");
  const steps = state.steps;
  if (!steps.length) { ctx.fillStyle = "#7a8394"; ctx.fillText("no steps yet", 8, 16); return; }
  const order = [], first = {};
  steps.forEach((s, i) => {
    for (const id of s.prefill.concat(s.decode, s.preempted)) {
      if (!(id in first)) { first[id] = i; order.push(id); }
    }
  });
  const rows = order.slice(-MAX_ROWS);
  const label = 90, cw = (w - label) / steps.length, rh = Math.max(3, Math.min(14, (h - 4) / rows.length));
  rows.forEach((id, r) => {
    const y = r * rh;
    ctx.fillStyle = "#4a5366";
    if (rh >= 8) { ctx.font = `${Math.min(11, rh - 1)}px system-ui, sans-serif`; ctx.fillText(id.slice(0, 12), 2, y + rh - 1); }
    const arrival = state.arrivals[id];
    steps.forEach((s, i) => {
      let kind = null;
      if (s.preempted.includes(id)) kind = "preempted";
      else if (s.prefill.includes(id)) kind = "prefill";
      else if (s.decode.includes(id)) kind = "decode";
      else if (arrival !== undefined && i < first[id] && s.end >= arrival) kind = "waiting";
      if (kind) { ctx.fillStyle = COLORS[kind]; ctx.fillRect(label + i * cw, y + 1, Math.max(cw, 1), rh - 1); }
    });
  });
}

function drawLine(id, values, max, format) {
  const { ctx, w, h } = canvas(id);
  const top = Math.max(max || 0, ...values, 1e-9);
  ctx.strokeStyle = "#dde1e7"; ctx.beginPath(); ctx.moveTo(0, h - 14.5); ctx.lineTo(w, h - 14.5); ctx.stroke();
  ctx.strokeStyle = "#3d7be8"; ctx.lineWidth = 1.5; ctx.beginPath();
  values.forEach((v, i) => {
    const x = values.length > 1 ? (i / (values.length - 1)) * w : 0, y = (h - 16) * (1 - v / top) + 2;
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#4a5366";
  ctx.fillText("max " + format(top), 4, 12);
  if (values.length) ctx.fillText("now " + format(values[values.length - 1]), w - 90, 12);
}

function drawHistogram(id, values) {
  const { ctx, w, h } = canvas(id);
  if (!values.length) { ctx.fillStyle = "#7a8394"; ctx.fillText("no finished requests yet", 8, 16); return; }
  const sorted = values.slice().sort((a, b) => a - b);
  const q = (p) => sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
  const lo = sorted[0], hi = Math.max(q(0.99), lo + 1e-6), bins = 30, counts = new Array(bins).fill(0);
  for (const v of sorted) counts[Math.min(bins - 1, Math.floor(((v - lo) / (hi - lo)) * bins))]++;
  const top = Math.max(...counts), bw = w / bins;
  ctx.fillStyle = "#3d7be8";
  counts.forEach((c, i) => { const bh = (h - 30) * (c / top); ctx.fillRect(i * bw + 1, h - 16 - bh, bw - 2, bh); });
  ctx.fillStyle = "#4a5366";
  ctx.fillText(`${ms(lo)} .. ${ms(hi)}   p50 ${ms(q(0.5))}  p90 ${ms(q(0.9))}  p99 ${ms(q(0.99))}  (n=${sorted.length})`, 4, h - 3);
}

const ms = (s) => (s < 1 ? (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(2) + " s");

function tokensPerSecond(steps) {
  // per step: tokens it produced over the time since the previous step ended (idle gaps included)
  return steps.map((s, i) => {
    const prev = i ? steps[i - 1].end : s.start;
    return s.new_tokens / Math.max(s.end - prev, 1e-6);
  });
}

function render(state) {
  const steps = state.steps, last = steps[steps.length - 1];
  document.getElementById("n-running").textContent = last ? last.running : 0;
  document.getElementById("n-waiting").textContent = last ? last.waiting + last.swapped : 0;
  document.getElementById("kv").textContent = last ? (100 * last.kv_usage).toFixed(1) + "%" : "-";
  const tps = tokensPerSecond(steps), recent = tps.slice(-20);
  document.getElementById("tps").textContent = recent.length ? (recent.reduce((a, b) => a + b, 0) / recent.length).toFixed(1) : "-";
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  drawTimeline(state);
  drawLine("kv-chart", steps.map((s) => s.kv_usage), 1, (v) => (100 * v).toFixed(0) + "%");
  drawLine("queue-chart", steps.map((s) => s.waiting + s.swapped), 1, (v) => v.toFixed(0));
  drawLine("tps-chart", tps, 0, (v) => v.toFixed(0));
  drawHistogram("ttft-chart", state.ttft);
  drawHistogram("tpot-chart", state.tpot);
  const running = document.getElementById("running");
  running.className = state.running.length ? "" : "muted";
  running.textContent = state.running.length ? `${state.running.length} running: ${state.running.join(", ")}` : "none";
  const list = document.getElementById("diagnostics");
  list.replaceChildren();
  if (!state.config.diagnostics) list.innerHTML = '<li class="muted">diagnostics are off (--no-diagnostics)</li>';
  else if (!state.diagnostics.length) list.innerHTML = '<li class="muted">none</li>';
  for (const d of state.diagnostics) {
    const li = document.createElement("li"), kind = document.createElement("span");
    kind.className = "kind"; kind.textContent = d.kind + ": ";
    li.append(kind, document.createTextNode(d.message));
    list.append(li);
  }
}

async function poll() {
  try {
    const resp = await fetch("/v1/dashboard?steps=300", { headers: window.ITERSERVE_KEY ? { Authorization: "Bearer " + window.ITERSERVE_KEY } : {} });
    if (resp.status === 401) {
      window.ITERSERVE_KEY = prompt("API key for /v1/ routes");
    } else {
      render(await resp.json());
    }
  } catch (e) {
    document.getElementById("updated").textContent = "disconnected: " + e;
  }
  setTimeout(poll, 1000);
}
poll();
